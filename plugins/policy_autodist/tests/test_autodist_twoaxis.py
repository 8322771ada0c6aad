"""Two-axis (data x tensor) splits inside a stage: the option space, its layouts through
the planner, a plan that uses them replayed on one process, and its parity on four."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nnscaler_policy_autodist import ConstraintError, plan_graph
from nnscaler_policy_autodist.comm import DEVICE_SPECS, CommModel
from nnscaler_policy_autodist.model import CostModel
from nnscaler_policy_autodist.profile import ComputeProfiler
from nnscaler_policy_autodist.twoaxis import (
    TwoAxis,
    apply,
    factor_pairs,
    layouts,
    two_axis_transforms,
)
from torch import nn

from nnscaler.anno import ValuePartial
from nnscaler.graph import IRGraph, run_plan
from nnscaler.layout import assemble, execute, materialize, plan
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.policies.costs import layout_of, op_layouts, replicated
from nnscaler.testing import run_distributed
from nnscaler.trace import trace


class Net(nn.Module):
    """A linear, an activation and a second linear reading it: weights and no weights."""

    def __init__(self, d_in: int, d_hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_hidden)
        self.proj = nn.Linear(d_hidden, d_in, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x))).sum()


def _traced(b: int, s: int, d_in: int, d_hidden: int):
    torch.manual_seed(0)
    model = Net(d_in, d_hidden)
    x = torch.randn(b, s, d_in)
    return model, x, trace(model, {"x": x})


def test_factor_pairs():
    assert factor_pairs(2) == [] and factor_pairs(3) == []
    assert factor_pairs(4) == [(2, 2)]
    assert factor_pairs(8) == [(2, 4), (4, 2)]
    assert factor_pairs(12) == [(2, 6), (3, 4), (4, 3), (6, 2)]


def test_linear_options_are_batch_by_weight_dims():
    _, _, traced = _traced(4, 2, 8, 16)
    fc = next(op for op in IRGraph.from_graph(traced).nodes() if op.module_path == "fc")
    keys = {(t.outer.num, t.key) for t in two_axis_transforms(fc, 4)}
    # batch (input 0, dim 0) x the weight's rows (columns of the output) or its columns
    # (value-partial output: named by the input's dim 2, the first tensor that carries
    # it); not batch x sequence, which splits no weight
    assert keys == {(2, ((0, 0), (1, 0))), (2, ((0, 0), (0, 2)))}
    relu = next(op for op in IRGraph.from_graph(traced).nodes() if "relu" in op.name)
    # no weights: batch x any other dim
    assert {t.key for t in two_axis_transforms(relu, 4)} == {((0, 0), (0, 1)), ((0, 0), (0, 2))}


def test_ops_without_weights_get_the_two_axis_splits_that_continue_a_layout():
    """A stage offers an op without weights only the two-axis splits that read what a
    two-axis option of its producer writes: the relu after a linear gets batch x
    columns (the linear's batch x columns output), not batch x sequence."""
    _, _, traced = _traced(4, 2, 8, 16)
    ops = IRGraph.from_graph(traced).nodes()
    relu = next(i for i, op in enumerate(ops) if "relu" in ops[i].name)
    problem = _model().build(ops, 4, set())
    two = [o.transform for o in problem.options[relu] if isinstance(o.transform, TwoAxis)]
    assert [t.inner.dim for t in two] == [2]  # of (batch, sequence, hidden)
    assert len(two_axis_transforms(ops[relu], 4)) == 2  # batch x sequence, batch x hidden


def _round_trip(full_shape: tuple[int, ...], lay, other) -> None:
    """``lay`` -> replicated -> ``lay`` and ``lay`` -> ``other``: every value arrives."""
    full = torch.arange(float(torch.Size(full_shape).numel())).reshape(full_shape)
    held = materialize(full, lay, generator=torch.Generator().manual_seed(1))
    whole = execute(plan(lay, replicated(SimpleNamespace(shape=full_shape), lay.ndevices)),
                    held)
    assert all(torch.equal(t, full) for t in whole.values())
    back = execute(plan(replicated(SimpleNamespace(shape=full_shape), lay.ndevices), lay),
                   whole)
    assert torch.equal(assemble(back, lay), full)  # integers: every sum is exact
    if other is not None:
        assert torch.equal(assemble(execute(plan(lay, other), held), other), full)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=st.sampled_from([(2, 2), (2, 3), (3, 2), (2, 4), (4, 2)]),
       b=st.integers(1, 3), s=st.sampled_from([1, 2, 4]), d_in=st.sampled_from([2, 4, 6]),
       h=st.integers(1, 3))
def test_every_two_axis_option_is_a_legal_partition(pair, b, s, d_in, h):
    """Applied with ``IRGraph.partition`` twice, every option's parts hold the pieces
    its layouts say, device by device; and those layouts round-trip through the planner
    (to replicated and back, and to the op's one-axis split over the same devices)."""
    k = pair[0] * pair[1]
    _, _, traced = _traced(b * pair[0], s, d_in, h * pair[1])
    seen, checked = 0, set()
    for i, op in enumerate(IRGraph.from_graph(traced).nodes()):
        one = [t for t in op.anno.transform_space(k, rules=op.opdef.rules_for(op.anno))
               if t.part_op is None] if op.anno is not None and op.opdef is not None else []
        for two in two_axis_transforms(op, k):
            assert two.num == k and two.outer.num > 1 and two.inner.num > 1
            reads, writes = layouts(op, two)
            g = IRGraph.from_graph(traced)
            parts = apply(g, g.nodes()[i], two)
            assert len(parts) == k
            for j, (_, lay, _) in enumerate(reads):
                assert layout_of((p, part.input_tensors()[j])
                                 for p, part in enumerate(parts)) == lay
            for m, (_, lay) in enumerate(writes[:len(parts[0].output_tensors())]):
                assert layout_of((p, part.output_tensors()[m])
                                 for p, part in enumerate(parts)) == lay
            # the tensor split parts of one data part sit side by side: devices a*k2 + b
            k2 = two.inner.num
            for p, part in enumerate(parts):
                x = op.input_tensors()[two.outer.idx]
                assert part.input_tensors()[two.outer.idx].indmap[two.outer.dim] == \
                    x.split(two.outer.dim, two.outer.num)[p // k2].indmap[two.outer.dim]
            others = op_layouts(op, one[0], k) if one else None
            for j, (full, lay, _) in enumerate(reads):
                other = None if others is None else others[0][j][1]
                if (lay, other) not in checked:  # the planner's answer depends on these
                    checked.add((lay, other))
                    _round_trip(full.shape, lay, other)
            seen += 1
    assert seen > 0  # at least the first linear's batch x columns


def _model(comm_nodes: int | None = None) -> CostModel:
    spec = DEVICE_SPECS["H100"]
    if comm_nodes is not None:
        import attrs

        spec = attrs.evolve(spec, per_node=comm_nodes)
    return CostModel(profiler=ComputeProfiler(spec, "unused", measure=False),
                     comm=CommModel(spec), units=1, zero=False)


def test_moves_between_two_axis_and_one_axis_layouts_are_priced_by_the_planner():
    _, _, traced = _traced(8, 2, 8, 16)
    fc = next(op for op in IRGraph.from_graph(traced).nodes() if op.module_path == "fc")
    model = _model()
    two = next(t for t in two_axis_transforms(fc, 4) if t.key == ((0, 0), (1, 0)))
    out, lay2 = layouts(fc, two)[1][0]
    assert lay2.d == (2, 1, 2) and lay2.r == 1  # batch in 2 x columns in 2
    batch = next(t for t in fc.anno.transform_space(4) if (t.idx, t.dim) == (0, 0))
    lay1 = op_layouts(fc, batch, 4)[1][0][1]
    p = plan(lay2, lay1)
    assert p.steps  # the columns gathered, the batch split finer: not free
    want = model.comm.plan_time(p, 4, out.numel, True)
    assert want > 0 and model.move(out, lay2, lay1, True) == pytest.approx(want)
    assert model.move(out, lay2, lay2, True) == 0.0
    # the weight: columns split over the inner parts, replicated over the data parts
    w = layouts(fc, two)[0][1][1]
    assert w.r == 2 and w.d == (2, 1)


def test_inner_groups_stay_inside_a_node():
    """With two devices per node, the row-parallel linear's partial outputs are summed
    over the inner parts (devices 0,1 and 2,3): NVLink, cheaper than across nodes."""
    _, _, traced = _traced(8, 2, 8, 16)
    proj = next(op for op in IRGraph.from_graph(traced).nodes() if op.module_path == "proj")
    rows = next(t for t in two_axis_transforms(proj, 4)
                if isinstance(t.inner.outputs[0], ValuePartial))
    out, lay = layouts(proj, rows)[1][0]
    assert lay.v == 2
    target = op_layouts(proj, next(t for t in proj.anno.transform_space(4)
                                   if (t.idx, t.dim) == (0, 0)), 4)[1][0][1]
    inside = _model(comm_nodes=2).move(out, lay, target, False)
    across = _model(comm_nodes=1).move(out, lay, target, False)
    assert 0 < inside < across


# -- plans ---------------------------------------------------------------------------------
CFG = GPTConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, seq_len=8)
FORCED = ("- module: gpt.blocks.*.mlp.fc\n  name: linear\n  splits: ['0,0 x 1,0']\n"
          "- module: gpt.blocks.*.mlp.proj\n  name: linear\n  splits: ['0,0 x 1,1']\n")


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPTWithLoss(CFG)
    batch = make_batch(CFG, 4)
    return model, batch, trace(model, {"batch": batch})


def _config(n, tmp_path, **pas):
    return SimpleNamespace(plan_ngpus=n, runtime_ngpus=n, use_end2end=True, use_zero=False,
                           pas_config={"profile_dir": str(tmp_path / "profile"), **pas})


def test_a_data_x_tensor_plan_computes_the_loss(gpt, tmp_path):
    """A unit of 4 whose MLPs are split batch x columns then batch x rows (forced by
    constraints), replayed on threads, computes the model's loss; the plan file records
    and replays the two-axis choice. Costed for H100s (nothing measured: fast)."""
    model, batch, traced = gpt
    (tmp_path / "c.yaml").write_text(FORCED)
    g, result = plan_graph(IRGraph.from_graph(traced), _config(
        4, tmp_path, partition_constraints_path=str(tmp_path / "c.yaml"),
        save_plan_path=str(tmp_path / "plan.json"), device_type="H100"))
    torch.testing.assert_close(run_plan(g, model, {"batch": batch}), model(batch),
                               rtol=1e-5, atol=1e-6)
    problem, sol = result.problems[0], result.solutions[0]
    chosen = [problem.options[i][c].transform for i, c in enumerate(sol.choice)]
    mlp = [t for op, t in zip(problem.ops, chosen) if ".mlp." in op.module_path
           and op.name.endswith("linear")]
    assert len(mlp) == 2 * CFG.n_layer and all(isinstance(t, TwoAxis) for t in mlp)
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert any(isinstance(e["split"], dict) and "then" in e["split"] for e in saved["ops"])
    _, again = plan_graph(IRGraph.from_graph(traced), _config(
        4, tmp_path, load_plan_path=str(tmp_path / "plan.json"), device_type="H100"))

    def described(r):  # the options differ without the constraints: compare the splits
        p, s = r.problems[0], r.solutions[0]
        return [p.options[i][c].describe() for i, c in enumerate(s.choice)]

    assert described(again) == described(result)


def test_two_axis_can_be_turned_off(gpt, tmp_path):
    _, _, traced = gpt
    _, result = plan_graph(IRGraph.from_graph(traced),
                           _config(4, tmp_path, two_axis=False, device_type="H100"))
    assert not any(isinstance(o.transform, TwoAxis) for opts in result.problems[0].options
                   for o in opts)


def test_a_malformed_two_axis_constraint_says_the_form(gpt, tmp_path):
    _, _, traced = gpt
    (tmp_path / "c.yaml").write_text("- name: linear\n  splits: ['0,0 x 1']\n")
    with pytest.raises(ConstraintError, match="'idx,dim x idx,dim'"):
        plan_graph(IRGraph.from_graph(traced), _config(
            4, tmp_path, partition_constraints_path=str(tmp_path / "c.yaml")))


def _parity(rank, world, cfg, outdir):
    from autodist_cases import train

    return train(rank, world, "gpt", 4, cfg, outdir)


@pytest.mark.slow  # four processes: ~15-30 s here; the plan's loss is checked fast above
def test_parity_data_x_tensor_4_procs(tmp_path):
    """Training with a plan that splits the MLPs data x tensor (2 x 2) on 4 processes
    equals one process: losses, gradients and weights (rtol 1e-5)."""
    (tmp_path / "c.yaml").write_text(FORCED)
    cfg = {"profile_dir": str(tmp_path / "profile"), "save_plan_path": str(tmp_path / "p.json"),
           "partition_constraints_path": str(tmp_path / "c.yaml")}
    results = run_distributed(_parity, 4, cfg, str(tmp_path / "gen"))
    assert all(r["checked"] > 0 for r in results)
    saved = json.loads((tmp_path / "p.json").read_text())
    assert sum(isinstance(e["split"], dict) and "then" in e["split"] for e in saved["ops"]) >= 4
