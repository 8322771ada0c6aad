"""narrow / select / roll / flip / unfold / diagonal: the dims these ops cut, shift or
reverse are ``^``; the others keep their identifiers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from nnscaler.ops.builtin._common import (
    idents,
    join_anno,
    norm_dim,
    shape_of,
)
from nnscaler.ops.builtin.shape.common import (
    dims_arg,
    gen_2d,
    gen_upto_2d,
    rand_ndim,
    sizes_arg,
)
from nnscaler.ops.registry import OpRegistry


def _narrow_anno(input: torch.Tensor, dim: int, start: Any, length: int) -> str:
    names = idents(input.dim())
    d = norm_dim(dim, input.dim())
    ins, outs = list(names), list(names)
    ins[d] += "^"
    outs[d] = str(int(length))
    return join_anno([ins], [outs])


def _select_anno(input: torch.Tensor, dim: int, index: Any) -> str:
    names = idents(input.dim())
    d = norm_dim(dim, input.dim())
    ins = list(names)
    ins[d] += "^"
    return join_anno([ins], [names[:d] + names[d + 1:]])


def _frozen_dims(input: torch.Tensor, dims: Sequence[int]) -> str:
    names = idents(input.dim())
    frozen = {norm_dim(d, input.dim()) for d in dims}
    dims_ = [n + "^" if k in frozen else n for k, n in enumerate(names)]
    return join_anno([dims_], [dims_])


def _roll_anno(input: torch.Tensor, shifts: Any, dims: Any = None) -> str:
    if dims is None or dims_arg(dims) == ():
        return _frozen_dims(input, range(input.dim()))  # rolls the flattened tensor
    return _frozen_dims(input, dims_arg(dims))


def _flip_fn_anno(input: torch.Tensor, dims: Any) -> str:
    return _frozen_dims(input, dims_arg(dims))


def _flip_method_anno(self: torch.Tensor, *dims: Any) -> str:
    return _frozen_dims(self, sizes_arg(dims))


def _fliplr_anno(input: torch.Tensor) -> str:
    return _frozen_dims(input, [1])


def _flipud_anno(input: torch.Tensor) -> str:
    return _frozen_dims(input, [0])


def _unfold_anno(self: torch.Tensor, dimension: int, size: int, step: int) -> str:
    n = self.dim()
    names = idents(n)
    if n == 0:
        return join_anno([[]], [[str(size)]])
    d = norm_dim(dimension, n)
    ins, outs = list(names), list(names)
    ins[d] += "^"
    outs[d] = str((self.shape[d] - size) // step + 1)
    return join_anno([ins], [outs + [str(size)]])


def _diagonal_anno(input: torch.Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1) -> str:
    n = input.dim()
    names = idents(n)
    a, b = norm_dim(dim1, n), norm_dim(dim2, n)
    ins = [x + "^" if k in (a, b) else x for k, x in enumerate(names)]
    length = torch.empty(shape_of(input), device="meta").diagonal(offset, a, b).shape[-1]
    outs = [x for k, x in enumerate(names) if k not in (a, b)] + [str(length)]
    return join_anno([ins], [outs])


def _gen_narrow(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 3)
    d = rng.randrange(x.dim())
    start = rng.randrange(x.shape[d])
    length = rng.randint(0, x.shape[d] - start)
    return (x, d - x.dim() if rng.random() < 0.3 else d, start, length), {}


def _gen_select(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 3)
    d = rng.randrange(x.dim())
    return (x, d - x.dim() if rng.random() < 0.3 else d, rng.randrange(-x.shape[d], x.shape[d])), {}


def _gen_roll(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 3)
    if rng.random() < 0.3:
        return (x, rng.randint(-3, 3)), {}
    dims = rng.sample(range(x.dim()), rng.randint(1, x.dim()))
    shifts = [rng.randint(-3, 3) for _ in dims]
    if len(dims) == 1 and rng.random() < 0.5:
        return (x, shifts[0], dims[0]), {}
    return (x, tuple(shifts), tuple(dims)), {}


def _gen_flip_fn(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 3)
    return (x, tuple(rng.sample(range(x.dim()), rng.randint(0, x.dim())))), {}


def _gen_flip_method(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (x, dims), _ = _gen_flip_fn(rng)
    return ((x, dims) if rng.random() < 0.3 or not dims else (x, *dims)), {}


def _gen_unfold(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 3)
    d = rng.randrange(x.dim())
    size = rng.randint(1, x.shape[d])
    return (x, d, size, rng.randint(1, 3)), {}


def _gen_diagonal(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 2, 4)
    a, b = rng.sample(range(x.dim()), 2)
    return (x,), {"offset": rng.randint(-2, 2), "dim1": a, "dim2": b - x.dim()}


def register(registry: OpRegistry) -> None:
    """Register the narrow, select, roll, flip, unfold and diagonal ops."""
    T = torch.Tensor
    reg = registry.register

    reg(torch.narrow, _narrow_anno, name="torch.narrow", aliases=(T.narrow,), input_gen_fn=_gen_narrow)
    reg(torch.select, _select_anno, name="torch.select", aliases=(T.select,), input_gen_fn=_gen_select)
    reg(torch.roll, _roll_anno, name="torch.roll", aliases=(T.roll,), input_gen_fn=_gen_roll)
    reg(torch.flip, _flip_fn_anno, name="torch.flip", input_gen_fn=_gen_flip_fn)
    reg(T.flip, _flip_method_anno, name="torch.Tensor.flip", input_gen_fn=_gen_flip_method)
    reg(torch.fliplr, _fliplr_anno, name="torch.fliplr", aliases=(T.fliplr,), input_gen_fn=gen_2d)
    reg(torch.flipud, _flipud_anno, name="torch.flipud", aliases=(T.flipud,), input_gen_fn=gen_upto_2d)
    reg(T.unfold, _unfold_anno, name="torch.Tensor.unfold", input_gen_fn=_gen_unfold)
    reg(torch.diagonal, _diagonal_anno, name="torch.diagonal", aliases=(T.diagonal,),
        input_gen_fn=_gen_diagonal)
