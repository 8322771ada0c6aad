"""Transposes and permutations: transpose, swapaxes, t, T/H/mT/mH, adjoint, permute,
movedim. Every dim keeps its identifier; only the order changes.
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
)
from nnscaler.ops.builtin.shape.common import (
    dims_arg,
    gen_2d,
    gen_upto_2d,
    rand_dim,
    rand_ndim,
    sizes_arg,
)
from nnscaler.ops.registry import OpRegistry


def _perm(ndim: int, perm: Sequence[int]) -> str:
    """Output dim ``i`` is input dim ``perm[i]``."""
    names = idents(ndim)
    return join_anno([names], [[names[p] for p in perm]])


def _swap(input: torch.Tensor, d0: int, d1: int) -> str:
    n = input.dim()
    perm = list(range(n))
    if n:
        a, b = norm_dim(d0, n), norm_dim(d1, n)
        perm[a], perm[b] = perm[b], perm[a]
    return _perm(n, perm)


def _transpose_anno(input: torch.Tensor, dim0: int, dim1: int) -> str:
    return _swap(input, dim0, dim1)


def _swapaxes_anno(input: torch.Tensor, axis0: int, axis1: int) -> str:
    return _swap(input, axis0, axis1)


def _swapdims_anno(input: torch.Tensor, dim0: int, dim1: int) -> str:
    return _swap(input, dim0, dim1)


def _t_anno(input: torch.Tensor) -> str:
    return _swap(input, 0, 1) if input.dim() == 2 else _perm(input.dim(), range(input.dim()))


def _reverse_anno(instance: torch.Tensor, owner: Any = None) -> str:
    n = instance.dim()
    return _perm(n, list(reversed(range(n))))


def _matrix_t_anno(instance: torch.Tensor, owner: Any = None) -> str:
    return _swap(instance, -2, -1)


def _adjoint_anno(input: torch.Tensor) -> str:
    return _swap(input, -2, -1)


def _permute_fn_anno(input: torch.Tensor, dims: Sequence[int]) -> str:
    n = input.dim()
    return _perm(n, [norm_dim(d, n) for d in dims])


def _permute_method_anno(self: torch.Tensor, *dims: Any) -> str:
    return _permute_fn_anno(self, sizes_arg(dims))


def _movedim_anno(input: torch.Tensor, source: Any, destination: Any) -> str:
    n = input.dim()
    src = [norm_dim(d, n) for d in dims_arg(source)]
    dst = [norm_dim(d, n) for d in dims_arg(destination)]
    order: list[int | None] = [None] * n
    for s, d in zip(src, dst, strict=True):
        order[d] = s
    rest = iter(k for k in range(n) if k not in src)
    perm = [o if o is not None else next(rest) for o in order]
    return _perm(n, perm)


def _gen_transpose(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 4)
    return (x, rand_dim(rng, x.dim()), rand_dim(rng, x.dim())), {}


def _gen_matrices(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (rand_ndim(rng, 2, 4),), {}


def _rand_perm(rng: random.Random, n: int) -> list[int]:
    perm = list(range(n))
    rng.shuffle(perm)
    return [p - n if rng.random() < 0.2 else p for p in perm]


def _gen_permute_fn(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 4)
    return (x, tuple(_rand_perm(rng, x.dim()))), {}


def _gen_permute_method(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 4)
    perm = _rand_perm(rng, x.dim())
    return ((x, perm) if rng.random() < 0.3 else (x, *perm)), {}


def _gen_movedim(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 4)
    n = x.dim()
    k = rng.randint(1, n)
    src = rng.sample(range(n), k)
    dst = rng.sample(range(n), k)
    if k == 1 and rng.random() < 0.5:
        return (x, src[0], dst[0] - n), {}
    return (x, tuple(src), tuple(dst)), {}


def register(registry: OpRegistry) -> None:
    """Register the transposes and permutations."""
    T = torch.Tensor
    reg = registry.register

    reg(torch.transpose, _transpose_anno, name="torch.transpose", aliases=(T.transpose,),
        input_gen_fn=_gen_transpose)
    reg(T.transpose_, _transpose_anno, name="torch.Tensor.transpose_", input_gen_fn=_gen_transpose)
    reg(torch.swapaxes, _swapaxes_anno, name="torch.swapaxes", aliases=(T.swapaxes,),
        input_gen_fn=_gen_transpose)
    reg(torch.swapdims, _swapdims_anno, name="torch.swapdims", aliases=(T.swapdims,),
        input_gen_fn=_gen_transpose)
    reg(torch.t, _t_anno, name="torch.t", aliases=(T.t,), input_gen_fn=gen_upto_2d)
    reg(T.t_, _t_anno, name="torch.Tensor.t_", input_gen_fn=gen_upto_2d)
    reg(T.T.__get__, _reverse_anno, name="torch.Tensor.T", input_gen_fn=gen_2d)
    reg(T.H.__get__, _reverse_anno, name="torch.Tensor.H", input_gen_fn=gen_2d)
    reg(T.mT.__get__, _matrix_t_anno, name="torch.Tensor.mT", input_gen_fn=_gen_matrices)
    reg(T.mH.__get__, _matrix_t_anno, name="torch.Tensor.mH", input_gen_fn=_gen_matrices)
    reg(torch.adjoint, _adjoint_anno, name="torch.adjoint", aliases=(T.adjoint,), input_gen_fn=_gen_matrices)
    reg(torch.permute, _permute_fn_anno, name="torch.permute", input_gen_fn=_gen_permute_fn)
    reg(T.permute, _permute_method_anno, name="torch.Tensor.permute", input_gen_fn=_gen_permute_method)
    reg(torch.movedim, _movedim_anno, name="torch.movedim",
        aliases=(T.movedim, torch.moveaxis, T.moveaxis), input_gen_fn=_gen_movedim)
