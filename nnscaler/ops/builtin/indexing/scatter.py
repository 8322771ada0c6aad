"""scatter / scatter_add / scatter_reduce and index_select / index_add / index_copy /
index_fill: the dim written or read through an index is ``^``; the other dims split when
the index (and source) cover them whole.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from nnscaler.ops.builtin._common import (
    idents,
    is_tensor,
    join_anno,
    norm_dim,
    randint,
    randn,
    tensor_str,
)
from nnscaler.ops.builtin.indexing.common import (
    Call,
    rand_tensor,
    small_shape,
)
from nnscaler.ops.registry import OpRegistry


def _scatter_dims(input: torch.Tensor, dim: int, index: torch.Tensor, src: Any) -> str:
    n = input.dim()
    if n == 0:
        return join_anno(["1", "?", "1", "1" if is_tensor(src) else "?"], ["1"])
    d = norm_dim(dim, n)
    names = idents(3 * n)
    mine, fresh_i, fresh_s = names[:n], names[n:2 * n], names[2 * n:]
    src_t = is_tensor(src) and src.dim() == n
    ins, idx, srcd = list(mine), list(fresh_i), list(fresh_s)
    for k in range(n):
        same = index.shape[k] == input.shape[k] and (not src_t or src.shape[k] == index.shape[k])
        if k != d and same:
            idx[k] = srcd[k] = mine[k]
        else:
            ins[k], idx[k], srcd[k] = mine[k] + "^", fresh_i[k] + "^", fresh_s[k] + "^"
    return join_anno([ins, "?", idx, srcd if src_t else "?"], [ins])


def _scatter_anno(
    input: torch.Tensor, dim: int, index: torch.Tensor, src: Any = None, *, value: Any = None,
    reduce: str | None = None,
) -> str:
    text = _scatter_dims(input, dim, index, src)
    if src is None:  # scatter(input, dim, index, value=...): three annotated inputs
        ins, outs = text.split(" -> ")
        text = f"{ins.rsplit(', ', 1)[0]} -> {outs}"
    return text


def _scatter_add_anno(input: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> str:
    return _scatter_dims(input, dim, index, src)


def _scatter_reduce_anno(
    input: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, reduce: str, *,
    include_self: bool = True,
) -> str:
    return _scatter_dims(input, dim, index, src)


def _index_into(input: torch.Tensor, dim: int, index: torch.Tensor, source: Any) -> str:
    """``index_add``/``index_copy``/``index_fill``: rows ``index`` of ``input`` along ``dim``."""
    n = input.dim()
    if n == 0:
        idx0 = tensor_str([str(s) for s in index.shape])
        src0 = tensor_str([str(s) for s in source.shape]) if is_tensor(source) else "?"
        return join_anno(["1", "?", idx0, src0], ["1"])
    d = norm_dim(dim, n)
    names = idents(n + 1)
    mine, m = names[:n], names[n] + "^"
    ins = list(mine)
    ins[d] += "^"
    idx = [m] if index.dim() == 1 else ["1"]
    if is_tensor(source) and source.dim() == n:
        src = list(mine)
        src[d] = m if index.dim() == 1 else "1"
        src_anno: Any = src
    else:
        src_anno = "?"
    return join_anno([ins, "?", idx, src_anno], [ins])


def _index_add_anno(
    input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *, alpha: Any = 1
) -> str:
    return _index_into(input, dim, index, source)


def _index_copy_anno(input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> str:
    return _index_into(input, dim, index, source)


def _index_fill_anno(input: torch.Tensor, dim: int, index: torch.Tensor, value: Any) -> str:
    return _index_into(input, dim, index, value)


def _index_select_anno(input: torch.Tensor, dim: int, index: torch.Tensor) -> str:
    n = input.dim()
    if n == 0:
        return "1, ?, 1 -> 1"
    d = norm_dim(dim, n)
    names = idents(n + 1)
    mine, m = names[:n], names[n]
    ins, out = list(mine), list(mine)
    ins[d] += "^"
    idx = [m] if index.dim() == 1 else ["1"]
    out[d] = idx[0]
    return join_anno([ins, "?", idx], [out])


def _scatter_parts(rng: random.Random, *, unique: bool) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    shape = small_shape(rng, 1, 3)
    x = rand_tensor(rng, shape)
    d = rng.randrange(len(shape))
    ishape = [s if rng.random() < 0.7 else rng.randint(1, s) for s in shape]
    if unique:  # each position written at most once: the result does not depend on the order
        ishape[d] = rng.randint(1, shape[d])
        cols = math.prod(ishape) // ishape[d]
        g = torch.Generator().manual_seed(rng.getrandbits(32))
        perms = torch.stack([torch.randperm(shape[d], generator=g)[:ishape[d]] for _ in range(cols)], -1)
        index = perms.reshape(ishape[d], *[s for k, s in enumerate(ishape) if k != d]).movedim(0, d)
        index = index.contiguous()
    else:
        ishape[d] = rng.choice((1, 2, 4, 6))
        index = randint(rng, 0, shape[d], *ishape)
    sshape = [s + (1 if rng.random() < 0.2 else 0) for s in ishape]
    return x, d, index, rand_tensor(rng, sshape)


def _gen_scatter(rng: random.Random) -> Call:
    x, d, index, src = _scatter_parts(rng, unique=True)
    if rng.random() < 0.4:
        kw: dict[str, Any] = {"value": rng.uniform(-1, 1)}
        if rng.random() < 0.5:  # ``reduce`` is deprecated with a tensor ``src``, not with a value
            kw["reduce"] = rng.choice(("add", "multiply"))
        return (x, d, index), kw
    return (x, d, index, src), {}


def _gen_scatter_add(rng: random.Random) -> Call:
    x, d, index, src = _scatter_parts(rng, unique=False)
    if rng.random() < 0.3:  # the MoE pattern: 1-d counts
        n = rng.choice((4, 8))
        idx = randint(rng, 0, n, rng.choice((6, 12)))
        return (torch.zeros(n), 0, idx, randn(rng, idx.shape[0])), {}
    return (x, d, index, src), {}


def _gen_scatter_reduce(rng: random.Random) -> Call:
    x, d, index, src = _scatter_parts(rng, unique=False)
    kw = {"include_self": rng.random() < 0.5}
    return (x, d, index, src, rng.choice(("sum", "amax", "amin"))), kw


def _gen_index_select(rng: random.Random) -> Call:
    x = rand_tensor(rng, small_shape(rng, 1, 3))
    d = rng.randrange(x.dim())
    index = randint(rng, 0, x.shape[d], *rng.choice(((), (rng.choice((1, 2, 4, 6)),))))
    return (x, d - x.dim() if rng.random() < 0.3 else d, index), {}


def _index_rows(rng: random.Random, *, unique: bool) -> Call:
    x = rand_tensor(rng, small_shape(rng, 1, 3))
    d = rng.randrange(x.dim())
    if unique:
        n = rng.randint(1, x.shape[d])
        index = torch.randperm(x.shape[d], generator=torch.Generator().manual_seed(rng.getrandbits(32)))[:n]
    else:
        n = rng.choice((1, 2, 4))
        index = randint(rng, 0, x.shape[d], n)
    sshape = list(x.shape)
    sshape[d] = n
    return (x, d - x.dim() if rng.random() < 0.3 else d, index, rand_tensor(rng, sshape)), {}


def _gen_index_add(rng: random.Random) -> Call:
    args, kw = _index_rows(rng, unique=False)
    if rng.random() < 0.3:
        kw["alpha"] = 0.5
    return args, kw


def _gen_index_copy(rng: random.Random) -> Call:
    return _index_rows(rng, unique=True)


def _gen_index_fill(rng: random.Random) -> Call:
    (x, d, index, _), _ = _index_rows(rng, unique=False)
    return (x, d, index, rng.uniform(-1, 1)), {}


def register(registry: OpRegistry) -> None:
    """Register the scatter and index_* ops."""
    T = torch.Tensor
    reg = registry.register

    reg(torch.scatter, _scatter_anno, name="torch.scatter", aliases=(T.scatter,), input_gen_fn=_gen_scatter)
    reg(T.scatter_, _scatter_anno, name="torch.Tensor.scatter_", input_gen_fn=_gen_scatter)
    reg(torch.scatter_add, _scatter_add_anno, name="torch.scatter_add", aliases=(T.scatter_add,),
        input_gen_fn=_gen_scatter_add)
    reg(T.scatter_add_, _scatter_add_anno, name="torch.Tensor.scatter_add_", input_gen_fn=_gen_scatter_add)
    reg(torch.scatter_reduce, _scatter_reduce_anno, name="torch.scatter_reduce", aliases=(T.scatter_reduce,),
        input_gen_fn=_gen_scatter_reduce)
    reg(T.scatter_reduce_, _scatter_reduce_anno, name="torch.Tensor.scatter_reduce_",
        input_gen_fn=_gen_scatter_reduce)
    reg(torch.index_select, _index_select_anno, name="torch.index_select", aliases=(T.index_select,),
        input_gen_fn=_gen_index_select)
    reg(torch.index_add, _index_add_anno, name="torch.index_add", aliases=(T.index_add,),
        input_gen_fn=_gen_index_add)
    reg(T.index_add_, _index_add_anno, name="torch.Tensor.index_add_", input_gen_fn=_gen_index_add)
    reg(torch.index_copy, _index_copy_anno, name="torch.index_copy", aliases=(T.index_copy,),
        input_gen_fn=_gen_index_copy)
    reg(T.index_copy_, _index_copy_anno, name="torch.Tensor.index_copy_", input_gen_fn=_gen_index_copy)
    reg(torch.index_fill, _index_fill_anno, name="torch.index_fill", aliases=(T.index_fill,),
        input_gen_fn=_gen_index_fill)
    reg(T.index_fill_, _index_fill_anno, name="torch.Tensor.index_fill_", input_gen_fn=_gen_index_fill)
