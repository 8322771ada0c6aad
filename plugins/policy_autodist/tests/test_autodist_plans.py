"""autodist on one process: config keys, solvers, memory, constraints, plan files,
report, profile cache, errors. Every plan is replayed with run_plan against the model."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from nnscaler_policy_autodist import (
    AutoDistError,
    ConstraintError,
    NoPlanFits,
    PlanFileError,
    parse_config,
    plan_graph,
)

from nnscaler.graph import IRGraph, run_plan
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.trace import trace

CFG = GPTConfig(vocab_size=64, n_layer=3, n_head=4, d_model=32, seq_len=8)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPTWithLoss(CFG)
    batch = make_batch(CFG, 4)
    return model, batch, trace(model, {"batch": batch})


def config(n, profile_dir, runtime=None, **pas):
    return SimpleNamespace(plan_ngpus=n, runtime_ngpus=runtime or n, use_end2end=True,
                           use_zero=False, pas_config={"profile_dir": profile_dir, **pas})


def plan(gpt, n, profile_dir, **pas):
    model, batch, traced = gpt
    g, result = plan_graph(IRGraph.from_graph(traced), config(n, profile_dir, **pas))
    torch.testing.assert_close(run_plan(g, model, {"batch": batch}), model(batch), rtol=1e-5,
                               atol=1e-6)
    return g, result


# -- pas_config --------------------------------------------------------------------------
def test_unknown_key_names_the_closest():
    with pytest.raises(AutoDistError, match=r"unknown pas_config key 'mem_constriant'.*"
                                            r"Did you mean 'mem_constraint'"):
        parse_config({"mem_constriant": 4})


@pytest.mark.parametrize("key,value", [
    ("mem_constraint", -1), ("pipeline_nstages", 0), ("solver", "greedy"),
    ("max_partition_degree", 1.5), ("device_type", "TPUv9"), ("verbose", "yes"),
    ("recompute_modules", 3), ("partition_constraints_path", "/nonexistent.yaml"),
])
def test_bad_values_name_the_key(key, value):
    with pytest.raises(AutoDistError, match=repr(key).replace("[", r"\[")):
        parse_config({key: value})


def test_config_reads_every_key(tmp_path):
    cfg = parse_config({"mem_constraint": 2, "pipeline_nstages": "auto", "solver": "ilp",
                        "device_type": "h100", "recompute_modules": "Block, MLP"})
    assert cfg.mem_constraint == 2 * 1024**3 and cfg.device_type == "H100"
    assert cfg.recompute_modules == ("Block", "MLP")


# -- solvers -----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_dp_and_ilp_agree(gpt, n, tmp_path):
    _, dp = plan(gpt, n, str(tmp_path), solver="dp")
    _, ilp = plan(gpt, n, str(tmp_path), solver="ilp")
    # the ILP ties repeated blocks, the DP does not: the DP is never worse, and equal here
    assert dp.solutions[0].time <= ilp.solutions[0].time * (1 + 1e-9)
    assert dp.solutions[0].time == pytest.approx(ilp.solutions[0].time, rel=1e-6)


def test_second_compile_profiles_nothing(gpt, tmp_path):
    _, first = plan(gpt, 2, str(tmp_path))
    _, second = plan(gpt, 2, str(tmp_path))
    assert first.profiled > 0 and second.profiled == 0
    assert list((tmp_path).glob("compute-*.json"))


def test_memory_limit_holds_and_changes_the_plan(gpt, tmp_path):
    # named-GPU costs, so the unconstrained plan does not depend on this machine's load
    # (with measured times a loaded run could pick a plan already near the least memory)
    _, free = plan(gpt, 2, str(tmp_path), device_type="H100")
    weights_free = free.solutions[0].mem
    limit_gb = weights_free * 0.8 / 1024**3
    _, tight = plan(gpt, 2, str(tmp_path), mem_constraint=limit_gb, device_type="H100")
    assert tight.solutions[0].mem <= limit_gb * 1024**3
    assert tight.solutions[0].time >= free.solutions[0].time


def test_no_plan_fits_says_the_least_memory(gpt, tmp_path):
    with pytest.raises(NoPlanFits, match=r"smallest memory any plan of this stage needs is "
                                         r"[0-9.]+ GB") as e:
        plan(gpt, 2, str(tmp_path), mem_constraint=1e-6)
    assert e.value.need > 1e-6 * 1024**3


def test_pipeline_stages_cut_at_layers(gpt, tmp_path):
    g, result = plan(gpt, 4, str(tmp_path), pipeline_nstages=2, pipeline_nmicros=4)
    assert result.pipeline.nstages == 2 and result.pipeline.k == 2
    assert g.num_stages == 2
    first = result.problems[1].ops[0]
    assert first.module_path.startswith("gpt.blocks.") or first.module_path.startswith("gpt.")
    devices = {op.stage: set() for op in g.ops}
    for op in g.ops:
        devices[op.stage].add(op.device)
    assert devices == {0: {0, 1}, 1: {2, 3}}


def test_auto_stages_without_micro_batches_is_one_stage(gpt, tmp_path):
    _, result = plan(gpt, 2, str(tmp_path), pipeline_nstages="auto")
    assert result.pipeline.nstages == 1


def test_auto_stages_never_outnumber_the_layers(gpt, tmp_path):
    from nnscaler_policy_autodist.config import parse_config
    from nnscaler_policy_autodist.pipeline import count_layers, stage_counts

    ops = IRGraph.from_graph(gpt[2]).nodes()
    layers = count_layers(ops)
    assert layers >= 2  # the blocks, and what comes before and after them
    cfg = parse_config({"pipeline_nstages": "auto", "pipeline_nmicros": 4})
    counts = stage_counts(64, cfg, len(ops), layers)
    assert counts == [s for s in (1, 2, 4, 8, 16, 32, 64) if s <= layers]
    assert stage_counts(8, cfg, len(ops), 0) == [1, 2, 4, 8]  # no layers: one op a stage


def test_recompute_marks_groups_and_costs(gpt, tmp_path):
    g, result = plan(gpt, 2, str(tmp_path), recompute_modules="Block")
    groups = {op.recompute for op in g.ops if op.module_path.startswith("gpt.blocks.")}
    assert None not in groups and len(groups) == CFG.n_layer
    _, plain = plan(gpt, 2, str(tmp_path))
    act = sum(o.act for p in result.problems for opts in p.options for o in opts)
    act_plain = sum(o.act for p in plain.problems for opts in p.options for o in opts)
    assert act < act_plain


def test_recompute_unknown_module(gpt, tmp_path):
    with pytest.raises(AutoDistError, match="'Blok'.*Module classes of this model"):
        plan(gpt, 2, str(tmp_path), recompute_modules="Blok")


# -- constraints -------------------------------------------------------------------------
def test_constraints_are_honoured(gpt, tmp_path):
    path = tmp_path / "pc.yaml"
    path.write_text("- module: gpt.blocks\n  name: linear\n  splits: [replicate]\n")
    g, _ = plan(gpt, 2, str(tmp_path), partition_constraints_path=str(path))
    for op in g.ops:
        if op.module_path.startswith("gpt.blocks.") and op.name.endswith("linear"):
            assert all(x.is_whole for x in op.input_tensors())


@pytest.mark.parametrize("text,match", [
    ("- module: gpt.nothing\n  splits: [replicate]\n", "no op of the model matches"),
    ("- module: gpt.blocks\n  splits: ['a,b']\n", "must be 'replicate' or 'idx,dim'"),
    ("- module: gpt.blocks\n  split: [replicate]\n", "unknown field"),
    ("module: x\n", "must be a list"),
])
def test_bad_constraint_files(gpt, tmp_path, text, match):
    path = tmp_path / "pc.yaml"
    path.write_text(text)
    with pytest.raises(ConstraintError, match=match):
        plan(gpt, 2, str(tmp_path), partition_constraints_path=str(path))


# -- plan files --------------------------------------------------------------------------
def test_plan_roundtrip_keeps_choices(gpt, tmp_path):
    path = tmp_path / "plan.json"
    g1, r1 = plan(gpt, 2, str(tmp_path), save_plan_path=str(path))
    data = json.loads(path.read_text())
    assert len(data["ops"]) == len(r1.problems[0].ops)
    assert {e["split"] if isinstance(e["split"], str) else "split" for e in data["ops"]} <= {
        "replicate", "split"}
    g2, r2 = plan(gpt, 2, str(tmp_path), load_plan_path=str(path))
    assert r2.solutions[0].choice == r1.solutions[0].choice
    assert [(op.device, [x.indmap for x in op.input_tensors()]) for op in g1.ops] == [
        (op.device, [x.indmap for x in op.input_tensors()]) for op in g2.ops]


def test_edited_plan_is_replayed(gpt, tmp_path):
    path = tmp_path / "plan.json"
    plan(gpt, 2, str(tmp_path), save_plan_path=str(path))
    data = json.loads(path.read_text())
    for e in data["ops"]:
        e["split"] = "replicate"
    path.write_text(json.dumps(data))
    g, _ = plan(gpt, 2, str(tmp_path), load_plan_path=str(path))
    assert all(all(x.is_whole for x in op.input_tensors()) for op in g.ops)


def test_plan_for_another_graph_is_refused(gpt, tmp_path):
    path = tmp_path / "plan.json"
    plan(gpt, 2, str(tmp_path), save_plan_path=str(path))
    data = json.loads(path.read_text())
    data["ops"][3]["op"] = "torch.nn.functional.conv2d"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="op 3 is torch.nn.functional.conv2d"):
        plan(gpt, 2, str(tmp_path), load_plan_path=str(path))
    data["ops"] = data["ops"][:5]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="it has 5 ops"):
        plan(gpt, 2, str(tmp_path), load_plan_path=str(path))


# -- report ------------------------------------------------------------------------------
def test_report_is_logged(gpt, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="nnscaler.autodist"):
        plan(gpt, 2, str(tmp_path))
    text = caplog.text
    assert "estimated step time" in text and "communication" in text
    assert "GB per device (limit" in text and "gpt.py:" in text
    assert "data parallel over 1 scale unit(s), ZeRO stage 0" in text


def test_plan_for_a_named_device_needs_no_profiling(gpt, tmp_path):
    _, result = plan(gpt, 4, str(tmp_path), device_type="H100", mem_constraint=80)
    assert result.profiled == 0
    assert not list(tmp_path.glob("compute-*.json"))


_stage = st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0))  # (compute, communication)


@given(st.lists(_stage, min_size=1, max_size=6), st.integers(1, 8), st.floats(1.0, 4.0))
def test_pipeline_step_on_shared_cores(stages, nmicros, share):
    """Ranks sharing cores: a pipeline's waits leave cores to the other ranks, so its
    computation runs faster, never above the 1F1B latency at measured speeds nor below
    the cores' work; with a core per rank (share 1) or one stage, nothing changes."""
    from nnscaler_policy_autodist.pipeline import step_time

    computes = [c for c, _ in stages]
    times = [c + m for c, m in stages]
    plain = step_time(times, nmicros)
    shared = step_time(times, nmicros, computes, share)
    assert step_time(times, nmicros, computes, 1.0) == pytest.approx(plain)
    assert shared <= plain + 1e-12
    if len(stages) == 1:
        assert shared == pytest.approx(nmicros * times[0])
    else:
        assert shared >= nmicros * sum(computes) / len(computes) - 1e-12
        fast = [t - c * (1 - 1 / share) for t, c in zip(times, computes)]
        assert shared >= sum(fast) + (nmicros - 1) * max(fast) - 1e-12


def test_two_balanced_stages_on_half_a_core_each():
    from nnscaler_policy_autodist.pipeline import step_time

    # 2 stages of 1 s (measured at half a core), 2 micro-batches: 3 s at measured speed;
    # each rank waits a third of the time, so the cores' work (2 s) bounds the step
    assert step_time([1.0, 1.0], 2) == pytest.approx(3.0)
    assert step_time([1.0, 1.0], 2, [1.0, 1.0], 2.0) == pytest.approx(2.0)
