"""``plan_ngpus='auto'``: autodist chooses data-parallel replicas x unit size. The choice
logic (property tests), the search at every unit size on one process, the report and
the plan file, the errors; multi-process parity is in test_autodist_parity.py."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from nnscaler_policy_autodist import NoPlanFits, plan_graph
from nnscaler_policy_autodist.mesh import (
    Mesh,
    rank_meshes,
    search_meshes,
    step_bound,
    unit_sizes,
)
from nnscaler_policy_autodist.pipeline import step_time

from nnscaler.config import ComputeConfig, ComputeConfigError
from nnscaler.graph import IRGraph, run_plan
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.policies import PolicyError
from nnscaler.trace import trace

CFG = GPTConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, seq_len=8)


@given(st.integers(1, 2048))
def test_unit_sizes_are_the_divisors(world):
    sizes = unit_sizes(world)
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == world
    assert all(world % n == 0 for n in sizes)
    assert len(sizes) == sum(world % n == 0 for n in range(1, world + 1))


meshes = st.lists(st.builds(
    lambda unit, replicas, t, mem: Mesh(unit, replicas, t, mem),
    st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]),
    st.one_of(st.none(), st.floats(1e-4, 10.0)), st.floats(1.0, 1e9)), min_size=1)


@given(meshes)
def test_the_best_mesh_is_first(found):
    ranked = rank_meshes(found)
    assert sorted(map(id, ranked)) == sorted(map(id, found))
    fit = [m for m in ranked if m.fits]
    assert ranked[:len(fit)] == fit  # every mesh that fits before any that does not
    for a, b in zip(fit, fit[1:]):
        assert (a.time_per_batch, a.memory) <= (b.time_per_batch, b.memory)
    rest = ranked[len(fit):]
    assert all(a.memory <= b.memory for a, b in zip(rest, rest[1:]))


@st.composite
def estimates(draw):
    """A world, and per unit size a true best step time (None: no plan fits) with a
    lower bound at most its time per batch, and the memory of its plan."""
    world = draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 64]))
    truth = {}
    for n in unit_sizes(world):
        step = draw(st.one_of(st.none(), st.floats(1e-3, 10.0)))
        slack = draw(st.floats(0.0, 1.0))
        per_batch = (step if step is not None else draw(st.floats(1e-3, 10.0))) / (world // n)
        truth[n] = (step, per_batch * slack, draw(st.sampled_from([1.0, 2.0, 3.0])))
    return world, truth


@given(estimates())
def test_pruning_never_discards_the_best_mesh(case):
    world, truth = case
    searched = []

    def search(n, cap):
        searched.append(n)
        step, _, mem = truth[n]
        if step is None:
            return Mesh(n, world // n, None, mem)
        if cap is not None and step > cap and n % 2:  # a search may stop above its cap
            return None
        return Mesh(n, world // n, step, mem)

    found = search_meshes(truth, world, lambda n: truth[n][1], search)
    every = [Mesh(n, world // n, step, mem) for n, (step, _, mem) in truth.items()]
    best = rank_meshes(every)[0]
    assert sorted(m.unit for m in found) == sorted(truth)
    chosen = rank_meshes(found)[0]
    if best.fits:
        assert (chosen.unit, chosen.step_time, chosen.memory) == (best.unit, best.step_time,
                                                                  best.memory)
    else:
        assert sorted(searched) == sorted(truth)  # nothing fits: every size was searched
    for m in found:
        if m.pruned == "time":  # skipped: its bound is above the best, which it cannot beat
            assert m.unit not in searched or m.bound >= best.time_per_batch
            assert m.bound >= best.time_per_batch * (1 - 1e-9)
    # visited by their bounds: the first is the most promising
    assert found[0].unit == min(truth, key=lambda n: (truth[n][1], n))


@given(st.lists(st.tuples(st.floats(1e-4, 1.0), st.floats(0.0, 1.0)), min_size=1, max_size=12),
       st.integers(1, 32), st.sampled_from([1.0, 2.0]))
def test_the_step_bound_is_below_every_step_time(stages, nmicros, share):
    times = [t for t, _ in stages]
    computes = [t * part for t, part in stages]  # of each stage's time, computation
    floor = sum(computes)
    assert step_bound(floor, len(stages), nmicros, share) <= step_time(
        times, nmicros, computes, share) * (1 + 1e-12)


def test_time_per_batch_counts_the_replicas():
    wide = Mesh(unit=1, replicas=4, step_time=0.010, memory=2.0)
    deep = Mesh(unit=4, replicas=1, step_time=0.004, memory=1.0)
    assert rank_meshes([deep, wide])[0] is wide  # 2.5 ms per batch against 4 ms


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPTWithLoss(CFG)
    batch = make_batch(CFG, 4)
    return model, batch, trace(model, {"batch": batch})


def auto(runtime, profile_dir, **pas):
    return SimpleNamespace(plan_ngpus="auto", runtime_ngpus=runtime, use_end2end=True,
                           use_zero=False, pas_config={"profile_dir": profile_dir, **pas})


def test_auto_searches_every_unit_size_and_records_the_mesh(gpt, tmp_path, caplog):
    model, batch, traced = gpt
    path = tmp_path / "plan.json"
    with caplog.at_level(logging.INFO, logger="nnscaler.autodist"):
        g, result = plan_graph(IRGraph.from_graph(traced),
                               auto(4, str(tmp_path / "p"), save_plan_path=str(path)))
    torch.testing.assert_close(run_plan(g, model, {"batch": batch}), model(batch), rtol=1e-5,
                               atol=1e-6)
    assert sorted(m.unit for m in result.meshes) == [1, 2, 4]
    assert all(m.unit * m.replicas == 4 for m in result.meshes)
    chosen = result.meshes[0]
    assert result.plan_ngpus == chosen.unit and chosen == rank_meshes(list(result.meshes))[0]
    assert chosen.step_time == pytest.approx(result.pipeline.step_time)
    text = caplog.text
    assert f"mesh: {chosen.describe()} (plan_ngpus='auto': chosen from 3 factorisation(s)" in text
    assert text.count("replica(s) x unit of") >= 4  # the mesh line, the chosen and 2 others
    saved = json.loads(path.read_text())
    assert saved["plan_ngpus"] == chosen.unit
    assert saved["mesh"]["unit"] == chosen.unit and saved["mesh"]["replicas"] == chosen.replicas
    assert [(m["unit"], m["replicas"]) for m in saved["mesh"]["searched"]] == [
        (m.unit, m.replicas) for m in result.meshes]
    # replayed under 'auto': the same unit size and the same choices
    g2, again = plan_graph(IRGraph.from_graph(traced),
                           auto(4, str(tmp_path / "p"), load_plan_path=str(path)))
    assert again.plan_ngpus == chosen.unit
    assert [s.choice for s in again.solutions] == [s.choice for s in result.solutions]


def test_auto_with_stages_searches_their_multiples(gpt, tmp_path):
    _, _, traced = gpt
    _, result = plan_graph(IRGraph.from_graph(traced), auto(
        4, str(tmp_path), pipeline_nstages=2, pipeline_nmicros=2))
    assert sorted(m.unit for m in result.meshes) == [2, 4]


def test_auto_without_a_fitting_mesh_names_the_least_memory(gpt, tmp_path):
    _, _, traced = gpt
    with pytest.raises(NoPlanFits, match=r"smallest memory any plan of this stage needs") as e:
        plan_graph(IRGraph.from_graph(traced), auto(2, str(tmp_path), mem_constraint=1e-6))
    assert "plan_ngpus='auto': no unit size of runtime_ngpus=2 fits" in "".join(
        getattr(e.value, "__notes__", []))


def test_auto_is_for_autodist_only(gpt):
    from nnscaler.policies import dp

    _, _, traced = gpt
    with pytest.raises(PolicyError, match=r"plan_ngpus='auto' is chosen by the autodist "
                                          r"policy only"):
        dp(IRGraph.from_graph(traced), ComputeConfig("auto", 2))


def test_auto_config():
    cfg = ComputeConfig("auto", 8, use_zero=True)
    assert ComputeConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["plan_ngpus"] == "auto"
    assert cfg.resolved(2).scale_units == 4
    with pytest.raises(ComputeConfigError, match="no scale units until autodist chooses plan_ngpus"):
        _ = cfg.scale_units
    with pytest.raises(ComputeConfigError, match="zero_ngroups must divide the number of scale"):
        ComputeConfig("auto", 8, use_zero=True, zero_ngroups=3)  # divides no unit count of 8


def _planning_work(batch_size, monkeypatch):
    """Solver calls, stage problems built, options and edges over them, and layout plans
    costed, while planning the test GPT traced at ``batch_size`` (2 stages of 2 devices)."""
    import nnscaler_policy_autodist.model as model_mod
    import nnscaler_policy_autodist.pipeline as pipeline_mod

    work = {"solves": 0, "builds": 0, "options": 0, "edges": 0, "plans": 0}
    solve, build, plan = pipeline_mod.solve, model_mod.CostModel.build, model_mod.plan

    def counted_solve(*args, **kwargs):
        work["solves"] += 1
        return solve(*args, **kwargs)

    def counted_build(self, *args, **kwargs):
        problem = build(self, *args, **kwargs)
        work["builds"] += 1
        work["options"] += sum(len(o) for o in problem.options)
        work["edges"] += len(problem.edges)
        return problem

    def counted_plan(*args, **kwargs):
        work["plans"] += 1
        return plan(*args, **kwargs)

    monkeypatch.setattr(pipeline_mod, "solve", counted_solve)
    monkeypatch.setattr(model_mod.CostModel, "build", counted_build)
    monkeypatch.setattr(model_mod, "plan", counted_plan)
    torch.manual_seed(0)
    traced = trace(GPTWithLoss(CFG), {"batch": make_batch(CFG, batch_size)})
    config = SimpleNamespace(plan_ngpus=4, runtime_ngpus=8, use_end2end=True, use_zero=False,
                             pas_config={"device_type": "H100", "pipeline_nstages": 2,
                                         "pipeline_nmicros": 4})
    plan_graph(IRGraph.from_graph(traced), config)
    return work


def test_planning_work_does_not_grow_with_the_batch(monkeypatch):
    """The batch dim splits the same ways into the unit's parts whatever its size, so a
    batch 64 times larger builds, costs and solves exactly as much (counted, not timed)."""
    with monkeypatch.context() as m:
        small = _planning_work(4, m)
    with monkeypatch.context() as m:
        large = _planning_work(256, m)
    assert small["solves"] > 0 and small["edges"] > 0 and small["plans"] > 0
    assert large == small


def test_the_memory_floor_is_below_every_plan(gpt, monkeypatch):
    """The floor that skips a unit size (weights and one micro-batch's activations over
    its devices) is at most the memory of the plan the search finds there."""
    import nnscaler_policy_autodist.policy as policy

    _, _, traced = gpt
    floors, found = {}, {}
    weights, search = policy._Bounds.weights, policy.search_pipeline_bounded

    def recorded_weights(self, model):
        value = weights(self, model)
        floors[model.units] = value
        return value

    def recorded_search(ops, n, *args, **kwargs):
        plan = search(ops, n, *args, **kwargs)
        if plan is not None:
            found[n] = max(s.mem for s in plan[2])
        return plan

    monkeypatch.setattr(policy._Bounds, "weights", recorded_weights)
    monkeypatch.setattr(policy, "search_pipeline_bounded", recorded_search)
    config = SimpleNamespace(plan_ngpus="auto", runtime_ngpus=4, use_end2end=True,
                             use_zero=True, pas_config={"device_type": "H100"})
    plan_graph(IRGraph.from_graph(traced), config)
    assert found
    for n, mem in found.items():
        assert 0 < floors[4 // n] / n <= mem
