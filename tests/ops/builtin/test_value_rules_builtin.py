"""The built-in value rules: add and sub of two tensors (and their aliases) are linear in
the pair, so their value splits (``dim=None``) keep the promise under verify_op; with a
Python number operand (added by every part) or for a non-linear op there is none."""

from __future__ import annotations

import pytest
import torch

from nnscaler.anno import TransformRule, ValuePartial
from nnscaler.ops.builtin.elementwise import sum_of_parts_rules
from nnscaler.ops.verify import verify_op
from nnscaler.plugins import get_plugin_manager

T = torch.Tensor
V = ValuePartial()


def op(fn):  # type: ignore[no-untyped-def]
    return get_plugin_manager().ops.lookup(fn)


def value_splits(transforms: list) -> list[tuple]:
    return [(t.idx, t.num, t.ident, t.inputs, t.outputs) for t in transforms if t.dim is None]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


ALL = [(0, n, "+", (V, V), (V,)) for n in (2, 3, 4)]


FUNCTIONS = {  # test id: (what the tracer sees, the registered op)
    "torch.add": (torch.add, "torch.add"),
    "Tensor.add": (T.add, "torch.add"),
    "Tensor.__add__": (T.__add__, "torch.add"),
    "torch.sub": (torch.sub, "torch.sub"),
    "torch.subtract": (torch.subtract, "torch.sub"),
    "Tensor.sub": (T.sub, "torch.sub"),
    "Tensor.__sub__": (T.__sub__, "torch.sub"),
}
CALLS = {
    "same": (((4, 6), (4, 6)), {}),
    "alpha": (((4, 6), (4, 6)), {"alpha": 2}),
    "broadcast": (((2, 3, 4), (3, 4)), {}),
    "broadcast-one-alpha": (((2, 3, 4), (3, 1)), {"alpha": 2}),  # a size-one dim
    "zero-d": (((4,), ()), {}),  # a 0-d tensor operand is a tensor, not a number
}


@pytest.mark.parametrize(
    ("fn", "name", "shapes", "kwargs"),
    [
        pytest.param(fn, name, shapes, kwargs, id=f"{label}-{call}")
        for label, (fn, name) in FUNCTIONS.items()
        for call, (shapes, kwargs) in CALLS.items()
        if not (kwargs and label.endswith("__"))  # the operators take no alpha
    ],
)
def test_two_tensors_have_a_value_split(fn, name, shapes, kwargs):
    opdef = op(fn)
    assert opdef.name == name
    x, y = (randn(*s, seed=k) for k, s in enumerate(shapes))
    transforms = verify_op(opdef, (x, y), kwargs)
    assert value_splits(transforms) == ALL
    # the dim splits of the annotation are still there
    assert any(t.dim is not None for t in transforms)


@pytest.mark.parametrize("fn", [torch.add, T.__add__, torch.sub, T.__sub__])
@pytest.mark.parametrize("number", [2, 0.5])
def test_a_number_operand_has_no_value_split(fn, number):
    x = randn(4, 6)
    transforms = verify_op(op(fn), (x, number))
    assert transforms and value_splits(transforms) == []


def test_a_number_first_has_no_value_split():
    x = randn(4, 6)
    assert value_splits(verify_op(op(torch.add), (2.0, x))) == []
    assert value_splits(verify_op(op(torch.sub), (2.0, x), {"alpha": 3})) == []


def test_radd_is_add():
    x, y = randn(4, 6), randn(6, seed=1)
    opdef = op(T.__radd__)
    assert opdef is op(torch.add)
    assert value_splits(verify_op(opdef, (x, y))) == ALL


@pytest.mark.parametrize("fn", [torch.mul, T.__mul__, torch.div, torch.maximum, torch.pow])
def test_non_linear_binary_ops_have_no_value_split(fn):
    x, y = randn(4, 6), randn(4, 6, seed=1).abs() + 0.5
    transforms = verify_op(op(fn), (x.abs() + 0.5, y))
    assert transforms and value_splits(transforms) == []


def test_integer_tensors_have_a_value_split():
    x, y = torch.arange(12).reshape(3, 4), torch.arange(4)
    assert value_splits(verify_op(op(torch.add), (x, y))) == ALL


def test_sum_of_parts_rules():
    opdef = op(torch.add)
    x, y = randn(4, 6), randn(4, 6, seed=1)
    call = opdef.bind((x, y), {})
    bound = call.anno.bind(call.shapes(), call.kwargs)
    assert sum_of_parts_rules(bound) == [TransformRule((V, V), (V,))]
    assert [r.is_value_rule for r in opdef.rules_for(bound)] == [True]
    call = opdef.bind((x, 3.0), {})
    bound = call.anno.bind(call.shapes(), call.kwargs)
    assert sum_of_parts_rules(bound) == [] and list(opdef.rules_for(bound)) == []


def _value_parts(x: torch.Tensor, num: int, seed: int) -> list[torch.Tensor]:
    """``num`` random tensors that sum to ``x`` (not proportional to it)."""
    parts = [randn(*x.shape, seed=seed + k) for k in range(num - 1)]
    return [*parts, x - sum(parts)]


def test_a_value_split_of_add_runs_as_parts():
    """The parts of a 3-way value split of ``x + 2 y`` given any value parts of x and y
    (here not proportional to them) return parts that sum to the result."""
    opdef = op(torch.add)
    x, y = randn(4, 6), randn(6, seed=1)
    call = opdef.bind((x, y), {"alpha": 2})
    bound = call.anno.bind(call.shapes(), call.kwargs)
    t = bound.split(0, None, 3, rules=opdef.rules_for(bound))
    assert (t.dim, t.num, t.inputs, t.outputs) == (None, 3, (V, V), (V,))
    xs, ys = _value_parts(x, 3, seed=10), _value_parts(y, 3, seed=20)
    parts = [call.run([a, b], t.part_kwargs(call.kwargs, k))
             for k, (a, b) in enumerate(zip(xs, ys, strict=True))]
    torch.testing.assert_close(sum(parts), torch.add(x, y, alpha=2))
