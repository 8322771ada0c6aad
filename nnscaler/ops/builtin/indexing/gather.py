"""gather / take_along_dim / take: the input dim an index reads along is ``^`` (the index
may be split instead, with the input replicated); the index's dims are the output's.
"""

from __future__ import annotations

import math
import random

import torch

from nnscaler.ops.builtin._common import (
    idents,
    join_anno,
    norm_dim,
    randint,
    shape_of,
)
from nnscaler.ops.builtin.indexing.common import (
    Call,
    frozen_dims,
    rand_tensor,
    small_shape,
)
from nnscaler.ops.builtin.shape.reshape import reshape_dims
from nnscaler.ops.registry import OpRegistry


def _gather_anno(input: torch.Tensor, dim: int, index: torch.Tensor, *, sparse_grad: bool = False) -> str:
    n = input.dim()
    if n == 0:
        return "1, ?, 1 -> 1"
    d = norm_dim(dim, n)
    names = idents(2 * n)
    mine, fresh = names[:n], names[n:]
    ins, idx = list(mine), list(fresh)
    for k in range(n):
        if k == d:
            ins[k] = mine[k] + "^"  # the index dim is split with input replicated
        elif index.shape[k] == input.shape[k]:
            idx[k] = mine[k]
        else:
            ins[k], idx[k] = mine[k] + "^", fresh[k] + "^"
    return join_anno([ins, "?", idx], [idx])


def _take_along_dim_anno(input: torch.Tensor, indices: torch.Tensor, dim: int | None = None) -> str:
    if dim is None:
        ishape = shape_of(indices)
        names = idents(input.dim() + indices.dim())
        theirs = names[input.dim():]
        idx, out = reshape_dims(ishape, (math.prod(ishape),), theirs)
        return join_anno([frozen_dims(names[:input.dim()]), idx], [out])
    n = input.dim()
    d = norm_dim(dim, n)
    names = idents(n)
    ins, idx, out = list(names), list(names), list(names)
    for k in range(n):
        si, sj = input.shape[k], indices.shape[k]
        if k == d:
            ins[k] = names[k] + "^"
            idx[k] = out[k] = "z" + names[k]  # the index dim: split with input replicated
        elif si != sj and si == 1:
            ins[k] = "1"
        elif si != sj and sj == 1:
            idx[k] = "1"
    return join_anno([ins, idx], [out])


def _take_shape_anno(input: torch.Tensor, index: torch.Tensor) -> str:
    names = idents(input.dim() + index.dim())
    theirs = names[input.dim():]
    return join_anno([frozen_dims(names[:input.dim()]), theirs], [theirs])


def _gen_gather(rng: random.Random) -> Call:
    shape = small_shape(rng, 1, 3)
    x = rand_tensor(rng, shape)
    d = rng.randrange(len(shape))
    ishape = [s if rng.random() < 0.7 else rng.randint(1, s) for s in shape]
    ishape[d] = rng.choice((1, 2, 4, 6))
    index = randint(rng, 0, shape[d], *ishape)
    dim = d - len(shape) if rng.random() < 0.3 else d
    return (x, dim, index), {}


def _gen_take_along_dim(rng: random.Random) -> Call:
    shape = small_shape(rng, 1, 3)
    x = rand_tensor(rng, shape)
    if rng.random() < 0.3:
        return (x, randint(rng, 0, x.numel(), *small_shape(rng, 1, 2))), {}
    d = rng.randrange(len(shape))
    ishape = [s if rng.random() < 0.7 else 1 for s in shape]
    ishape[d] = rng.choice((1, 2, 4))
    xs = [1 if (k != d and rng.random() < 0.2) else s for k, s in enumerate(shape)]
    x = rand_tensor(rng, xs)
    return (x, randint(rng, 0, xs[d], *ishape)), {"dim": d}


def _gen_take(rng: random.Random) -> Call:
    x = rand_tensor(rng, small_shape(rng, 1, 3))
    return (x, randint(rng, -x.numel(), x.numel(), *small_shape(rng, 1, 2))), {}


def register(registry: OpRegistry) -> None:
    """Register the gather, take_along_dim and take ops."""
    T = torch.Tensor
    reg = registry.register

    reg(torch.gather, _gather_anno, name="torch.gather", aliases=(T.gather,), input_gen_fn=_gen_gather)
    reg(torch.take_along_dim, _take_along_dim_anno, name="torch.take_along_dim", aliases=(T.take_along_dim,),
        input_gen_fn=_gen_take_along_dim)
    reg(torch.take, _take_shape_anno, name="torch.take", aliases=(T.take,), input_gen_fn=_gen_take)
