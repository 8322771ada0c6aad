"""Expert stacks found by structure while tracing (nnscaler.trace.moe): recorded as one
moe_experts op and put back afterwards; a module with expert weights that do not fit is
named in a warning with what to do; a dense MLP with the same parameter names is left
alone without a warning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnscaler.ops.builtin.moe import MOE_EXPERTS
from nnscaler.trace import trace
from nnscaler.trace.moe import UnplacedExpertsWarning, expert_stack_problem


class Experts(nn.Module):
    """Hugging Face's expert stack interface: experts(hidden, top_k_index, top_k_weights)."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 12, 8) / 3)
        self.down_proj = nn.Parameter(torch.randn(4, 8, 6) / 3)
        self.act_fn = nn.SiLU()
        self.has_bias = bias

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(4):  # the eager loop: indices read from data
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class Block(nn.Module):
    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = Experts(bias)

    def forward(self, x):
        weights, index = self.router(x).softmax(-1).topk(2, dim=-1)
        return self.experts(x, index, weights).sum()


class DenseMLP(nn.Module):
    """Phi-3's MLP: gate_up_proj and down_proj are linears, not expert stacks."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(8, 12)
        self.down_proj = nn.Linear(6, 8)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up).sum()


def test_an_expert_stack_is_one_op_and_is_put_back():
    block = Block()
    x = torch.randn(6, 8)
    want = block(x)
    graph = trace(block, {"x": x})
    assert graph.data_dependent == []
    (op,) = [op for op in graph.ops if op.name == MOE_EXPERTS]
    assert op.module_path == "experts" and op.kwargs["activation"] == "silu"
    assert "forward" not in vars(block.experts)
    torch.testing.assert_close(block(x), want)


def test_an_unplaceable_stack_is_named_and_left_dense():
    block = Block(bias=True)
    assert "has_bias=True" in expert_stack_problem(block.experts)
    with pytest.warns(UnplacedExpertsWarning, match=r"experts \(Experts\) has expert weights "
                                                    r"but cannot run as one moe_experts op: "
                                                    r"has_bias=True.*moe_experts from its forward"):
        graph = trace(block, {"x": torch.randn(6, 8)}, strategy="real")
    assert not [op for op in graph.ops if op.name == MOE_EXPERTS]


def test_a_dense_mlp_with_the_same_names_is_no_expert_stack():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnplacedExpertsWarning)
        graph = trace(DenseMLP(), {"x": torch.randn(3, 8)})
    assert not [op for op in graph.ops if op.name == MOE_EXPERTS]


class SwappedExperts(Experts):
    """The same names, shapes and flags, but up rows first: structure alone cannot tell."""

    def forward(self, hidden, top_k_index, top_k_weights):
        gate_up = torch.einsum("th,efh->tef", hidden, self.gate_up_proj)
        up, gate = gate_up.chunk(2, dim=-1)
        y = torch.einsum("tef,ehf->teh", self.act_fn(gate) * up, self.down_proj)
        mix = torch.zeros(hidden.shape[0], 4).scatter(1, top_k_index, top_k_weights)
        return torch.einsum("teh,te->th", y, mix)


def test_a_stack_that_computes_something_else_is_left_as_it_is():
    block = Block()
    block.experts = SwappedExperts()
    x = torch.randn(6, 8)
    want = block(x)
    for strategy in ("real", "meta"):
        with pytest.warns(UnplacedExpertsWarning, match=r"computes something else than "
                                                        r"moe_experts \(relative difference"):
            graph = trace(block, {"x": x}, strategy=strategy)
        assert not [op for op in graph.ops if op.name == MOE_EXPERTS]
    torch.testing.assert_close(block(x), want)  # the probe's weights were put back
