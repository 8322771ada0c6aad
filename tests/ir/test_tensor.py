from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nnscaler.ir import CURRENT_DEVICE, FullTensor, SubTensor, TensorKind


def full(*shape: int, **kw) -> FullTensor:
    return FullTensor(tid=kw.pop("tid", 1), shape=shape, dtype=torch.float32, **kw)


def test_whole_subtensor_covers_the_full_tensor():
    t = full(4, 6)
    w = t.whole()
    assert w.indmap == ((0, 4), (0, 6)) and w.valmap == (0, 1)
    assert w.is_whole and w.shape == (4, 6) and str(w) == "t1"


def test_subtensors_are_values_full_tensors_are_identities():
    a, b = full(4), full(4)
    assert a.whole() == a.whole() and hash(a.whole()) == hash(a.whole())
    assert a.whole() != b.whole()


def test_split_and_value_split():
    w = full(4, 6).whole()
    left, right = w.split(1, 2)
    assert left.indmap == ((0, 4), (0, 3)) and right.indmap == ((0, 4), (3, 6))
    assert str(right) == "t1[:, 3:6]" and not right.is_whole
    assert not left.overlaps(right) and w.covers(left) and not left.covers(w)
    parts = right.value_split(2)
    assert [p.valmap for p in parts] == [(0, 2), (1, 2)]
    assert [p.valmap for p in parts[1].value_split(3)] == [(3, 6), (4, 6), (5, 6)]
    assert str(parts[1]) == "t1[:, 3:6](part 1/2)" and parts[1].is_value_partial


def test_select_takes_the_piece_of_a_value():
    value = torch.arange(24).view(4, 6)
    top, _ = full(4, 6).whole().split(0, 2)
    assert torch.equal(top.select(value), value[:2])


@pytest.mark.parametrize(
    ("indmap", "valmap", "match"),
    [
        (((0, 4),), (0, 1), "one \\(start, stop\\) range per dim"),
        (((0, 5), (0, 6)), (0, 1), "dim 0 .* has range \\[0, 5\\) but the dim has size 4"),
        (((2, 2), (0, 6)), (0, 1), "0 <= start < stop <= size"),
        (((0, 4), (0, 6)), (2, 2), "0 <= part < nparts"),
    ],
)
def test_bad_maps_are_rejected(indmap, valmap, match):
    with pytest.raises(ValueError, match=match):
        SubTensor(full=full(4, 6), indmap=indmap, valmap=valmap)


def test_split_rejects_bad_requests():
    w = full(4, 6).whole()
    with pytest.raises(ValueError, match="cannot split dim 0 .* in 5 parts"):
        w.split(0, 5)
    with pytest.raises(IndexError, match="dim 2 is out of range"):
        w.split(2, 2)


def test_names_and_versions():
    p = full(8, 4, kind=TensorKind.PARAMETER, names=("wte.weight", "lm_head.weight"))
    assert p.is_param and p.is_leaf and p.name == "wte.weight"
    v1 = p.new_version(7)
    assert v1.version == 1 and v1.base is p and v1.names == p.names and not v1.is_leaf
    assert v1.new_version(8).base is p and v1.new_version(8).name == "wte.weight@v2"
    assert full(2, tid=3).name == "t3"
    assert full(2, tid=3, kind=TensorKind.CONSTANT).name == "c3"
    assert str(full(2, 3)) == "t1:f32[2, 3]"
    assert repr(CURRENT_DEVICE) == "CURRENT_DEVICE"


@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    data=st.data(),
)
def test_splits_partition_the_tensor(shape, data):
    w = full(*shape).whole()
    dim = data.draw(st.integers(0, len(shape) - 1))
    num = data.draw(st.integers(1, shape[dim]))
    pieces = w.split(dim, num)
    assert sum(p.shape[dim] for p in pieces) == shape[dim]
    assert all(w.covers(p) for p in pieces)
    assert not any(a.overlaps(b) for i, a in enumerate(pieces) for b in pieces[i + 1:])
    value = torch.arange(w.full.numel).view(*shape)
    assert torch.equal(torch.cat([p.select(value) for p in pieces], dim), value)
