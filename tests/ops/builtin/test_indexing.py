"""Indexing ops: x[key] placement rules, x[key] = v as an op, gather/scatter, histc."""

from __future__ import annotations

import pytest
import torch

from nnscaler.anno import PromiseBrokenError, Split, ValuePartial, check_promise
from nnscaler.ops.builtin import indexing
from nnscaler.ops.registry import OpRegistry
from nnscaler.ops.verify import verify_op

T = torch.Tensor


@pytest.fixture(scope="module")
def registry() -> OpRegistry:
    r = OpRegistry()
    indexing.register(r)
    return r


def anno(registry: OpRegistry, fn, *args, **kwargs) -> str:
    return str(registry.lookup(fn).annotation_for(args, kwargs))


X = torch.randn(2, 4, 8)
IDX = torch.tensor([0, 1])


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ((slice(None), slice(1, 3)), "a b^ c, ? -> a 2 c"),  # partial slice: '^', a number
        ((Ellipsis, slice(None, 4)), "a b c^, ? -> a b 4"),  # rotate_half
        (0, "a^ b c, ? -> b c"),
        (-1, "a^ b c, ? -> b c"),
        ((slice(None), None, slice(None, None, 2)), "a (b 2) c, ? -> a 1 b c"),  # ::2 splits
        ((slice(None), slice(1, None, 2)), "a (b 2) c, ? -> a b c"),
        ((Ellipsis, None), "a b c, ? -> a b c 1"),
        ((slice(0, 100), slice(-4, None)), "a b c, ? -> a b c"),  # whole slices
        # advanced indices: ints first, then adjacent indices stay in place ...
        ((slice(None), IDX, 0), "a b^ c^, ? -> a 2"),
        ((IDX, IDX), "a^ b^ c, ? -> 2 c"),
        # ... and separated ones go first
        ((IDX, slice(None), IDX), "a^ b c^, ? -> 2 b"),
    ],
)
def test_getitem_annotations(registry, key, expected):
    op = registry.lookup(T.__getitem__)
    assert anno(registry, T.__getitem__, X, key) == expected
    verify_op(op, (X, key))


def test_getitem_with_one_index_tensor_splits_the_index(registry):
    x = torch.randn(6, 4)
    idx = torch.tensor([[0, 1], [2, 3], [5, 5]])
    assert anno(registry, T.__getitem__, x, idx) == "a^ b, c d -> c d b"
    transforms = verify_op(registry.lookup(T.__getitem__), (x, idx))
    assert {t.ident for t in transforms} == {"b", "c", "d"}
    mask = torch.tensor([True, False, True, True, False, True])
    assert anno(registry, T.__getitem__, x, mask) == "a^ b, a^ -> 4 b"
    verify_op(registry.lookup(T.__getitem__), (x, mask))


def test_non_adjacent_advanced_indices_lead():
    x = torch.randn(2, 3, 4, 5)
    key = (slice(None), torch.tensor([0, 1, 2]), slice(None), torch.tensor([1, 1, 0]))
    plan = indexing.KeyPlan(x, key)
    assert plan.out_dims == ["3", "a", "c"]
    assert tuple(x[key].shape) == (3, 2, 4)


def test_setitem_is_an_op_returning_the_written_tensor(registry):
    op = registry.lookup(T.__setitem__)
    assert op.name == "torch.Tensor.__setitem__"
    x, v = torch.randn(4, 6), torch.randn(4, 2)
    key = (slice(None), slice(1, 3))
    assert anno(registry, T.__setitem__, x, key, v) == "a b^, ?, a 2 -> a b^"
    y = x.clone()
    out = op.call((y, key, v), {})
    assert out is y and torch.equal(y[:, 1:3], v)
    transforms = verify_op(op, (x, key, v))
    assert [t.outputs for t in transforms] == [(Split(0),)] * len(transforms)
    # a broadcast value and a scalar value
    assert anno(registry, T.__setitem__, x, (Ellipsis, 0), torch.randn(1)) == "a b^, ?, 1 -> a b^"
    assert anno(registry, T.__setitem__, x, 0, 1.0) == "a^ b, ?, ? -> a^ b"
    # inv_perm[perm] = arange(n) (Mixtral): the indexed dim is '^'
    perm = torch.randperm(8)
    assert anno(registry, T.__setitem__, torch.zeros(8), perm, torch.arange(8.0)) == "a^, ?, 8 -> a^"


def test_gather_splits_dims_of_equal_size_and_the_index(registry):
    x = torch.randn(4, 6)
    assert anno(registry, torch.gather, x, 1, torch.randint(0, 6, (4, 3))) == "a b^, ?, a d -> a d"
    assert anno(registry, T.gather, x, -1, torch.randint(0, 6, (2, 3))) == "a^ b^, ?, c^ d -> c^ d"
    transforms = verify_op(registry.lookup(torch.gather), (x, 1, torch.randint(0, 6, (4, 3))))
    assert {t.ident for t in transforms} == {"a", "d"}


def test_scatter_add_keeps_the_scattered_dim_whole(registry):
    # the MoE pattern: counts per expert
    counts = torch.zeros(4)
    idx = torch.randint(0, 4, (12,))
    assert anno(registry, T.scatter_add_, counts, 0, idx, torch.ones(12)) == "a^, ?, b^, c^ -> a^"
    x = torch.randn(4, 6)
    idx = torch.randint(0, 4, (3, 6))
    assert anno(registry, T.scatter_add_, x, 0, idx, torch.randn(3, 6)) == "a^ b, ?, c^ b, e^ b -> a^ b"
    verify_op(registry.lookup(T.scatter_add_), (x, 0, idx, torch.randn(3, 6)))
    # a partial sum over the index would add ``x`` once per part: '+' must break the promise
    with pytest.raises(PromiseBrokenError):
        check_promise(lambda *a: torch.scatter_add(*a), "a^ b, ?, d+ b, d+ b -> a^ b",
                      (x, 0, idx, torch.randn(3, 6)))


def test_index_add_splits_the_rows(registry):
    out = torch.zeros(6, 8)
    rows = torch.tensor([1, 3, 3])
    assert anno(registry, T.index_add_, out, 0, rows, torch.randn(3, 8)) == "a^ b, ?, c^, c^ b -> a^ b"
    verify_op(registry.lookup(T.index_add_), (out, 0, rows, torch.randn(3, 8)))


def test_histc_counts_add_up_only_with_fixed_bounds(registry):
    ids = torch.randint(0, 4, (3, 8)).float()
    assert anno(registry, torch.histc, ids, bins=4, min=0, max=3) == "a+ b+ -> 4"
    transforms = verify_op(registry.lookup(torch.histc), (ids,), {"bins": 4, "min": 0, "max": 3})
    assert transforms and all(t.outputs == (ValuePartial(),) for t in transforms)
    # min == max == 0: each part would use its own data range
    assert anno(registry, T.histc, ids, 4) == "a^ b^ -> 4"
    data = torch.tensor([0.0, 1.0, 2.0, 3.0])
    with pytest.raises(PromiseBrokenError):
        check_promise(lambda x: torch.histc(x, 4), "a+ -> 4", (data,))


def test_data_dependent_sizes_are_numbers(registry):
    x = torch.tensor([[1.0, 0.0], [2.0, 3.0]])
    assert anno(registry, torch.nonzero, x) == "a^ b^ -> 3 2"
    assert anno(registry, torch.nonzero, x, as_tuple=True) == "a^ b^ -> 3, 3"
    assert anno(registry, torch.masked_select, x, x > 0) == "a^ b^, a^ b^ -> 3"
    assert anno(registry, torch.bincount, torch.tensor([0, 2, 2])) == "a^ -> 3"


def test_searchsorted_and_take_along_dim(registry):
    seq = torch.arange(5.0)
    assert anno(registry, torch.searchsorted, seq, torch.randn(2, 3)) == "c^, a b -> a b"
    assert anno(registry, torch.searchsorted, torch.randn(2, 5).sort().values, torch.randn(2, 3)) \
        == "a c^, a b -> a b"
    x = torch.randn(4, 6)
    idx = x.argmax(-1, keepdim=True)
    assert anno(registry, torch.take_along_dim, x, idx, dim=1) == "a b^, a zb -> a zb"
    verify_op(registry.lookup(torch.take_along_dim), (x, idx), {"dim": 1})
