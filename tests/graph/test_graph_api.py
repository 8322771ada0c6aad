"""The policy writer's API one call at a time: select, partition, replicate, assign."""

from __future__ import annotations

import pytest
import torch
from plan_helpers import assert_reproduces, case, fresh, replicate_rest
from torch import nn

from nnscaler.anno import Split, TransformRule, ValuePartial
from nnscaler.graph import IRGraph, PlanCheckError, check_plan, run_plan
from nnscaler.ir import Graph
from nnscaler.models.gpt import MLP, Block
from nnscaler.trace import trace


def test_from_graph_copies_and_leaves_the_traced_graph_alone():
    traced = case("mlp").graph
    graph = IRGraph.from_graph(traced)
    assert isinstance(graph, Graph) and len(graph.nodes()) == len(traced.ops)
    graph.assign(graph.nodes()[0], 1)
    graph.partition(graph.nodes()[1], idx=0, dim=0, num=2)
    assert traced.ops[0].device is None and len(traced.ops) == 6 and len(graph.nodes()) == 7
    assert [op.oid for op in graph.nodes()[:1]] == [traced.ops[0].oid]
    again = IRGraph.from_graph(graph)  # copying a planned graph keeps its plan and lineage
    assert again.nodes()[0].device == 1 and again.nodes()[0] is not graph.nodes()[0]
    assert "part 1 of 2 of op #1" in again.describe(again.nodes()[2])


def test_select_by_name_module_and_class():
    graph = fresh("gpt")
    linears = graph.select(name="linear")
    assert len(linears) == 2 * 6 + 1 and linears == graph.select(name="torch.nn.functional.linear")
    assert len(graph.select(name="*.linear")) == 13 and graph.select(name="lin") == []
    assert [op.module_path for op in graph.select(module="gpt.blocks.1.mlp")] == [
        "gpt.blocks.1.mlp.fc", "gpt.blocks.1.mlp", "gpt.blocks.1.mlp.proj", "gpt.blocks.1.mlp.dropout"
    ]
    assert len(graph.select(module="*.mlp.fc")) == 2
    assert graph.select(module="gpt.blocks.1.ml") == []  # a prefix is a whole path component
    by_class = graph.select(type=MLP)  # the innermost module that made the call
    assert [op.name for op in by_class] == ["torch.nn.functional.gelu"] * 2
    assert graph.select(type="MLP") == by_class == graph.select(type="nnscaler.models.gpt.MLP")
    assert graph.select(type=Block) == graph.select(name="add", module="gpt.blocks")
    assert graph.select(name="linear", module="gpt.blocks.0", type=nn.Linear) == linears[:6]
    assert graph.select() == graph.nodes()


def test_partition_replaces_the_op_in_place_with_its_parts():
    graph = fresh("gpt")
    ops = graph.nodes()
    fc = graph.select(module="gpt.blocks.0.mlp.fc")[0]
    at = ops.index(fc)
    parts = graph.partition(fc, "dim", idx=0, dim=1, num=3)  # nnScaler's positional form
    assert graph.nodes()[at:at + 3] == parts and len(graph.nodes()) == len(ops) + 2
    assert graph.instances(fc) == parts and all(graph.origin(p) is fc for p in parts)
    x, out = fc.inputs[0], fc.outputs[0]
    assert [p.inputs[0] for p in parts] == list(x.split(1, 3))
    assert [p.outputs[0] for p in parts] == list(out.split(1, 3))
    assert all(p.inputs[1] == fc.inputs[1] for p in parts)  # the weight is replicated
    assert all(p.anno.input_shapes[0] == (4, 2, 8) and p.anno.output_shapes == ((4, 2, 32),)
               for p in parts)
    assert graph.consumers(out.full) == graph.select(name="gelu", module="gpt.blocks.0.mlp")
    assert graph.producers(out.full) == parts


def test_partition_a_part_again_nests_the_pieces():
    graph = fresh("mlp")
    linear = graph.nodes()[0]  # [4, 8] x [16, 8]^T
    halves = graph.partition(linear, idx=0, dim=0, num=2)
    quarters = graph.partition(halves[1], idx=1, dim=0, num=2)
    assert [(q.inputs[0].indmap, q.inputs[1].indmap, q.outputs[0].indmap) for q in quarters] == [
        (((2, 4), (0, 8)), ((0, 8), (0, 8)), ((2, 4), (0, 8))),
        (((2, 4), (0, 8)), ((8, 16), (0, 8)), ((2, 4), (8, 16))),
    ]
    assert graph.instances(linear) == [halves[0], *quarters]
    assert "part 0 of 2 of op" in graph.describe(quarters[0])
    assert graph.describe(quarters[0]).count("part ") == 2


def test_partition_rewrites_keyword_arguments_of_each_part():
    """``view(t, (4, 6, 2, 4))`` split on the heads dim: each part views to 1 head."""
    graph = fresh("gpt")
    view = graph.select(name="view", module="gpt.blocks.0.attn")[0]
    assert view.kwargs["size"] == (4, 6, 2, 4)
    parts = graph.partition(view, idx=0, dim=2, num=2)
    assert [p.kwargs["size"] for p in parts] == [(4, 6, 1, 4)] * 2
    assert [p.outputs[0].indmap[2] for p in parts] == [(0, 1), (1, 2)]
    for device, part in enumerate(parts):
        graph.assign(part, device)
    replicate_rest(graph, 2)
    assert_reproduces(graph, "gpt", ndevices=2)


def test_value_partial_output_and_replicas():
    """lm_head has no bias: its reduction dim splits and the logits become value parts;
    replicas of a part write the same part, which is counted once."""
    graph = fresh("gpt")
    head = graph.select(module="gpt.lm_head")[0]
    assert str(head.anno) == "b0 b1 k+, n k+, ? -> b0 b1 n"
    parts = graph.partition(head, idx=0, dim=2, num=2)
    assert [p.outputs[0].valmap for p in parts] == [(0, 2), (1, 2)]
    assert [p.outputs[0].shape for p in parts] == [(4, 6, 32)] * 2
    copies = graph.replicate(parts[1], times=2)
    assert [c.inputs for c in copies] == [parts[1].inputs] * 2 and copies[0] is not copies[1]
    for device, op in enumerate([parts[0], *copies]):
        graph.assign(op, device)
    replicate_rest(graph, 3)
    assert_reproduces(graph, "gpt", ndevices=3)


def test_replicate_and_assign():
    graph = fresh("mlp")
    loss = graph.nodes()[-1]
    copies = graph.replicate(loss, 3)
    assert graph.nodes()[-3:] == copies and graph.instances(loss) == copies
    assert all(c.inputs == loss.inputs and c.outputs == loss.outputs for c in copies)
    assert graph.replicate(copies[0]) != [copies[0]]  # times=1: one fresh copy
    assert graph.assign(copies[1], 2) is copies[1] and copies[1].device == 2
    assert "device 2" in str(copies[1]) and "device" not in str(copies[2])


class _Affine(nn.Module):
    """x @ w + b through a user op whose rule splits the reduction and the bias."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op = op
        self.w = nn.Parameter(torch.randn(8, 6))
        self.b = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.w, self.b).sum()


def test_transform_rule_with_a_value_partial_input(fresh_plugins):
    """A rule may hand an input out in value parts (a bias added once): part 0 holds it,
    the others zeros, and the outputs sum to the whole."""
    import nnscaler

    rule = TransformRule(inputs=(Split(1), Split(0), ValuePartial()), outputs=(ValuePartial(),))

    @nnscaler.register_op("m k^, k^ n, n -> m n", name="test.affine", transform_rules=[rule])
    def affine(x, w, b):
        return x @ w + b

    torch.manual_seed(0)
    module, args = _Affine(affine), {"x": torch.randn(4, 8)}
    graph = IRGraph.from_graph(trace(module, args))
    op = graph.select(name="test.affine")[0]
    parts = graph.partition(op, idx=1, dim=0, num=2)
    assert [p.inputs[2].valmap for p in parts] == [(0, 2), (1, 2)]
    assert [p.outputs[0].valmap for p in parts] == [(0, 2), (1, 2)]
    for device, part in enumerate(parts):
        graph.assign(part, device)
    graph.assign(graph.select(name="sum")[0], 0)
    check_plan(graph, 2)
    out = run_plan(graph, module, args)
    torch.testing.assert_close(out, module(**args), rtol=1e-5, atol=1e-6)


def test_run_plan_runs_a_traced_graph_like_run_graph():
    c = case("gpt")
    out = run_plan(c.graph, c.module, c.args)
    torch.testing.assert_close(out.detach(), c.expected, rtol=0, atol=0)



class _Total(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()


def test_value_parts_of_different_splits_never_mix():
    """``sum`` splits over rows or over columns; replicas split both ways each give parts
    "0 of 2" and "1 of 2", and only parts of one split sum to the value."""
    module, args = _Total(), {"x": torch.arange(24.0).reshape(4, 6)}
    graph = IRGraph.from_graph(trace(module, args))
    total = graph.nodes()[0]
    assert str(total.anno) == "a+ b+ -> 1"
    by_rows, by_cols = graph.replicate(total, 2)
    rows = graph.partition(by_rows, idx=0, dim=0, num=2)
    cols = graph.partition(by_cols, idx=0, dim=1, num=2)
    for op in graph.nodes():
        graph.assign(op, 0)
    check_plan(graph, 1)
    assert run_plan(graph, module, args).item() == 276.0
    assert graph.value_key(rows[1], 0) == ((("a", 2), 1),)
    graph.ops.remove(rows[1])
    graph.ops.remove(cols[0])
    graph.reindex()  # left: rows part 0 and columns part 1, which do not sum to the value
    with pytest.raises(PlanCheckError, match="come from different splits of the op"):
        check_plan(graph, 1)
