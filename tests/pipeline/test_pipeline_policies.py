"""The pp and hybrid policies: registration, where they cut, how they place, and the
errors for settings they cannot plan."""

from __future__ import annotations

import itertools

import pytest
import torch
from pipeline_helpers import case, config, plan

from nnscaler.errors import UnknownNameError
from nnscaler.graph import IRGraph, run_plan
from nnscaler.ir import tensors_in
from nnscaler.plugins import get_plugin_manager
from nnscaler.policies import PolicyError, hybrid, pp
from nnscaler.policies.pipeline import _inside, _layer, cut_points, op_cost


@pytest.mark.parametrize("name,policy", [("pp", pp), ("hybrid", hybrid)])
def test_registered_by_the_builtin_plugin(name, policy, fresh_plugins):
    pm = get_plugin_manager()
    assert pm.policies.get(name) is policy
    assert pm.policies.registrant(name) == "nnscaler.policies"


@pytest.mark.parametrize("name", ["mlp8", "gpt", "hf_gpt2"])
@pytest.mark.parametrize("policy,ngpus,nstages", [("pp", 2, 2), ("pp", 4, 4), ("hybrid", 4, 2)])
def test_plans_reproduce_the_model(name, policy, ngpus, nstages):
    """Every op placed on its stage's devices; the plan computes the model's loss and
    gradients (run_plan, one process)."""
    cfg = config(ngpus, pipeline_nstages=nstages, pipeline_nmicros=2)
    graph = plan(name, {"pp": pp, "hybrid": hybrid}[policy], cfg)
    k = ngpus // nstages
    for op in graph.nodes():
        assert op.stage * k <= op.device < (op.stage + 1) * k
    module = case(name).module
    batch = case(name).make_batch(0)
    module.zero_grad(set_to_none=True)
    want = module(batch)
    want.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    got = run_plan(graph, module, {"batch": batch})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.backward()
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6)
    module.zero_grad(set_to_none=True)


def test_gpt_is_cut_between_blocks_into_balanced_stages():
    graph = plan("gpt", pp, config(2, pipeline_nmicros=2))
    first = next(op for op in graph.nodes() if op.stage == 1)
    assert first.module_path == "gpt.blocks.2.ln_1"  # 4 blocks: 2 per stage
    graph = plan("hf_gpt2", pp, config(4, pipeline_nmicros=2))
    starts = [next(op for op in graph.nodes() if op.stage == s).module_path for s in (1, 2, 3)]
    assert starts == [f"model.transformer.h.{k}.ln_1" for k in (1, 2, 3)]


def test_interleaved_cuts_two_stages_per_device():
    graph = plan("mlp8", pp, config(2, pipeline_nmicros=2, pipeline_scheduler="1f1b_interleaved"))
    assert sorted({(op.stage, op.device) for op in graph.nodes()}) == [
        (0, 0), (1, 1), (2, 0), (3, 1)]


def test_cut_points_balance_the_cost():
    ops = IRGraph.from_graph(case("mlp8").graph).nodes()
    cuts = cut_points(ops, 4)
    costs = [op_cost(op) for op in ops]
    bounds = [0, *cuts, len(ops)]
    per_stage = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert max(per_stage) <= 1.5 * sum(costs) / 4


def _held(ops, bounds):
    """The parameter elements each stage reads (a tied weight in every stage reading it)."""
    out = []
    for a, b in zip(bounds, bounds[1:]):
        params = {t.full.root for op in ops[a:b] for t in tensors_in(op.inputs)
                  if t.full.is_param}
        out.append(sum(p.numel for p in params))
    return out


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2", "tied", "mlp8"])
@pytest.mark.parametrize("nstages", [2, 3])
def test_parameter_balance_minimizes_the_largest_stage(name, nstages):
    """``balance='parameters'``: the cuts reach the least possible largest stage, by
    parameters held, of every choice of layer starts (brute force)."""
    ops = IRGraph.from_graph(case(name).graph).nodes()
    layers = [_layer(op) for op in ops]
    starts = [i for i in range(1, len(ops))
              if layers[i] != layers[i - 1] and not _inside(layers[i - 1], layers[i])]
    if len(starts) < nstages - 1:
        starts = list(range(1, len(ops)))
    best = min(max(_held(ops, [0, *c, len(ops)]))
               for c in itertools.combinations(starts, nstages - 1))
    cuts = cut_points(ops, nstages, balance="parameters")
    assert max(_held(ops, [0, *cuts, len(ops)])) == best


def test_a_tied_weight_counts_in_both_stages():
    """The ``tied`` model's first and last layers share a weight: cut in two, each stage
    holds it, and the parameter balance counts it twice."""
    ops = IRGraph.from_graph(case("tied").graph).nodes()
    cuts = cut_points(ops, 2, balance="parameters")
    first, second = _held(ops, [0, *cuts, len(ops)])
    total = sum(p.numel() for p in case("tied").module.parameters())
    assert first + second > total


def test_parameter_balance_plans_reproduce_the_model():
    cfg = config(2, pipeline_nmicros=2, pipeline_balance="parameters")
    graph = plan("hf_gpt2", pp, cfg)
    module = case("hf_gpt2").module
    batch = case("hf_gpt2").make_batch(0)
    want = module(batch)
    got = run_plan(graph, module, {"batch": batch})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_linear_cost_counts_the_contracted_dim():
    ops = IRGraph.from_graph(case("mlp8").graph).nodes()
    linear = next(op for op in ops if op.name.endswith("linear"))
    assert op_cost(linear) == 4 * 8 * 16  # batch x in x out


@pytest.mark.parametrize("policy,ngpus,nstages,message", [
    (pp, 2, 4, r"policy 'pp': pas_config\['pipeline_nstages'\] asks for 4 pipeline stages, "
               r"but the scale unit has plan_ngpus=2 devices and each stage needs a device of "
               r"its own. Use pipeline_nstages <= 2"),
    (hybrid, 4, 8, r"policy 'hybrid': pas_config\['pipeline_nstages'\] asks for 8 pipeline "
                   r"stages, but the scale unit has plan_ngpus=4 devices"),
    (hybrid, 4, 3, r"must divide plan_ngpus=4; use one of \[1, 2, 4\]"),
    (pp, 4, 2, r"pipeline_nstages must be plan_ngpus=4; got 2. Use pipeline_nstages=4, or "
               r"the 'hybrid' policy"),
])
def test_more_stages_than_devices(policy, ngpus, nstages, message):
    with pytest.raises(PolicyError, match=message):
        plan("mlp8", policy, config(ngpus, pipeline_nstages=nstages, pipeline_nmicros=2))


@pytest.mark.parametrize("policy", [pp, hybrid])
def test_a_non_end2end_module(policy):
    cfg = config(2, pipeline_nstages=2, pipeline_nmicros=2)
    cfg.use_end2end = False
    with pytest.raises(PolicyError) as e:
        plan("mlp8", policy, cfg)
    assert "the module must be end2end" in str(e.value)
    assert "compute_config.use_end2end is False" in str(e.value)
    assert "ComputeConfig(use_end2end=True)" in str(e.value)


def test_an_unknown_scheduler_lists_the_registered_ones(fresh_plugins):
    with pytest.raises(UnknownNameError) as e:
        plan("mlp8", pp, config(2, pipeline_nmicros=2, pipeline_scheduler="1f1b_zb"))
    text = str(e.value)
    assert "no schedule named '1f1b_zb' is registered" in text
    assert "Registered schedules: 1f1b, 1f1b_interleaved, gpipe" in text


@pytest.mark.parametrize("pas,message", [
    ({}, r"pas_config\['pipeline_nmicros'\] \(the number of micro-batches of each "
         r"train_step\) is required"),
    ({"pipeline_nmicros": 0}, r"pipeline_nmicros'\] is the number of micro-batches of each "
                              r"train_step, a positive int; got 0"),
    ({"pipeline_nmicros": 2, "pipeline_scheduler": 3}, r"name of a registered schedule"),
    ({"pipeline_nmicros": 2, "hybrid": 1, "pipeline_nvirtual": 0}, r"pipeline_nvirtual"),
    ({"pipeline_nmicros": 2, "pipeline_balance": "memory"},
     r"pas_config\['pipeline_balance'\] is what the stages are balanced on, one of "
     r"\['compute', 'parameters'\]; got 'memory'"),
])
def test_bad_pipeline_options(pas, message):
    with pytest.raises(PolicyError, match=message):
        plan("mlp8", pp, config(2, **pas))
