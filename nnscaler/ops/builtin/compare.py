"""Comparisons, logical and bitwise ops, ``where`` and ``masked_fill``.

All of them are elementwise over broadcast inputs, so every dim may be split. Only
``torch.where(condition)`` (one argument, a data-dependent number of indices) is taken
whole. ``Tensor.__bool__``, ``allclose`` and ``equal`` give Python bools: not ops.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from nnscaler.ops.builtin._common import is_tensor, randint
from nnscaler.ops.builtin.elementwise import self_first
from nnscaler.ops.builtin.family_helpers import (
    Gen,
    broadcast_op,
    broadcast_text,
    operands,
    randn,
    register_all,
    shape,
    spellings,
)
from nnscaler.ops.registry import OpRegistry

T = torch.Tensor


def _binary(input, other): ...
def _unary(input): ...
def _method(self): ...
def _isclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False): ...
def _masked_fill(input, mask, value): ...
def _tensor_where(self, condition, other): ...


def _where_anno(condition, input=None, other=None) -> str:
    if input is None and other is None:
        # where(condition) is nonzero(condition, as_tuple=True): sizes depend on the values
        return "? -> " + ", ".join("?" for _ in range(max(condition.dim(), 1)))
    return broadcast_text([condition, input, other])


# -- input generators -------------------------------------------------------------------


def _ties(x: torch.Tensor) -> torch.Tensor:
    # few distinct values, so that equality holds somewhere
    return (x * 2).round()


def _gen_compare(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    a, b = operands(rng, 2, domains=(_ties, _ties), scalars=(1,))
    if not is_tensor(a) and not is_tensor(b):
        a = torch.tensor(a)
    return (a, b), {}


def _gen_compare_(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    a, b = operands(rng, 2, domains=(_ties, _ties), scalars=(1,), inplace=True)
    return (a, b), {}


def _gen_logical(inplace: bool) -> Gen:
    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        a, b = operands(rng, 2, domains=(_ties, _ties), inplace=inplace)
        if rng.random() < 0.5:
            a, b = a > 0, b > 0
        return (a, b), {}

    return gen


def _gen_bitwise(inplace: bool, shift: bool = False) -> Gen:
    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        a, b = operands(rng, 2, inplace=inplace, ints=True, scalars=(1,))
        if shift:
            b = b.abs() % 4 if is_tensor(b) else abs(b) % 4
        elif rng.random() < 0.5 and is_tensor(b):  # booleans
            a, b = a > 0, b > 0
        return (a, b), {}

    return gen


def _gen_unary_float(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = randn(rng, *shape(rng, 0, 4))
    flat = x.view(-1)
    if flat.numel() > 2:
        flat[::4] = float("inf")
        flat[1::5] = float("-inf")
        flat[2::7] = float("nan")
    return (x,), {}


def _gen_not(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    s = shape(rng, 0, 4)
    return rng.choice([((randint(rng, -3, 3, *s) > 0,), {}), ((randint(rng, -3, 3, *s),), {})])


def _gen_isclose(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    a, b = operands(rng, 2)
    b = a + b * 1e-4 if rng.random() < 0.5 else b
    return (a, b), rng.choice([{}, {"rtol": 1e-3, "atol": 1e-3}, {"equal_nan": True}])


def _gen_where(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if rng.random() < 0.15:
        return _gen_where1(rng)
    cond, x, y = operands(rng, 3, scalars=(1, 2))
    cond = cond > 0 if is_tensor(cond) else torch.tensor(cond > 0)
    if not is_tensor(x) and not is_tensor(y) and rng.random() < 0.5:
        y = torch.tensor(y)
    return (cond, x, y), {}


def _gen_where1(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (randn(rng, *shape(rng, 1, 3)) > 0,), {}


def _gen_tensor_where(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x, cond, y = operands(rng, 3, scalars=(2,))
    cond = cond > 0
    return (x, cond, y), {}


def _gen_masked_fill(inplace: bool) -> Gen:
    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, mask = operands(rng, 2, inplace=True)  # the mask broadcasts to the input
        if not inplace and rng.random() < 0.3:
            mask, x = operands(rng, 2, inplace=True)  # and the input to the mask
        value = rng.choice([0.0, -1e9, float("-inf"), torch.tensor(2.5)])
        return (x, mask > 0, value), {}

    return gen


# -- registration -----------------------------------------------------------------------

#: comparison: name -> (extra aliases, in-place aliases)
COMPARISONS: dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]] = {
    "eq": ((T.__eq__,), ()),
    "ne": ((T.__ne__, torch.not_equal, T.not_equal), (T.not_equal_,)),
    "lt": ((T.__lt__, torch.less, T.less), (T.less_,)),
    "le": ((T.__le__, torch.less_equal, T.less_equal), (T.less_equal_,)),
    "gt": ((T.__gt__, torch.greater, T.greater), (T.greater_,)),
    "ge": ((T.__ge__, torch.greater_equal, T.greater_equal), (T.greater_equal_,)),
}

#: logical and bitwise binary ops: name -> (extra aliases, in-place aliases, gen, in-place gen)
BITWISE: dict[str, tuple[tuple[Any, ...], tuple[Any, ...], Gen, Gen]] = {
    "logical_and": ((), (), _gen_logical(False), _gen_logical(True)),
    "logical_or": ((), (), _gen_logical(False), _gen_logical(True)),
    "logical_xor": ((), (), _gen_logical(False), _gen_logical(True)),
    "bitwise_and": ((T.__and__, T.__rand__), (T.__iand__,), _gen_bitwise(False), _gen_bitwise(True)),
    "bitwise_or": ((T.__or__, T.__ror__), (T.__ior__,), _gen_bitwise(False), _gen_bitwise(True)),
    "bitwise_xor": ((T.__xor__, T.__rxor__), (T.__ixor__,), _gen_bitwise(False),
                    _gen_bitwise(True)),
    "bitwise_left_shift": ((T.__lshift__,), (T.__ilshift__,), _gen_bitwise(False, True),
                           _gen_bitwise(True, True)),
    "bitwise_right_shift": ((T.__rshift__,), (T.__irshift__,), _gen_bitwise(False, True),
                            _gen_bitwise(True, True)),
}

#: unary predicates and negations: name -> (extra aliases, gen)
UNARY: dict[str, tuple[tuple[Any, ...], Gen]] = {
    "isnan": ((), _gen_unary_float),
    "isinf": ((), _gen_unary_float),
    "isfinite": ((), _gen_unary_float),
    "isposinf": ((), _gen_unary_float),
    "isneginf": ((), _gen_unary_float),
    "signbit": ((), _gen_unary_float),
    "logical_not": ((), _gen_not),
    "bitwise_not": ((T.__invert__,), _gen_not),
}


def _inplace(
    registry: OpRegistry, name: str, annotation: Callable[..., str] | str, gen: Gen,
    signature: Callable[..., Any], extra: tuple[Any, ...] = (),
) -> None:
    method = getattr(T, f"{name}_", None)
    if method is not None:
        register_all(registry, (method, *extra), annotation, name=f"torch.Tensor.{name}_",
                     gen=gen, signature=signature)


def register(registry: OpRegistry) -> None:
    method2 = self_first(_binary)
    for name, (extra, inplace_extra) in COMPARISONS.items():
        register_all(registry, spellings(name, *extra), broadcast_op(_binary, 2),
                     name=f"torch.{name}", gen=_gen_compare, signature=_binary)
        _inplace(registry, name, broadcast_op(method2, 2), _gen_compare_, method2, inplace_extra)
    for name, (extra, inplace_extra, gen, gen_) in BITWISE.items():
        register_all(registry, spellings(name, *extra), broadcast_op(_binary, 2),
                     name=f"torch.{name}", gen=gen, signature=_binary)
        _inplace(registry, name, broadcast_op(method2, 2), gen_, method2, inplace_extra)
    for name, (extra, gen) in UNARY.items():
        register_all(registry, spellings(name, *extra), "* -> *", name=f"torch.{name}", gen=gen,
                     signature=_unary)
        _inplace(registry, name, "* -> *", gen, _method)
    register_all(registry, spellings("isclose"), broadcast_op(_isclose, 2), name="torch.isclose",
                 gen=_gen_isclose, signature=_isclose)
    register_all(registry, (torch.where,), _where_anno, name="torch.where", gen=_gen_where)
    # x.where(condition, y) is torch.where(condition, x, y): its own argument order
    register_all(registry, (T.where,), broadcast_op(_tensor_where, 3), name="torch.Tensor.where",
                 gen=_gen_tensor_where, signature=_tensor_where)
    register_all(registry, spellings("masked_fill"), broadcast_op(_masked_fill, 3),
                 name="torch.masked_fill", gen=_gen_masked_fill(False), signature=_masked_fill)
    method3 = self_first(_masked_fill)
    _inplace(registry, "masked_fill", broadcast_op(method3, 3), _gen_masked_fill(True), method3)
