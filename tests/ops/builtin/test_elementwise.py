"""Elementwise ops: what the tracer sees resolves to the right op, with the right marks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from nnscaler.anno import Split
from nnscaler.ops.builtin import elementwise
from nnscaler.ops.registry import OpRegistry
from nnscaler.ops.verify import verify_op

T = torch.Tensor


@pytest.fixture(scope="module")
def registry() -> OpRegistry:
    r = OpRegistry()
    elementwise.register(r)
    return r


class _Seen(TorchFunctionMode):
    """Records the callables a TorchFunctionMode sees, as the tracer does."""

    def __init__(self) -> None:
        super().__init__()
        self.funcs: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def _seen(fn) -> list:
    with _Seen() as mode:
        fn()
    return mode.funcs


def anno(registry: OpRegistry, fn, *args, **kwargs) -> str:
    return str(registry.lookup(fn).annotation_for(args, kwargs))


@pytest.mark.parametrize(
    ("expr", "name"),
    [
        (lambda x: x + 1, "torch.add"),
        (lambda x: 1 + x, "torch.add"),
        (lambda x: 1 - x, "torch.rsub"),
        (lambda x: x * 2, "torch.mul"),
        (lambda x: 2 / x, "torch.Tensor.__rtruediv__"),
        (lambda x: x // 2, "torch.floor_divide"),
        (lambda x: 2 // x, "torch.Tensor.__rfloordiv__"),
        (lambda x: x % 2, "torch.remainder"),
        (lambda x: x**2, "torch.pow"),
        (lambda x: 2**x, "torch.Tensor.__rpow__"),
        (lambda x: torch.pow(2, x), "torch.pow"),
        (lambda x: -x, "torch.neg"),
        (lambda x: abs(x), "torch.abs"),
        (lambda x: x.float(), "torch.Tensor.float"),
        (lambda x: x.to(torch.float16), "torch.Tensor.to"),
        (lambda x: x.type(torch.float64), "torch.Tensor.type"),
        (lambda x: x.contiguous(), "torch.Tensor.contiguous"),
        (lambda x: F.sigmoid(x), "torch.sigmoid"),
        (lambda x: F.tanh(x), "torch.tanh"),
        (lambda x: F.gelu(x, approximate="tanh"), "torch.nn.functional.gelu"),
        (lambda x: F.silu(x), "torch.nn.functional.silu"),
        (lambda x: torch.relu(x), "torch.nn.functional.relu"),
        (lambda x: x.clip(0, 1), "torch.clamp"),
        (lambda x: torch.special.expit(x), "torch.sigmoid"),
        (lambda x: x.rsqrt(), "torch.rsqrt"),
    ],
)
def test_what_the_tracer_sees_is_registered(registry, expr, name):
    x = torch.randn(2, 3).abs() + 0.5
    funcs = _seen(lambda: expr(x))
    assert [registry.lookup(f).name for f in funcs] == [name]


def test_inplace_operators_are_inplace_ops(registry):
    def body():
        x = torch.zeros(2, 3)
        x += 1
        x *= 2
        x -= 1
        x /= 2

    funcs = _seen(body)
    names = [registry.lookup(f).name for f in funcs if f is not torch.zeros]
    assert names == ["torch.Tensor.add_", "torch.Tensor.mul_", "torch.Tensor.sub_",
                     "torch.Tensor.div_"]
    assert registry.lookup(T.__iadd__).name == "torch.Tensor.add_"
    assert registry.lookup(T.__ipow__).name == "torch.Tensor.pow_"
    assert registry.lookup(T.__itruediv__).name == "torch.Tensor.div_"


def test_broadcasting_marks_size_one_dims_as_numbers(registry):
    x, y = torch.randn(2, 3, 4), torch.randn(3, 1)
    assert anno(registry, torch.add, x, y) == "a b c, b 1 -> a b c"
    assert anno(registry, torch.add, y, x, alpha=2) == "b 1, a b c -> a b c"
    assert anno(registry, torch.Tensor.mul, x, 2.0) == "a b c, ? -> a b c"
    assert anno(registry, torch.pow, 2, x) == "?, a b c -> a b c"
    # a 0-d result is written '1' so its shape is still checked
    assert anno(registry, torch.add, torch.tensor(1.0), 2) == "?, ? -> 1"


def test_broadcast_split_leaves_the_size_one_operand_whole(registry):
    x, y = torch.randn(4, 6), torch.randn(4, 1)
    transforms = verify_op(registry.lookup(torch.mul), (x, y))
    on_last = [t for t in transforms if t.idx == 0 and t.dim == 1]
    assert on_last and all(t.inputs[1] is not None and not isinstance(t.inputs[1], Split)
                           for t in on_last)
    assert {(t.idx, t.dim) for t in transforms} == {(0, 0), (0, 1), (1, 0)}


def test_inplace_op_keeps_its_promise_on_the_mutated_input(registry):
    x, y = torch.randn(4, 6), torch.randn(6)
    transforms = verify_op(registry.lookup(T.add_), (x, y), {"alpha": 3})
    assert transforms
    assert registry.lookup(T.add_).bind((x, y), {"alpha": 3}).kwargs == {"alpha": 3}


def test_div_rounding_mode_is_a_keyword(registry):
    x, y = torch.randn(4, 6), torch.randn(4, 6).abs() + 1
    call = registry.lookup(torch.div).bind((x, y), {"rounding_mode": "floor"})
    assert call.kwargs == {"rounding_mode": "floor"}
    assert torch.equal(call.run(), torch.div(x, y, rounding_mode="floor"))
    verify_op(registry.lookup(T.div), (x, y), {"rounding_mode": "trunc"})


def test_clamp_with_tensor_bounds_broadcasts(registry):
    x, lo = torch.randn(2, 3, 4), torch.randn(4)
    assert anno(registry, torch.clamp, x, lo) == "a b c, c, ? -> a b c"
    assert anno(registry, torch.clamp, x, max=0.5) == "a b c, ?, ? -> a b c"
    verify_op(registry.lookup(torch.clamp), (x,), {"min": lo, "max": lo + 1})


def test_type_without_a_dtype_is_not_a_tensor_op(registry):
    x = torch.randn(2, 3)
    assert anno(registry, T.type, x) == "? -> ?"
    assert anno(registry, T.type, x, torch.float64) == "* -> *"


def test_to_another_tensor_passes_it_whole(registry):
    x, other = torch.randn(4, 6), torch.zeros(2, dtype=torch.int64)
    op = registry.lookup(T.to)
    assert op.bind((x, other), {}).kwargs == {"args": (other,)}
    transforms = verify_op(op, (x, other))
    assert len(transforms) == 5  # dim 0 in 2 or 4 parts, dim 1 in 2, 3 or 6
    assert op.bind((x, other), {}).run().dtype == torch.int64


def test_gelu_tanh_and_zero_d_inputs(registry):
    verify_op(registry.lookup(F.gelu), (torch.randn(4, 6),), {"approximate": "tanh"})
    verify_op(registry.lookup(torch.exp), (torch.tensor(0.5),))
