"""ComputeConfig, ReuseType, BroadcastGenFilesStrategy: validation, JSON form, surface."""

from __future__ import annotations

import json
import pickle

import attrs
import pytest

from nnscaler import BroadcastGenFilesStrategy, ComputeConfig, ReuseType
from nnscaler.parallel import ComputeConfigError

# The public config surface: change it only on purpose (config.json stores it, and MATCH
# compares it, so a new field or default invalidates every saved generation).
SURFACE = [
    ("plan_ngpus", attrs.NOTHING),
    ("runtime_ngpus", attrs.NOTHING),
    ("use_zero", False),
    ("zero_ngroups", 1),
    ("use_end2end", False),
    ("inference_only", False),
    ("constant_folding", True),
    ("trace_strategy", "real"),
    ("use_async_reducer", False),
    ("reducer_bucket_cap_mb", None),
    ("allow_data_dependent", False),
    ("check_custom_ops", True),
    ("pas_config", {}),
    ("user_config", {}),
]


def _default(field: attrs.Attribute):
    if isinstance(field.default, attrs.Factory):
        return dict(field.default.factory())
    return field.default


def test_config_surface_is_frozen():
    fields = attrs.fields(ComputeConfig)
    assert [(f.name, _default(f)) for f in fields] == SURFACE
    assert all(f.kw_only for f in fields)
    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=1)
    assert sorted(cfg.to_dict()) == sorted(name for name, _ in SURFACE)


def test_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        ComputeConfig(1, 2)  # type: ignore[misc]
    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.plan_ngpus = 2  # type: ignore[misc]


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
    other = attrs.evolve(cfg, use_zero=False, zero_ngroups=1)
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
        ({"plan_ngpus": 1, "runtime_ngpus": 4, "use_zero": True, "zero_ngroups": 3},
         r"divide the number of scale units.*\[1, 2, 4\]"),
        ({"plan_ngpus": 1, "runtime_ngpus": 1, "trace_strategy": "cuda"}, "'real', 'meta'"),
        ({"plan_ngpus": 1, "runtime_ngpus": 1, "reducer_bucket_cap_mb": 0}, "positive number"),
        ({"plan_ngpus": 1, "runtime_ngpus": 1, "pas_config": [1]}, "pas_config must be a dict"),
        ({"plan_ngpus": 1, "runtime_ngpus": 1, "user_config": {1: 2}}, "keyed by strings"),
    ],
)
def test_invalid_configs(kwargs, message):
    with pytest.raises(ComputeConfigError, match=message):
        ComputeConfig(**kwargs)


def test_enums_accept_strings():
    assert ReuseType("match") is ReuseType.MATCH
    assert ReuseType("OVERRIDE") is ReuseType.OVERRIDE
    assert ReuseType.parse("Moo", "reuse") is ReuseType.MOO
    assert ReuseType.parse(ReuseType.GRAPH, "reuse") is ReuseType.GRAPH
    assert [s.value for s in BroadcastGenFilesStrategy] == ["none", "all", "no_weights", "code"]
    assert BroadcastGenFilesStrategy("NO_WEIGHTS") is BroadcastGenFilesStrategy.NO_WEIGHTS
    assert ReuseType.MATCH == "match" and str(ReuseType.MATCH) == "match"
    with pytest.raises(ValueError, match="'match', 'override', 'moo', 'graph', got 'reuse'"):
        ReuseType.parse("reuse", "reuse")


def test_trace_strategies_are_the_tracers():
    from nnscaler.parallel.config import TRACE_STRATEGIES
    from nnscaler.trace import STRATEGIES

    assert TRACE_STRATEGIES == STRATEGIES
