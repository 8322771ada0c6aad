"""Comparisons, logical/bitwise ops, where and masked_fill."""

from __future__ import annotations

import pytest
import torch

from nnscaler.anno import PromiseBrokenError, check_promise
from nnscaler.ops.builtin import compare
from nnscaler.ops.registry import OpRegistry
from nnscaler.ops.verify import verify_op

T = torch.Tensor


@pytest.fixture(scope="module")
def registry() -> OpRegistry:
    r = OpRegistry()
    compare.register(r)
    return r


def anno(registry: OpRegistry, fn, *args, **kwargs) -> str:
    return str(registry.lookup(fn).annotation_for(args, kwargs))


@pytest.mark.parametrize(
    ("fn", "name"),
    [
        (T.__eq__, "torch.eq"), (T.__ne__, "torch.ne"), (T.__lt__, "torch.lt"),
        (T.__le__, "torch.le"), (T.__gt__, "torch.gt"), (T.__ge__, "torch.ge"),
        (T.gt, "torch.gt"), (T.le, "torch.le"), (torch.greater_equal, "torch.ge"),
        (T.__and__, "torch.bitwise_and"), (T.__or__, "torch.bitwise_or"),
        (T.__xor__, "torch.bitwise_xor"), (T.__invert__, "torch.bitwise_not"),
        (T.__iand__, "torch.Tensor.bitwise_and_"), (T.masked_fill, "torch.masked_fill"),
        (T.masked_fill_, "torch.Tensor.masked_fill_"), (torch.where, "torch.where"),
        (T.where, "torch.Tensor.where"), (T.isnan, "torch.isnan"),
    ],
)
def test_aliases_resolve(registry, fn, name):
    assert registry.lookup(fn).name == name


def test_python_bools_are_not_ops(registry):
    for fn in (T.__bool__, torch.allclose, torch.equal):
        assert registry.lookup(fn) is None


def test_where_with_scalars_and_broadcasting(registry):
    cond, x = torch.randn(2, 1, 4) > 0, torch.randn(3, 4)
    assert anno(registry, torch.where, cond, x, 0.0) == "a 1 c, b c, ? -> a b c"
    verify_op(registry.lookup(torch.where), (cond, x, 0.0))
    verify_op(registry.lookup(torch.where), (cond, x, torch.tensor(-1.0)))


def test_where_with_one_argument_is_taken_whole(registry):
    cond = torch.randn(3, 4) > 0
    assert anno(registry, torch.where, cond) == "? -> ?, ?"
    assert verify_op(registry.lookup(torch.where), (cond,)) == []


def test_tensor_where_has_its_own_argument_order(registry):
    x, cond, y = torch.randn(4, 6), torch.randn(6) > 0, torch.randn(4, 1)
    assert anno(registry, T.where, x, cond, y) == "a b, b, a 1 -> a b"
    call = registry.lookup(T.where).bind((x, cond, y), {})
    assert torch.equal(call.run(), torch.where(cond, x, y))
    verify_op(registry.lookup(T.where), (x, cond, y))


def test_masked_fill_mask_broadcasts(registry):
    x, mask = torch.randn(2, 4, 6), torch.randn(4, 1) > 0
    assert anno(registry, T.masked_fill, x, mask, float("-inf")) == "a b c, b 1, ? -> a b c"
    transforms = verify_op(registry.lookup(T.masked_fill_), (x, mask, torch.tensor(3.0)))
    assert {(t.idx, t.dim) for t in transforms} == {(0, 0), (0, 1), (0, 2), (1, 0)}


def test_a_wrong_annotation_would_be_caught():
    # masked_fill with the mask taken whole while the input is split: the promise breaks
    x, mask = torch.randn(4, 6), torch.randn(4, 6) > 0
    with pytest.raises(PromiseBrokenError):
        check_promise(torch.masked_fill, "a b, ? , ? -> a b", (x, mask, 0.0))


def test_comparisons_give_exact_booleans(registry):
    x = torch.tensor([[1.0, 2.0], [3.0, 2.0]])
    assert anno(registry, T.__eq__, x, 2.0) == "a b, ? -> a b"
    verify_op(registry.lookup(T.__eq__), (x, torch.tensor([2.0, 2.0])))
    verify_op(registry.lookup(torch.isclose), (x, x + 1e-9), {"rtol": 0.0})
