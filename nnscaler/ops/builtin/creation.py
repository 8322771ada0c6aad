"""Tensor creation: ``arange``, ``zeros``, ``full``, ``*_like``, ``new_*``, ``tensor``, ``triu``...

An op whose output size comes from its arguments (``zeros(2, 3)``, ``arange(n)``) has no
tensor input to split along: its annotation names the output with numbers
(``-> 2 3``), so it is replicated. Ops whose values do not depend on the position
(``zeros_like``, ``full_like``, ``fill_``) split like elementwise ops. Ops whose values
are garbage or random (``empty``, ``rand_like``) are annotated with numbers only: the
promise test then checks the shape inference, never the values.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch

from nnscaler.ops.builtin._common import SPLITTABLE_SIZES, is_tensor, randint
from nnscaler.ops.builtin.family_helpers import (
    Gen,
    randn,
    register_all,
    shape,
    spellings,
    unary_gen,
)
from nnscaler.ops.registry import OpRegistry

T = torch.Tensor


def _shape_text(s: Sequence[int]) -> str:
    return " ".join(str(int(n)) for n in s) if len(s) else "1"  # a 0-d tensor is '1'


def _size_of(size: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """The shape given as ``*size`` (``2, 3``), one sequence (``(2, 3)``) or ``size=``."""
    if not size:
        size = tuple(kwargs.get("size", ()))
    elif len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return tuple(int(n) for n in size)


def _data_shape(data: Any) -> tuple[int, ...]:
    """The shape of ``torch.tensor(data)``: nested sequences, tensors, arrays, numbers."""
    if hasattr(data, "shape"):
        return tuple(int(n) for n in data.shape)
    if isinstance(data, (list, tuple)):
        return (len(data), *(_data_shape(data[0]) if data else ()))
    return ()


# -- annotations (their signatures are the ops' documented ones) ------------------------


def _arange(start=0, end=None, step=1, *, out=None, dtype=None, layout=None, device=None,
            requires_grad=False, pin_memory=False) -> str:
    if end is None:  # arange(end)
        start, end = 0, start
    n = max(math.ceil((float(end) - float(start)) / float(step)), 0)
    return f"-> {n}"


def _sized(*size, out=None, dtype=None, layout=None, device=None, requires_grad=False,
           pin_memory=False, **kwargs) -> str:
    return f"-> {_shape_text(_size_of(size, kwargs))}"


def _random_sized(*size, generator=None, out=None, dtype=None, layout=None, device=None,
                  requires_grad=False, pin_memory=False, **kwargs) -> str:
    return f"-> {_shape_text(_size_of(size, kwargs))}"


def _randint(low=0, high=None, size=None, *, generator=None, out=None, dtype=None, layout=None,
             device=None, requires_grad=False, pin_memory=False) -> str:
    if size is None:  # randint(high, size)
        size = high
    return f"-> {_shape_text(tuple(size))}"


def _randperm(n, *, generator=None, out=None, dtype=torch.int64, layout=None, device=None,
              requires_grad=False, pin_memory=False) -> str:
    return f"-> {int(n)}"


def _full(size, fill_value, *, out=None, dtype=None, layout=None, device=None,
          requires_grad=False, pin_memory=False) -> str:
    return f"-> {_shape_text(tuple(size))}"


def _eye(n, m=None, *, out=None, dtype=None, layout=None, device=None, requires_grad=False,
         pin_memory=False) -> str:
    return f"-> {int(n)} {int(n if m is None else m)}"


def _linspace(start, end, steps, *, out=None, dtype=None, layout=None, device=None,
              requires_grad=False) -> str:
    return f"-> {int(steps)}"


def _logspace(start, end, steps, base=10.0, *, out=None, dtype=None, layout=None, device=None,
              requires_grad=False) -> str:
    return f"-> {int(steps)}"


def _tril_indices(row, col, offset=0, *, dtype=torch.int64, device=None, layout=None) -> str:
    n = sum(max(0, min(col, i + offset + 1)) for i in range(row))
    return f"-> 2 {n}"


def _triu_indices(row, col, offset=0, *, dtype=torch.int64, device=None, layout=None) -> str:
    n = sum(max(0, col - max(0, i + offset)) for i in range(row))
    return f"-> 2 {n}"


def _tensor(data, *, dtype=None, device=None, requires_grad=False, pin_memory=False) -> str:
    return f"? -> {_shape_text(_data_shape(data))}"


def _as_tensor(data, *, dtype=None, device=None) -> str:
    # a tensor passes through, converted elementwise; other data becomes a new tensor
    return "* -> *" if is_tensor(data) else f"? -> {_shape_text(_data_shape(data))}"


def _scalar_tensor(s, *, dtype=None, layout=None, device=None, requires_grad=False,
                   pin_memory=False) -> str:
    return "? -> 1"


def _new_sized(self, *size, dtype=None, device=None, requires_grad=False, layout=None,
               pin_memory=False, **kwargs) -> str:
    return f"? -> {_shape_text(_size_of(size, kwargs))}"


def _new_full(self, size, fill_value, *, dtype=None, device=None, requires_grad=False,
              layout=None, pin_memory=False) -> str:
    return f"? -> {_shape_text(tuple(size))}"


def _new_tensor(self, data, *, dtype=None, device=None, requires_grad=False, layout=None,
                pin_memory=False) -> str:
    return f"? -> {_shape_text(_data_shape(data))}"


def _like(input, *, dtype=None, layout=None, device=None, requires_grad=False,
          memory_format=torch.preserve_format): ...


def _full_like(input, fill_value, *, dtype=None, layout=None, device=None, requires_grad=False,
               memory_format=torch.preserve_format): ...


def _fixed_like(input, *, dtype=None, layout=None, device=None, requires_grad=False,
                memory_format=torch.preserve_format) -> str:
    # garbage or random values: replicated, only the shape is known
    s = _shape_text(tuple(input.shape))
    return f"{s} -> {s}"


def _randint_like(input, low=0, high=None, *, dtype=None, layout=None, device=None,
                  requires_grad=False, memory_format=torch.preserve_format) -> str:
    s = _shape_text(tuple(input.shape))
    return f"{s} -> {s}"


def _new_empty_strided(self, size, stride, *, dtype=None, device=None, requires_grad=False,
                       layout=None, pin_memory=False) -> str:
    return f"? -> {_shape_text(tuple(size))}"


def _tri(input, diagonal=0): ...
def _tri_(self, diagonal=0): ...
def _fill(input, value): ...
def _fill_(self, value): ...
def _zero_(self): ...


#: whether triu/tril keep an element depends on its (row, column) index, so the two matrix
#: dims are fixed and the leading (batch) dims split. (Splitting a matrix dim would be
#: correct with ``diagonal`` shifted by the part's offset, which ``update_kwargs`` cannot
#: compute: it is not given the sizes.)
TRI = "* m^ n^ -> * m^ n^"


# -- input generators -------------------------------------------------------------------

_DTYPES = (None, torch.float32, torch.float64, torch.int64, torch.bool)


def _dtype_kw(rng: random.Random, dtypes: Sequence[Any] = _DTYPES) -> dict[str, Any]:
    dtype = rng.choice(dtypes)
    return {} if dtype is None else {"dtype": dtype}


def _size_args(rng: random.Random, s: tuple[int, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``s`` spelled as varargs, a tuple, a list, a ``torch.Size`` or ``size=``."""
    how = rng.randrange(5)
    if how == 0 and s:  # zeros() is not zeros(())
        return s, {}
    if how == 1:
        return (s,), {}
    if how == 2:
        return (list(s),), {}
    if how == 3:
        return (torch.Size(s),), {}
    return (), {"size": s}


def _gen_sized(dtypes: Sequence[Any] = _DTYPES) -> Gen:
    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kw = _size_args(rng, shape(rng, 0, 4))
        return args, {**kw, **_dtype_kw(rng, dtypes)}

    return gen


def _gen_randint(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    s = shape(rng, 0, 3)
    return rng.choice([((5, s), {}), ((-2, 5, s), {}), ((0, 3), {"size": s})])


def _gen_arange(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    how = rng.randrange(5)
    if how == 0:
        return (rng.randint(0, 12),), _dtype_kw(rng, (None, torch.float32, torch.int64))
    if how == 1:
        start = rng.randint(-5, 5)
        return (start, start + rng.randint(0, 12)), {}
    if how == 2:
        return (rng.randint(-5, 5), rng.randint(5, 20), rng.choice([1, 2, 3])), {}
    if how == 3:
        return (0.0, rng.choice([1.0, 2.5]), rng.choice([0.1, 0.25, 0.3])), {}
    return (), {"start": 2, "end": 11, "step": 3}


def _gen_full(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    s = shape(rng, 0, 4)
    size = rng.choice([s, list(s)])
    value = rng.choice([0.5, 3, True, float("-inf")])
    return rng.choice([((size, value), {}), ((size,), {"fill_value": value}),
                       ((), {"size": size, "fill_value": value, **_dtype_kw(rng, (None, torch.float64))})])


def _gen_eye(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    n = rng.randint(1, 8)
    return rng.choice([((n,), {}), ((n, rng.randint(1, 8)), {}), ((n,), {"m": 3})])


def _gen_linspace(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    steps = rng.randint(1, 12)
    return rng.choice([((0.0, 1.0, steps), {}), ((-2, 3), {"steps": steps}),
                       ((torch.tensor(0.5), 4.0, steps), {})])


def _gen_logspace(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    steps = rng.randint(1, 12)
    return rng.choice([((0.0, 1.0, steps), {}), ((-2, 3, steps, 2.0), {})])


def _gen_tri_indices(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    row, col = rng.randint(0, 8), rng.randint(0, 8)
    return rng.choice([((row, col), {}), ((row, col, rng.randint(-4, 4)), {}),
                       ((row, col), {"offset": rng.randint(-4, 4)})])


def _gen_data(rng: random.Random) -> Any:
    how = rng.randrange(6)
    if how == 0:
        return rng.choice([3, 2.5, True])
    if how == 1:
        return [rng.randint(0, 9) for _ in range(rng.randint(0, 6))]
    if how == 2:
        return [[rng.random() for _ in range(3)] for _ in range(rng.randint(1, 4))]
    if how == 3:
        return randn(rng, *shape(rng, 0, 3)).tolist()
    if how == 4:
        return (1, 2, 3)
    return []


def _gen_tensor(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_gen_data(rng),), _dtype_kw(rng, (None, torch.float32, torch.float64))


def _gen_as_tensor(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if rng.random() < 0.5:
        (x,), _ = unary_gen()(rng)
        return (x,), _dtype_kw(rng, (None, torch.float64))
    return (_gen_data(rng),), {}


def _gen_scalar_tensor(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (rng.choice([1.5, 3, False]),), _dtype_kw(rng, (None, torch.float64))


def _gen_new_sized(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = randn(rng, *shape(rng, 0, 2))
    args, kw = _size_args(rng, shape(rng, 0, 4))
    return (x, *args), {**kw, **_dtype_kw(rng)}


def _gen_new_full(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = randn(rng, *shape(rng, 0, 2))
    return (x, shape(rng, 0, 4), rng.choice([0.0, 7, -1.5])), _dtype_kw(rng)


def _gen_new_tensor(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = randn(rng, *shape(rng, 0, 2))
    return (x, _gen_data(rng)), {}


def _gen_new_empty_strided(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = randn(rng, *shape(rng, 0, 2))
    s = shape(rng, 1, 3)
    stride = tuple(math.prod(s[i + 1:]) for i in range(len(s)))
    return (x, s, stride), {}


def _gen_like(with_value: bool) -> Gen:
    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        (x,), _ = unary_gen()(rng)
        kw = _dtype_kw(rng, (None, torch.float64, torch.int64))
        if with_value:
            return (x, rng.choice([0.5, -2, float("inf")])), (kw if "dtype" not in kw
                                                              or kw["dtype"].is_floating_point else {})
        return (x,), kw

    return gen


def _gen_randint_like(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (x,), _ = unary_gen()(rng)
    return rng.choice([((x, 5), {}), ((x, -3, 5), {}), ((x,), {"high": 4})])


def _gen_tri(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    s = shape(rng, 2, 4, SPLITTABLE_SIZES)
    x = randn(rng, *s)
    return rng.choice([((x,), {}), ((x, rng.randint(-3, 3)), {}),
                       ((x,), {"diagonal": rng.randint(-3, 3)})])


def _gen_fill(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (x,), _ = unary_gen()(rng)
    return (x, rng.choice([0.0, 3, torch.tensor(-1.5)])), {}


def _int_gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (randint(rng, 0, 5, *shape(rng, 0, 3)),), {}


# -- registration -----------------------------------------------------------------------


def register(registry: OpRegistry) -> None:
    register_all(registry, (torch.arange,), _arange, name="torch.arange", gen=_gen_arange)
    for fn in (torch.zeros, torch.ones, torch.empty):
        register_all(registry, (fn,), _sized, name=f"torch.{fn.__name__}", gen=_gen_sized())
    for fn in (torch.rand, torch.randn):
        register_all(registry, (fn,), _random_sized, name=f"torch.{fn.__name__}",
                     gen=_gen_sized((None, torch.float32, torch.float64)))
    register_all(registry, (torch.randint,), _randint, name="torch.randint", gen=_gen_randint)
    register_all(registry, (torch.randperm,), _randperm, name="torch.randperm",
                 gen=lambda rng: ((rng.randint(0, 12),), {}))
    register_all(registry, (torch.full,), _full, name="torch.full", gen=_gen_full)
    register_all(registry, (torch.eye,), _eye, name="torch.eye", gen=_gen_eye)
    register_all(registry, (torch.linspace,), _linspace, name="torch.linspace", gen=_gen_linspace)
    register_all(registry, (torch.logspace,), _logspace, name="torch.logspace", gen=_gen_logspace)
    register_all(registry, (torch.tril_indices,), _tril_indices, name="torch.tril_indices",
                 gen=_gen_tri_indices)
    register_all(registry, (torch.triu_indices,), _triu_indices, name="torch.triu_indices",
                 gen=_gen_tri_indices)
    register_all(registry, (torch.tensor,), _tensor, name="torch.tensor", gen=_gen_tensor)
    register_all(registry, (torch.as_tensor,), _as_tensor, name="torch.as_tensor",
                 gen=_gen_as_tensor)
    register_all(registry, (torch.scalar_tensor,), _scalar_tensor, name="torch.scalar_tensor",
                 gen=_gen_scalar_tensor)

    for name in ("new_ones", "new_zeros", "new_empty"):
        register_all(registry, (getattr(T, name),), _new_sized, name=f"torch.Tensor.{name}",
                     gen=_gen_new_sized)
    register_all(registry, (T.new_full,), _new_full, name="torch.Tensor.new_full",
                 gen=_gen_new_full)
    register_all(registry, (T.new_tensor,), _new_tensor, name="torch.Tensor.new_tensor",
                 gen=_gen_new_tensor)
    register_all(registry, (T.new_empty_strided,), _new_empty_strided,
                 name="torch.Tensor.new_empty_strided", gen=_gen_new_empty_strided)

    # the values do not depend on the position: these split like elementwise ops
    for fn in (torch.zeros_like, torch.ones_like):
        register_all(registry, (fn,), "* -> *", name=f"torch.{fn.__name__}",
                     gen=_gen_like(False), signature=_like)
    register_all(registry, (torch.full_like,), "* -> *", name="torch.full_like",
                 gen=_gen_like(True), signature=_full_like)
    for fn in (torch.empty_like, torch.rand_like, torch.randn_like):
        register_all(registry, (fn,), _fixed_like, name=f"torch.{fn.__name__}",
                     gen=_gen_like(False) if fn is torch.empty_like else unary_gen())
    register_all(registry, (torch.randint_like,), _randint_like, name="torch.randint_like",
                 gen=_gen_randint_like)

    for name in ("triu", "tril"):
        register_all(registry, spellings(name), TRI, name=f"torch.{name}", gen=_gen_tri,
                     signature=_tri)
        register_all(registry, (getattr(T, f"{name}_"),), TRI, name=f"torch.Tensor.{name}_",
                     gen=_gen_tri, signature=_tri_)
    register_all(registry, (T.fill_,), "*, ? -> *", name="torch.Tensor.fill_", gen=_gen_fill,
                 signature=_fill_)
    register_all(registry, (torch.fill,), "*, ? -> *", name="torch.fill", gen=_gen_fill,
                 signature=_fill)
    register_all(registry, (T.zero_,), "* -> *", name="torch.Tensor.zero_", gen=unary_gen(),
                 signature=_zero_)
