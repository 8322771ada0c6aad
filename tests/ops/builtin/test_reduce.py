"""Reductions: which reduced dims are '+', which '^', and what a 0-d result looks like."""

from __future__ import annotations

import pytest
import torch

from nnscaler.anno import PromiseBrokenError, ValuePartial, check_promise
from nnscaler.ops.builtin import reduce
from nnscaler.ops.registry import OpRegistry
from nnscaler.ops.verify import verify_op

T = torch.Tensor


@pytest.fixture(scope="module")
def registry() -> OpRegistry:
    r = OpRegistry()
    reduce.register(r)
    return r


def anno(registry: OpRegistry, fn, *args, **kwargs) -> str:
    return str(registry.lookup(fn).annotation_for(args, kwargs))


X = torch.randn(2, 4, 6, dtype=torch.float64)


def test_sum_is_value_partial_on_reduced_dims(registry):
    assert anno(registry, T.sum, X, -1) == "a b c+ -> a b"
    assert anno(registry, torch.sum, X, (0, 2), keepdim=True) == "a+ b c+ -> 1 b 1"
    assert anno(registry, torch.sum, X) == "a+ b+ c+ -> 1"  # a 0-d result is '1'
    assert anno(registry, torch.sum, X, dim=[]) == "a+ b+ c+ -> 1"  # torch: every dim
    transforms = verify_op(registry.lookup(torch.sum), (X,))
    assert transforms and all(t.outputs == (ValuePartial(),) for t in transforms)
    partial = [t for t in verify_op(registry.lookup(T.sum), (X, 1)) if t.idx == 0 and t.dim == 1]
    assert partial and all(t.outputs == (ValuePartial(),) for t in partial)


def test_mean_does_not_split_its_reduced_dims(registry):
    # the mean of a part is not a share of the mean: '+' would break the promise
    assert anno(registry, T.mean, X, -1, keepdim=True) == "a b c^ -> a b 1"
    with pytest.raises(PromiseBrokenError):
        check_promise(lambda x: x.mean(-1), "a b c+ -> a b", (X,))
    transforms = verify_op(registry.lookup(T.mean), (X, -1), {"keepdim": True})
    assert {(t.idx, t.dim) for t in transforms} == {(0, 0), (0, 1)}


@pytest.mark.parametrize("fn", [torch.prod, torch.amax, torch.logsumexp, torch.std, torch.norm])
def test_non_additive_reductions_are_frozen(registry, fn):
    assert anno(registry, fn, X, dim=1) == "a b^ c -> a c"


def test_max_with_and_without_dim(registry):
    assert anno(registry, torch.max, X) == "a^ b^ c^ -> 1"
    assert anno(registry, T.max, X, 1) == "a b^ c -> a c, a c"
    assert anno(registry, torch.max, X, dim=-1, keepdim=True) == "a b c^ -> a b 1, a b 1"
    assert anno(registry, torch.max, X, X) == "a b c, a b c -> a b c"  # maximum
    verify_op(registry.lookup(torch.max), (X, 1))
    # the indices of a part are local to it: a split of the reduced dim breaks the promise
    with pytest.raises(PromiseBrokenError):
        check_promise(lambda x: torch.argmax(x, 1), "a b+ c -> a c", (X,))


def test_scans_and_sorts_freeze_their_dim(registry):
    assert anno(registry, torch.cumsum, X, 1) == "a b^ c -> a b^ c"
    with pytest.raises(PromiseBrokenError):
        check_promise(lambda x: torch.cumsum(x, 1), "a b c -> a b c", (X,))
    assert anno(registry, torch.topk, X, 3) == "a b c^ -> a b 3, a b 3"
    assert anno(registry, torch.sort, X, 0) == "a^ b c -> a^ b c, a^ b c"
    assert anno(registry, T.argsort, X, dim=-1, descending=True) == "a b c^ -> a b c^"


def test_sort_with_stable_replays_its_keywords(registry):
    op = registry.lookup(torch.sort)
    call = op.bind((X,), {"dim": 1, "stable": True})
    values, indices = call.run()
    assert torch.equal(indices, torch.sort(X, dim=1, stable=True).indices)
    verify_op(op, (X,), {"dim": 1, "stable": True})


def test_std_overloads(registry):
    assert anno(registry, torch.std, X, True) == "a^ b^ c^ -> 1"  # std(input, unbiased)
    assert anno(registry, torch.var, X, 1, True, True) == "a b^ c -> a 1 c"
    assert anno(registry, torch.var_mean, X, dim=(0, 1), correction=0) == "a^ b^ c -> c, c"


def test_zero_d_inputs_are_taken_whole(registry):
    x = torch.tensor(2.0)
    assert anno(registry, torch.sum, x) == "1 -> 1"
    assert anno(registry, torch.cumsum, x, 0) == "1 -> 1"
    assert verify_op(registry.lookup(torch.sum), (x,)) == []


def test_method_spellings_resolve(registry):
    for fn, name in [(T.sum, "torch.sum"), (T.mean, "torch.mean"), (T.all, "torch.all"),
                     (T.norm, "torch.norm"), (T.max, "torch.max"), (T.cumsum_, "torch.Tensor.cumsum_"),
                     (torch.special.logsumexp, "torch.logsumexp"), (T.topk, "torch.topk")]:
        assert registry.lookup(fn).name == name
    for fn in (T.numel, T.size, T.dim):
        assert registry.lookup(fn) is None
