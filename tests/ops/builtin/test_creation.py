"""Creation ops: sizes from arguments, shape inference of ops with garbage or random values."""

from __future__ import annotations

import random

import pytest
import torch

from nnscaler.ops.builtin import creation
from nnscaler.ops.registry import OpRegistry
from nnscaler.ops.verify import verify_op

T = torch.Tensor


@pytest.fixture(scope="module")
def registry() -> OpRegistry:
    r = OpRegistry()
    creation.register(r)
    return r


def anno(registry: OpRegistry, fn, *args, **kwargs) -> str:
    return str(registry.lookup(fn).annotation_for(args, kwargs))


def test_sizes_come_from_the_arguments(registry):
    assert anno(registry, torch.zeros, 2, 3) == "-> 2 3"
    assert anno(registry, torch.ones, (2, 3)) == "-> 2 3"
    assert anno(registry, torch.zeros, size=[4]) == "-> 4"
    assert anno(registry, torch.zeros, ()) == "-> 1"  # a 0-d tensor
    assert anno(registry, torch.full, (2, 5), 1.5) == "-> 2 5"
    assert anno(registry, torch.arange, 5) == "-> 5"
    assert anno(registry, torch.arange, 1, 10, 4) == "-> 3"
    assert anno(registry, torch.arange, 0.0, 1.0, 0.3) == "-> 4"
    assert anno(registry, torch.eye, 3) == "-> 3 3"
    assert anno(registry, torch.tensor, [[1, 2, 3], [4, 5, 6]]) == "? -> 2 3"
    assert anno(registry, torch.tensor, 2.5) == "? -> 1"
    assert anno(registry, T.new_ones, torch.zeros(2), 4, 5) == "? -> 4 5"


def test_calls_replay_as_written(registry):
    for fn, args, kwargs in [
        (torch.zeros, (2, 3), {"dtype": torch.int64}),
        (torch.zeros, (), {"size": (2, 3)}),
        (torch.arange, (7,), {}),
        (torch.arange, (), {"start": 1, "end": 7, "step": 2}),
        (T.new_full, (torch.zeros(1), (2, 2), 3.0), {}),
    ]:
        call = registry.lookup(fn).bind(args, kwargs)
        assert call.inputs == () or fn is T.new_full
        assert torch.equal(call.run(), fn(*args, **kwargs))


@pytest.mark.parametrize(
    "name",
    ["torch.empty", "torch.empty_like", "torch.rand", "torch.randn", "torch.rand_like",
     "torch.randn_like", "torch.randint", "torch.randint_like", "torch.randperm",
     "torch.Tensor.new_empty", "torch.Tensor.new_empty_strided"],
)
def test_shape_inference_of_garbage_and_random_values(registry, name):
    # their values cannot be compared, so their annotations hold numbers only (no split)
    # and what is checked is that the inferred shape is the real one
    op = registry.get(name)
    rng = random.Random(0)
    for _ in range(20):
        args, kwargs = op.input_gen_fn(rng)
        call = op.bind(args, kwargs)
        bound = call.anno.bind(call.shapes(), call.kwargs)
        assert bound.transform_space() == []
        real = tuple(call.run().shape)
        assert bound.output_shapes[0] == (real or (1,))


def test_like_ops_with_fixed_values_split(registry):
    x = torch.randn(4, 6)
    assert len(verify_op(registry.lookup(torch.zeros_like), (x,))) == 5
    assert verify_op(registry.lookup(torch.full_like), (x, 7.0), {"dtype": torch.float64})
    assert verify_op(registry.lookup(T.fill_), (x, torch.tensor(2.0)))
    assert verify_op(registry.lookup(T.zero_), (x,))


def test_triu_splits_leading_dims_only(registry):
    x = torch.randn(2, 4, 4)
    transforms = verify_op(registry.lookup(torch.triu), (x,), {"diagonal": 1})
    assert {(t.idx, t.dim) for t in transforms} == {(0, 0)}
    assert registry.lookup(T.tril).name == "torch.tril"
    assert verify_op(registry.lookup(T.tril_), (x, -1)) == transforms


def test_tensor_as_tensor_passes_tensors_through(registry):
    x = torch.randn(4, 6)
    assert anno(registry, torch.as_tensor, x, dtype=torch.float64) == "* -> *"
    assert anno(registry, torch.as_tensor, [1, 2]) == "? -> 2"
    assert verify_op(registry.lookup(torch.as_tensor), (x,), {"dtype": torch.float64})
