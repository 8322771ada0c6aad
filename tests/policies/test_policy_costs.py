"""layout_of reads an RVD layout off the pieces devices hold; adapters lists what a plan
must move, with nnscaler.layout.plan's costs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_cases import config, fresh

from nnscaler.ir import FullTensor, SubTensor
from nnscaler.layout import Layout, piece
from nnscaler.policies import adapters, data, dp, layout_of, total_cost, tp
from nnscaler.policies.costs import op_work


def _full(shape: tuple[int, ...]) -> FullTensor:
    return FullTensor(tid=0, shape=shape, dtype=torch.float32)


def _pieces(layout: Layout, full: FullTensor) -> list[tuple[int, SubTensor]]:
    out = []
    for device in layout.devices:
        slices, part = piece(layout, device)
        out.append((device, SubTensor(full=full, indmap=tuple((s.start, s.stop) for s in slices),
                                      valmap=(part, layout.v))))
    return out


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    ndim = draw(st.integers(0, 3))
    d = tuple(draw(st.sampled_from([1, 2, 4])) for _ in range(ndim))
    shape = tuple(k * draw(st.integers(1, 3)) for k in d)
    r = draw(st.sampled_from([1, 2, 3]))
    v = draw(st.sampled_from([1, 2]))
    n = r * v * math.prod(d)
    devices = tuple(draw(st.permutations(range(n))))
    return Layout(shape=shape, r=r, v=v, d=d, devices=devices)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_layout_of_reads_back_any_layout(layout):
    """The same counts, and every device holds the same piece (replicas may be numbered
    differently: which replica a device is in does not change what it holds)."""
    full = _full(layout.shape)
    found = layout_of(_pieces(layout, full))
    assert found is not None
    assert (found.r, found.v, found.d) == (layout.r, layout.v, layout.d)
    for device in layout.devices:
        assert piece(found, device) == piece(layout, device)


def test_layout_of_irregular_pieces():
    full = _full((4, 6))
    whole = full.whole()
    rows = whole.split(0, 2)
    assert layout_of([(0, rows[0]), (0, rows[1])]) is None  # one device, two pieces
    assert layout_of([(0, rows[0])]) is None  # rows 2:4 held by no one
    uneven = whole.split(1, 4)  # 2, 2, 1, 1 columns
    assert layout_of(list(enumerate(uneven))) is None
    parts = whole.value_split(2)
    assert layout_of([(0, parts[0]), (1, parts[0])]) is None  # part 1 of 2 missing
    assert layout_of([(0, whole), (1, rows[0]), (2, rows[1])]) is None  # unequal replicas
    assert layout_of([]) is None
    assert str(layout_of([(3, whole), (1, whole)])) == "R(2)V(1)D(1,1)@[1,3]"


def test_adapters_of_megatron_mlp():
    """tp on the 3-linear MLP: column, row (its bias value-split, local; its value-partial
    output all-reduced once), then the last linear split by classes into the
    class-parallel cross-entropy, which reads the split logits where they are."""
    graph = tp(fresh("mlp"), config(2))
    found = adapters(graph, 2)
    names = [(a.op.name.rsplit(".", 1)[-1], a.primitives) for a in found]
    assert names == [("linear", ("value_split",)), ("gelu", ("all_reduce",))]
    assert all(a.cost >= 0 for a in found) and total_cost(found) == sum(a.cost for a in found)
    assert any(" via all_reduce " in str(a) for a in found)
    ce = [op for op in graph.ops if op.name.endswith("cross_entropy")]
    assert [op.opdef.name.rsplit(".", 1)[-1] for op in ce] == ["class_parallel_cross_entropy"] * 2


def test_dp_needs_no_adapter_and_data_only_chunks_its_inputs():
    assert adapters(dp(fresh("gpt"), config(1)), 1) == []
    found = adapters(data(fresh("gpt"), config(2)), 2)
    assert found and all(a.cost == 0 for a in found)  # the loss splits too: no gather
    assert {a.primitives for a in found} == {("chunk",)}  # the inputs, chunked locally


def test_adapters_need_a_complete_plan():
    with pytest.raises(ValueError, match="is not assigned to a device"):
        adapters(fresh("mlp"), 2)


def test_op_work_counts_multiply_accumulates():
    """A contraction's work is the product of its output and contracted dims; anything
    else costs the numel of its biggest tensor."""
    graph = fresh("gpt")
    work = {}
    for op in graph.ops:
        work.setdefault(op.name.rsplit(".", 1)[-1], []).append((op, op_work(op)))
    for op, w in work["linear"]:
        x, weight = op.inputs[0].shape, op.inputs[1].shape
        assert w == math.prod(x[:-1]) * weight[0] * weight[1]
    for op, w in work["embedding"]:  # a lookup: the numel of its biggest tensor
        assert w == max(math.prod(op.outputs[0].shape), math.prod(op.inputs[1].shape))
    for op, w in work["cross_entropy"]:  # the logits
        assert w == math.prod(op.inputs[0].shape)
