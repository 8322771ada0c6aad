"""ComputeConfig (nnscaler.config): validation, typed parts, JSON form, surface."""

from __future__ import annotations

import dataclasses
import json
import pickle
import types

import pytest

import nnscaler
import nnscaler.parallel
import nnscaler.parallel.config
from nnscaler.config import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_SCHEDULER,
    ComputeConfig,
    ComputeConfigError,
    PipelineConfig,
    ReducerConfig,
    TracingConfig,
    as_compute_config,
)

# The public config surface: change it only on purpose (config.json stores it, and MATCH
# compares it, so a new field or default invalidates every saved generation).
SURFACE = [
    ("plan_ngpus", dataclasses.MISSING),
    ("runtime_ngpus", None),
    ("use_zero", None),  # follows zero_stage (False when neither is given)
    ("zero_ngroups", 1),
    ("zero_stage", None),
    ("zero_units", ()),
    ("reduce_dtype", None),
    ("use_end2end", False),
    ("inference_only", False),
    ("constant_folding", True),
    ("trace_strategy", "real"),
    ("use_async_reducer", False),
    ("reducer_bucket_cap_mb", None),
    ("zero_use_reduce_scatter", False),
    ("allow_data_dependent", False),
    ("check_custom_ops", True),
    ("pas_config", {}),
    ("user_config", {}),
    ("compile", False),
]


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return dict(field.default_factory())
    return field.default


def test_config_surface_is_frozen():
    fields = dataclasses.fields(ComputeConfig)
    assert [(f.name, _default(f)) for f in fields] == SURFACE
    assert [f.name for f in fields if not f.kw_only] == ["plan_ngpus", "runtime_ngpus"]
    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=1)
    assert sorted(cfg.to_dict()) == sorted(name for name, _ in SURFACE)


def test_one_type_under_every_name():
    assert nnscaler.ComputeConfig is nnscaler.parallel.ComputeConfig is ComputeConfig
    assert nnscaler.parallel.config.ComputeConfig is ComputeConfig
    assert nnscaler.ComputeConfigError is nnscaler.parallel.ComputeConfigError
    assert nnscaler.ComputeConfigError is ComputeConfigError


def test_two_positional_then_keywords_and_frozen():
    cfg = ComputeConfig(1, 2, use_zero=True)  # as in nnScaler
    assert (cfg.plan_ngpus, cfg.runtime_ngpus, cfg.use_zero) == (1, 2, True)
    with pytest.raises(TypeError):
        ComputeConfig(1, 2, True)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.plan_ngpus = 2  # type: ignore[misc]


def test_replace_validates_again():
    cfg = ComputeConfig(2, 4, pas_config={"pipeline_nmicros": 2})
    more = dataclasses.replace(cfg, runtime_ngpus=8)
    assert more.runtime_ngpus == 8 and more.pipeline == cfg.pipeline
    with pytest.raises(ComputeConfigError, match="multiple of plan_ngpus"):
        dataclasses.replace(cfg, runtime_ngpus=3)


def test_typed_parts_are_defaulted_once():
    cfg = ComputeConfig(2, 8, use_zero=True, zero_ngroups=2, use_async_reducer=True,
                        trace_strategy="meta", pas_config={"pipeline_nmicros": 4})
    assert cfg.pipeline == PipelineConfig(nmicros=4, scheduler=DEFAULT_SCHEDULER)
    assert cfg.reducer == ReducerConfig(use_zero=True, zero_ngroups=2, async_op=True,
                                        bucket_cap_mb=DEFAULT_BUCKET_CAP_MB)
    assert cfg.tracing == TracingConfig(strategy="meta")
    assert ReducerConfig.from_options(cfg.reducer.as_options()) == cfg.reducer
    assert ReducerConfig.from_options({}) == ReducerConfig()
    assert ComputeConfig(1, 1).pipeline == PipelineConfig(nmicros=None, scheduler="1f1b")


@pytest.mark.parametrize(("kwargs", "use_zero", "stage"), [
    ({}, False, 0),
    ({"use_zero": True}, True, 1),  # as in nnScaler: use_zero is stage 1
    ({"zero_stage": 0}, False, 0),
    ({"zero_stage": 1}, True, 1),
    ({"zero_stage": 2}, True, 2),
    ({"use_zero": True, "zero_stage": 2, "zero_ngroups": 2}, True, 2),
    ({"zero_stage": 3, "zero_units": ["gpt.blocks.0", "gpt.blocks.1"]}, True, 3),
])
def test_zero_stage_and_use_zero_are_one_answer(kwargs, use_zero, stage):
    cfg = ComputeConfig(1, 4, **kwargs)
    assert (cfg.use_zero, cfg.zero_stage) == (use_zero, kwargs.get("zero_stage"))
    assert (cfg.reducer.use_zero, cfg.reducer.zero_stage) == (use_zero, stage)
    assert ReducerConfig.from_options(cfg.reducer.as_options()) == cfg.reducer
    again = ComputeConfig.from_dict(json.loads(cfg.to_json()))
    assert again == cfg and again.to_json() == cfg.to_json()


def test_zero_stage_disagreeing_with_use_zero_is_refused():
    with pytest.raises(ComputeConfigError,
                       match=r"use_zero=True disagrees with zero_stage=0 .*give one"):
        ComputeConfig(1, 2, use_zero=True, zero_stage=0)
    with pytest.raises(ComputeConfigError, match="use_zero=False disagrees with zero_stage=3"):
        ComputeConfig(1, 2, use_zero=False, zero_stage=3)
    cfg = ComputeConfig(1, 2, zero_stage=2)
    with pytest.raises(ComputeConfigError, match="disagrees"):
        dataclasses.replace(cfg, zero_stage=0)  # use_zero=True was set from stage 2
    with pytest.raises(ComputeConfigError, match="replace"):  # never kept sharding silently
        dataclasses.replace(cfg, use_zero=False)
    assert dataclasses.replace(cfg, use_zero=False, zero_stage=0).reducer.zero_stage == 0
    # use_zero alone keeps nnScaler's meaning, replaced or not
    assert dataclasses.replace(ComputeConfig(1, 2, use_zero=True),
                               use_zero=False).reducer.zero_stage == 0
    # a generated file of before zero_stage spells only use_zero
    assert ReducerConfig.from_options({"use_zero": True}).zero_stage == 1
    with pytest.raises(ComputeConfigError, match="disagrees"):
        ReducerConfig(use_zero=False, zero_stage=2)


def test_zero_stage_auto_is_chosen_then_resolved():
    """``zero_stage='auto'``: a policy (autodist) chooses among `zero_stages`; until
    then the config has no reducer; `resolved` makes it concrete, use_zero following."""
    cfg = ComputeConfig(1, 4, zero_stage="auto")
    assert (cfg.zero_stage, cfg.use_zero, cfg.zero_stages) == ("auto", None, (0, 1, 2, 3))
    with pytest.raises(ComputeConfigError, match="has no reducer until autodist chooses"):
        cfg.reducer  # noqa: B018
    assert ComputeConfig.from_dict(cfg.to_dict()) == cfg
    for stage in range(4):
        done = cfg.resolved(zero_stage=stage)
        assert (done.zero_stage, done.use_zero, done.reducer.zero_stage) == (
            stage, stage >= 1, stage)
    assert ComputeConfig(1, 4, zero_stage="auto", use_zero=True).zero_stages == (1, 2, 3)
    dtype = ComputeConfig(1, 4, zero_stage="auto", reduce_dtype="float32")
    assert dtype.zero_stages == (2, 3)
    with pytest.raises(ComputeConfigError, match=r"zero_stage=1 is not a stage .*\[2, 3\]"):
        dtype.resolved(zero_stage=1)
    both = ComputeConfig("auto", 4, zero_stage="auto", use_zero=True, zero_ngroups=2)
    assert both.resolved(2, zero_stage=3).reducer.zero_ngroups == 2
    with pytest.raises(ComputeConfigError, match="use_zero=False disagrees with zero_stage='auto'"):
        ComputeConfig(1, 4, zero_stage="auto", use_zero=False)
    with pytest.raises(ComputeConfigError, match="zero_units names ZeRO stage 3"):
        ComputeConfig(1, 4, zero_stage="auto", zero_units=["a"])
    with pytest.raises(ComputeConfigError, match="zero_stage must be one of"):
        ComputeConfig(1, 4, zero_stage="AUTO")


@pytest.mark.parametrize(("pas", "message"), [
    ({"pipeline_nmicros": 0}, r"pas_config\['pipeline_nmicros'\] is the number of micro"),
    ({"pipeline_nmicros": "4"}, "a positive int; got '4'"),
    ({"pipeline_scheduler": 3}, r"pas_config\['pipeline_scheduler'\] is the name"),
])
def test_pipeline_keys_are_checked_when_built(pas, message):
    with pytest.raises(ComputeConfigError, match=message):
        ComputeConfig(2, 2, pas_config=pas)


def test_as_compute_config_takes_objects_and_mappings():
    cfg = ComputeConfig(2, 2)
    assert as_compute_config(cfg) is cfg
    ns = types.SimpleNamespace(plan_ngpus=2, pas_config={"pipeline_nmicros": 2}, other=1)
    assert as_compute_config(ns) == ComputeConfig(2, 2, pas_config={"pipeline_nmicros": 2})
    assert as_compute_config({"plan_ngpus": 1, "runtime_ngpus": 4}).scale_units == 4
    with pytest.raises(ComputeConfigError, match="must be an nnscaler.ComputeConfig"):
        as_compute_config(object())
    with pytest.raises(ComputeConfigError, match="plan_ngpus is required"):
        as_compute_config({"use_zero": True})


def test_pas_config_is_a_frozen_copy():
    source = {"a": [1, 2], "b": {"c": 3}}
    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=1, pas_config=source)
    source["a"].append(4)
    source["b"]["c"] = 5
    assert cfg.pas_config["a"] == (1, 2) and cfg.pas_config["b"]["c"] == 3
    with pytest.raises(TypeError):
        cfg.pas_config["x"] = 1  # type: ignore[index]
    assert cfg.pas_config.to_dict() == {"a": [1, 2], "b": {"c": 3}}
    assert hash(cfg) == hash(ComputeConfig(plan_ngpus=1, runtime_ngpus=1,
                                           pas_config={"b": {"c": 3}, "a": (1, 2)}))


def test_json_round_trip_is_stable():
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=8, use_zero=True, zero_ngroups=2,
                        reducer_bucket_cap_mb=1.5, pas_config={"z": 1, "a": [True]},
                        user_config={"model": {"layers": 2}}, trace_strategy="meta")
    text = cfg.to_json()
    assert json.loads(text) == cfg.to_dict()
    again = ComputeConfig.from_dict(json.loads(text))
    assert again == cfg and again.to_json() == text
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert cfg.scale_units == 4 and cfg.bucket_cap_mb == 1.5
    assert ComputeConfig(plan_ngpus=1, runtime_ngpus=1).bucket_cap_mb == 25.0
    assert cfg.unit_ranks(5) == (4, 5) and cfg.replica_ranks(5) == (1, 3, 5, 7)
    assert cfg.diff(again) == {}
    other = dataclasses.replace(cfg, use_zero=False, zero_ngroups=1)
    assert set(cfg.diff(other)) == {"use_zero", "zero_ngroups"}
    with pytest.raises(ComputeConfigError, match="no field"):
        ComputeConfig.from_dict({**cfg.to_dict(), "bogus": 1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"plan_ngpus": 0, "runtime_ngpus": 1}, "plan_ngpus must be a positive int, got 0"),
        ({"plan_ngpus": True, "runtime_ngpus": 1}, "plan_ngpus must be a positive int"),
        ({"plan_ngpus": 2, "runtime_ngpus": 3}, "multiple of plan_ngpus.*2 or 4"),
        ({"plan_ngpus": 1, "runtime_ngpus": 2, "use_zero": 1}, "use_zero must be True or False"),
        ({"plan_ngpus": 1, "runtime_ngpus": 4, "zero_ngroups": 2}, "only applies with use_zero"),
        ({"plan_ngpus": 1, "runtime_ngpus": 2, "zero_stage": 4}, r"zero_stage must be one of \[0, 1, 2, 3\]"),
        ({"plan_ngpus": 1, "runtime_ngpus": 2, "zero_stage": True}, "zero_stage must be one of"),
        ({"plan_ngpus": 1, "runtime_ngpus": 2, "zero_stage": 2, "zero_units": ["a"]},
         "zero_units names ZeRO stage 3.s units, but zero_stage is 2"),
        ({"plan_ngpus": 1, "runtime_ngpus": 2, "zero_stage": 3, "zero_units": "a.b"},
         "zero_units must be a list of distinct module paths"),
        ({"plan_ngpus": 1, "runtime_ngpus": 2, "zero_stage": 3, "reduce_dtype": "fp32"},
         r"reduce_dtype is the dtype.*\['float32', 'bfloat16', 'float16'\].*got 'fp32'"),
        ({"plan_ngpus": 1, "runtime_ngpus": 2, "use_zero": True, "reduce_dtype": "float32"},
         "reduce_dtype='float32' is the dtype of ZeRO stage 2 and 3's.*zero_stage is 1"),
        ({"plan_ngpus": 1, "runtime_ngpus": 4, "use_zero": True, "zero_ngroups": 3},
         r"divide the number of scale units.*\[1, 2, 4\]"),
        ({"plan_ngpus": 1, "runtime_ngpus": 1, "trace_strategy": "cuda"}, "'real', 'meta'"),
        ({"plan_ngpus": 1, "runtime_ngpus": 1, "reducer_bucket_cap_mb": -1}, "positive number"),
        ({"plan_ngpus": 1, "runtime_ngpus": 2, "zero_use_reduce_scatter": True},
         "zero_use_reduce_scatter only applies with use_zero=True"),
        ({"plan_ngpus": 1, "runtime_ngpus": 1, "pas_config": [1]}, "pas_config must be a dict"),
        ({"plan_ngpus": 1, "runtime_ngpus": 1, "user_config": {1: 2}}, "keyed by strings"),
    ],
)
def test_invalid_configs(kwargs, message):
    with pytest.raises(ComputeConfigError, match=message):
        ComputeConfig(**kwargs)


def test_trace_strategies_are_the_tracers():
    from nnscaler.config import TRACE_STRATEGIES
    from nnscaler.trace import STRATEGIES

    assert TRACE_STRATEGIES == STRATEGIES
