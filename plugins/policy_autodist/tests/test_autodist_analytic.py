"""The analytic estimate of named devices: ops that move no data cost nothing, attention's
work comes from its shapes, compute and memory traffic overlap inside an op, and the
gradient sum overlaps backward when the reducer runs from backward's hooks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from nnscaler_policy_autodist import DEVICE_SPECS
from nnscaler_policy_autodist.analytic import (
    analytic_time,
    attention_flops,
    mark_strided,
    moves_no_data,
)
from nnscaler_policy_autodist.comm import CommModel
from nnscaler_policy_autodist.model import CostModel
from nnscaler_policy_autodist.profile import ComputeProfiler
from torch import nn

from nnscaler.extend import op_work
from nnscaler.graph import IRGraph
from nnscaler.trace import trace

H100 = DEVICE_SPECS["H100"]


class Shapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)  # (4, 8, 16)
        a = h.view(4, 8, 2, 8)
        b = a.transpose(1, 2)  # strided
        c = b.reshape(4, 2, 64)  # a copy: its input is strided
        d = h.reshape(32, 16)  # a view: h is contiguous
        e = d[:16]  # a view
        f = e.unsqueeze(0).squeeze(0).detach()
        g = h.permute(2, 0, 1).flatten(1)  # flatten of a permute: a copy
        return c.sum() + f.sum() + g.sum() + h[:, 1:].sum()


def _ops():
    graph = IRGraph.from_graph(trace(Shapes(), {"x": torch.randn(4, 8, 16)}))
    return graph.nodes()


def _named(ops, name):
    return [op for op in ops if (op.opdef.name if op.opdef is not None else op.name) == name]


def test_views_cost_nothing_and_a_copying_reshape_costs_its_bytes():
    ops = _ops()
    strided = mark_strided(ops)
    free = [op for op in ops if moves_no_data(op, strided)]
    names = {op.opdef.name for op in free}
    assert {"torch.Tensor.view", "torch.transpose", "torch.unsqueeze", "torch.squeeze",
            "torch.detach", "torch.Tensor.permute", "torch.Tensor.__getitem__"} <= names
    for op in free:
        assert analytic_time(op, H100, 1, strided) == (0.0, 0.0)
    reshapes = _named(ops, "torch.Tensor.reshape")
    assert len(reshapes) == 2
    copy, view = reshapes  # of the transpose, then of the linear's output
    assert not moves_no_data(copy, strided) and moves_no_data(view, strided)
    assert analytic_time(copy, H100, 1, strided)[0] > H100.launch
    flatten = _named(ops, "torch.flatten")[0]
    assert not moves_no_data(flatten, strided)  # of a permute
    # the linear and the sums still cost
    linear = _named(ops, "torch.nn.functional.linear")[0]
    assert analytic_time(linear, H100, 1, strided)[0] > 0


class Attention(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).sum()


def _sdpa(b, h, lq, lk, d, causal):
    q = torch.randn(b, h, lq, d, device="meta", requires_grad=True)
    k = torch.randn(b, h, lk, d, device="meta", requires_grad=True)
    v = torch.randn(b, h, lk, d, device="meta", requires_grad=True)
    graph = IRGraph.from_graph(trace(Attention(causal), {"q": q, "k": k, "v": v},
                                     strategy="meta"))
    return _named(graph.nodes(), "torch.nn.functional.scaled_dot_product_attention")[0]


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 4), lq=st.sampled_from([16, 64, 128]),
       d=st.sampled_from([16, 64, 128]), causal=st.booleans())
def test_attention_work_is_counted_from_its_shapes(b, h, lq, d, causal):
    op = _sdpa(b, h, lq, lq, d, causal)
    fw, bw = attention_flops(op)
    assert fw == 4 * b * h * lq * lq * d / (2 if causal else 1)
    assert bw == 2.5 * fw
    # the generic count multiplies the head dims together: d/2 times too much, forward
    assert 2 * op_work(op) / (4 * b * h * lq * lq * d) >= d / 2


def test_attention_time_follows_its_kernels_throughput():
    op = _sdpa(2, 32, 4096, 4096, 128, True)
    fw, bw = analytic_time(op, H100)
    flops = 4 * 2 * 32 * 4096 * 4096 * 128 / 2
    assert fw == pytest.approx(flops / H100.attn_fw_flops + H100.launch, rel=1e-6)
    assert bw == pytest.approx(2.5 * flops / H100.attn_bw_flops + H100.launch, rel=1e-6)


@settings(max_examples=20, deadline=None)
@given(n=st.sampled_from([64, 256, 1024]), rows=st.sampled_from([1, 8, 4096]))
def test_an_op_takes_the_longer_of_compute_and_memory(n, rows):
    graph = IRGraph.from_graph(trace(nn.Linear(n, n, device="meta"),
                                     {"input": torch.randn(rows, n, device="meta")},
                                     strategy="meta"))
    op = _named(graph.nodes(), "torch.nn.functional.linear")[0]
    fw, _ = analytic_time(op, H100)
    compute = 2 * rows * n * n / H100.flops
    moved = 4 * (rows * n + n * n + n + rows * n) / H100.mem_bw
    assert fw == pytest.approx(max(compute, moved) + H100.launch, rel=1e-6)


def _model(tmp_path, overlap, units=8):
    profiler = ComputeProfiler(H100, tmp_path, measure=False)
    return CostModel(profiler=profiler, comm=CommModel(H100), units=units, zero=False,
                     overlap_grads=overlap, unit=8)


@pytest.mark.parametrize("rows", [8, 65536])
def test_the_gradient_sum_overlaps_backward_when_reduced_from_hooks(tmp_path, rows):
    graph = IRGraph.from_graph(trace(nn.Linear(1024, 1024, device="meta"),
                                     {"input": torch.randn(rows, 1024, device="meta")},
                                     strategy="meta"))
    op = _named(graph.nodes(), "torch.nn.functional.linear")[0]
    after = _model(tmp_path, False).build([op], 8, set()).options[0][0]
    hooked = _model(tmp_path, True).build([op], 8, set()).options[0][0]
    _, bw = analytic_time(op, H100)
    comm = CommModel(H100)
    sums = sum(comm.allreduce_time(4 * n, 64, cross=True, local=8)
               for n in (1024 * 1024, 1024))
    assert after.comm == pytest.approx(sums, rel=1e-6)
    assert hooked.comm == pytest.approx(max(0.0, sums - bw), rel=1e-6, abs=1e-12)
    if rows == 65536:  # a large batch: backward hides the whole sum
        assert hooked.comm == 0.0 < after.comm


@given(local=st.integers(1, 16))
def test_across_nodes_each_device_of_a_node_adds_its_card(local):
    comm = CommModel(H100)
    assert comm.cross_bw(local) == min(H100.intra_bw, local * H100.inter_bw)
    one = comm.allreduce_time(2**30, 16, cross=True, bucketed=False, local=1)
    many = comm.allreduce_time(2**30, 16, cross=True, bucketed=False, local=local)
    assert many <= one
    assert math.isclose(comm.step_time([(0, 8)], 1e6, 2),
                        H100.inter_lat + 2e6 / H100.inter_bw)


# -- ZeRO stages ---------------------------------------------------------------------------
def _linear_option(tmp_path, stage, units=4, micro_batches=1, rows=8):
    graph = IRGraph.from_graph(trace(nn.Linear(1024, 1024, device="meta"),
                                     {"input": torch.randn(rows, 1024, device="meta")},
                                     strategy="meta"))
    op = _named(graph.nodes(), "torch.nn.functional.linear")[0]
    profiler = ComputeProfiler(H100, tmp_path, measure=False)
    model = CostModel(profiler=profiler, comm=CommModel(H100), units=units,
                      zero=stage >= 1, zero_stage=stage, unit=8, micro_batches=micro_batches)
    return op, model, model.build([op], 1, set()).options[0][0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage_holds_what_docs_zero_says(tmp_path, stage):
    _, _, o = _linear_option(tmp_path, stage)
    p = 4 * (1024 * 1024 + 1024)  # weight and bias, fp32
    n = 4
    held = {0: 4 * p, 1: 2 * p + 4 * p / n, 2: p + 4 * p / n, 3: 4 * p / n}[stage]
    # plus Adam's foreach temporaries on a GPU (one buffer the size of the weights)
    assert o.mem - o.act == pytest.approx(held + p)
    if stage == 3:
        assert o.transient >= 2 * 4 * 1024 * 1024  # the gathered weight and its gradient


@settings(max_examples=10, deadline=None)
@given(micro=st.sampled_from([1, 4, 16]))
def test_zero_stages_pay_their_collectives(micro):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        times = {}
        for stage in (1, 2, 3):
            op, model, o = _linear_option(tmp, stage, micro_batches=micro)
            fw, bw = analytic_time(op, H100)
            comm = CommModel(H100)
            ring = sum(comm.allreduce_time(4 * k, 4, local=4) for k in (1024 * 1024, 1024))
            times[stage] = o.comm
            expected = {1: ring / micro,
                        2: ring / 2 / micro + max(0.0, ring / 2 - bw),
                        3: ring / 2 / micro + max(0.0, ring / 2 - bw)
                        + max(0.0, ring - fw - bw)}[stage]
            assert o.comm == pytest.approx(expected, rel=1e-6)
        # stage 2 hides its reduce-scatter in backward, stage 1 (no async reducer) does
        # not; stage 3 adds the gathers to stage 2
        assert times[2] <= times[3]
