"""Pipelined programs train exactly as the single-device model does.

Each test plans a model with the ``pp`` or ``hybrid`` policy, generates every rank's file
and trains two steps of ``pipeline_nmicros`` micro-batches on forked gloo processes:
the loss of every micro-batch, the gradients of the pieces (summed over their holders,
before and after ``sync_grad``) and the parameters after two SGD steps must equal the
single-process run (float32, rtol 1e-5). See ``pipeline_helpers.check_parity``.
"""

from __future__ import annotations

import pytest
from pipeline_helpers import config, plan, run_parity

from nnscaler.policies import hybrid, pp

SCHEDULES = ("gpipe", "1f1b", "1f1b_interleaved")
MODELS = ("mlp8", "gpt", "hf_gpt2")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", MODELS)
def test_pp_two_stages(tmp_path, name, schedule):
    """pp on 2 processes with each built-in schedule (the interleaved one runs 2 stages
    per device: 4 stages)."""
    cfg = config(2, pipeline_nmicros=4, pipeline_scheduler=schedule)
    graph = plan(name, pp, cfg)
    assert {op.stage for op in graph.nodes()} == set(range(4 if "interleaved" in schedule else 2))
    run_parity(tmp_path, name, graph, cfg)


@pytest.mark.parametrize("name", MODELS)
def test_hybrid_two_stages_times_two_way_tensor_parallel(tmp_path, name):
    """hybrid: 2 stages, each split over 2 devices by the tp chooser, on 4 processes."""
    cfg = config(4, pipeline_nstages=2, pipeline_nmicros=4, pipeline_scheduler="1f1b")
    graph = plan(name, hybrid, cfg)
    for op in graph.nodes():
        assert op.device in ((0, 1) if op.stage == 0 else (2, 3))
    results = run_parity(tmp_path, name, graph, cfg)
    # tensor parallelism inside the stages: some weight is split between the two devices
    assert any(meta.index != tuple((0, n) for n in meta.shape)
               for res in results for meta in res["fullmap"].values())


@pytest.mark.parametrize("name", MODELS)
def test_pp_two_stages_times_two_scale_units(tmp_path, name):
    """pp over 2 stages, data parallel over 2 scale units: 4 processes, each unit its own
    micro-batches; gradients summed over the units."""
    cfg = config(2, 4, pipeline_nmicros=4, pipeline_scheduler="1f1b")
    results = run_parity(tmp_path, name, plan(name, pp, cfg), cfg)
    holders = {m.holders for m in results[1]["fullmap"].values()}
    assert (1, 3) in holders


@pytest.mark.parametrize("policy,plan_ngpus", [("pp", 2), ("hybrid", 4)])
def test_first_and_last_layer_share_a_weight(tmp_path, policy, plan_ngpus):
    """The shared weight is held by the first and the last stage; their gradients are
    summed (holders over both stages), and both copies stay equal."""
    cfg = config(plan_ngpus, pipeline_nstages=2, pipeline_nmicros=2, pipeline_scheduler="1f1b")
    graph = plan("tied", {"pp": pp, "hybrid": hybrid}[policy], cfg)
    results = run_parity(tmp_path, "tied", graph, cfg)
    first, last = results[0]["fullmap"], results[-1]["fullmap"]
    shared = [a for a, m in first.items() if "last.weight" in m.names]
    assert shared and shared[0] in last
    assert len(first[shared[0]].holders) == 2  # one device of each stage


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gpt_with_zero_and_async_reducer(tmp_path, stage):
    """ZeRO (the tied embedding's optimizer state sharded over both stages; stage 2: the
    gradients too, reduce-scattered after each micro-batch's backward; stage 3: each
    stage's parameters sharded over its replicas, gathered per micro-batch, gradients
    reduce-scattered once, in the last micro-batch's backward) and the asynchronous
    reducer (which only accumulates during the schedule) keep parity."""
    cfg = config(2, 4, pipeline_nmicros=4, pipeline_scheduler="1f1b")
    cfg.use_zero, cfg.use_async_reducer, cfg.reducer_bucket_cap_mb = True, True, 0.0005
    cfg.zero_stage = stage
    run_parity(tmp_path, "gpt", plan("gpt", pp, cfg), cfg)
