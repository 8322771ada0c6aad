"""Expert weights held as the tensor-parallel split needs them (nnscaler.trace.moe_weights):
a ``gate_up_proj [E, 2F, H]`` that only moe_experts reads is traced as ``[E, 2, F, H]``
with the module's shape recorded, and the graph still computes what the module does; one
that something else reads too keeps its shape, and so does the split, which then slices
it on every part."""

from __future__ import annotations

import torch
from torch import nn

from nnscaler.ir import run_graph
from nnscaler.ops.builtin.moe import MOE_EXPERTS, moe_experts
from nnscaler.trace import trace


class MoE(nn.Module):
    def __init__(self, also_read: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.also_read = also_read
        self.router = nn.Linear(8, 4, bias=False)
        self.gate_up = nn.Parameter(torch.randn(4, 12, 8) / 3)  # E=4, F=6, H=8
        self.down = nn.Parameter(torch.randn(4, 8, 6) / 3)

    def forward(self, x):
        weights, index = self.router(x).softmax(-1).topk(2, dim=-1)
        out = moe_experts(x, index, weights, self.gate_up, self.down).pow(2).sum()
        return out + self.gate_up.square().sum() if self.also_read else out


def _gate_up(graph):
    (op,) = [op for op in graph.ops if op.name == MOE_EXPERTS]
    return op, op.inputs[3].full


def test_a_weight_only_the_op_reads_is_held_as_gate_and_up_by_f():
    model, x = MoE(), torch.randn(6, 8)
    graph = trace(model, {"x": x})
    op, full = _gate_up(graph)
    assert full.names == ("gate_up",) and full.shape == (4, 2, 6, 8)
    assert full.model_shape == (4, 12, 8)
    assert graph.named_parameters()["gate_up"] is full
    assert graph.consumers(full) == [op]
    assert "e^ 2 f^ h^" in str(op.anno)
    torch.testing.assert_close(run_graph(graph, model, {"x": x}), model(x))


def test_a_weight_read_elsewhere_keeps_its_shape():
    model, x = MoE(also_read=True), torch.randn(6, 8)
    graph = trace(model, {"x": x})
    _, full = _gate_up(graph)
    assert full.shape == (4, 12, 8) and full.model_shape is None
    torch.testing.assert_close(run_graph(graph, model, {"x": x}), model(x))


def test_the_split_of_the_view_holds_one_block_of_gate_and_up_rows():
    from nnscaler.extend import ffn_transform
    from nnscaler.graph import IRGraph

    for also_read, gate_up in ((False, (4, 2, 3, 8)), (True, (4, 12, 8))):
        graph = IRGraph.from_graph(trace(MoE(also_read), {"x": torch.randn(6, 8)}))
        (op,) = [op for op in graph.nodes() if op.name == MOE_EXPERTS]
        t = ffn_transform(op, 2, "test")
        parts = graph.partition(op, idx=t.idx, dim=t.dim, num=2)
        assert [p.inputs[3].shape for p in parts] == [gate_up] * 2
        if not also_read:  # rows [3p, 3p+3) of F, for the gate and for the up half
            assert [p.inputs[3].indmap[2] for p in parts] == [(0, 3), (3, 6)]
