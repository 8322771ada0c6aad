"""split / chunk / unbind / tensor_split: the split dim is ``^`` and each output's size
along it is a number; the other dims keep their identifiers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from nnscaler.ops.builtin._common import (
    idents,
    is_tensor,
    join_anno,
    norm_dim,
    rand_shape,
)
from nnscaler.ops.builtin.shape.common import (
    rand_dim,
    rand_ndim,
    rand_tensor,
)
from nnscaler.ops.registry import OpRegistry


def _pieces(input: torch.Tensor, dim: int, sizes: Sequence[int], keep: bool = True) -> str:
    """Input split along ``dim`` into pieces of ``sizes`` (dim dropped when not ``keep``)."""
    n = input.dim()
    d = norm_dim(dim, n)
    names = idents(n)
    ins = list(names)
    ins[d] += "^"
    outs = []
    for s in sizes:
        dims = list(names)
        if keep:
            dims[d] = str(s)
        else:
            del dims[d]
        outs.append(dims)
    return join_anno([ins], outs)


def _split_sizes(length: int, split: Any) -> list[int]:
    if isinstance(split, (list, tuple, torch.Size)):
        return [int(s) for s in split]
    step = int(split)
    if length == 0:
        return [0]
    return [min(step, length - start) for start in range(0, length, step)]


def _split_fn_anno(tensor: torch.Tensor, split_size_or_sections: Any, dim: int = 0) -> str:
    d = norm_dim(dim, tensor.dim())
    return _pieces(tensor, d, _split_sizes(tensor.shape[d], split_size_or_sections))


def _split_method_anno(self: torch.Tensor, split_size: Any, dim: int = 0) -> str:
    return _split_fn_anno(self, split_size, dim)


def _chunk_anno(input: torch.Tensor, chunks: int, dim: int = 0) -> str:
    d = norm_dim(dim, input.dim())
    length = input.shape[d]
    step = -(-length // int(chunks)) if length else 0
    sizes = _split_sizes(length, step) if step else [0] * int(chunks)
    return _pieces(input, d, sizes)


def _unbind_anno(input: torch.Tensor, dim: int = 0) -> str:
    d = norm_dim(dim, input.dim())
    return _pieces(input, d, [1] * input.shape[d], keep=False)


def _tensor_split_anno(input: torch.Tensor, indices_or_sections: Any, dim: int = 0) -> str:
    d = norm_dim(dim, input.dim())
    length = input.shape[d]
    ios = indices_or_sections
    if is_tensor(ios):
        ios = int(ios) if ios.dim() == 0 else [int(v) for v in ios.tolist()]
    if isinstance(ios, int):
        q, r = divmod(length, ios)
        sizes = [q + 1] * r + [q] * (ios - r)
    else:
        bounds = [0] + [min(max(int(i) if i >= 0 else int(i) + length, 0), length) for i in ios] + [length]
        sizes = [max(b - a, 0) for a, b in zip(bounds, bounds[1:], strict=False)]
    return _pieces(input, d, sizes)


def _gen_split_fn(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 3)
    d = rng.randrange(x.dim())
    length = x.shape[d]
    if rng.random() < 0.5:
        arg: Any = rng.randint(1, length)
    else:
        cuts = sorted(rng.sample(range(1, length + 1), rng.randint(0, min(2, length - 1))) + [length])
        arg = [b - a for a, b in zip([0] + cuts, cuts, strict=False) if b > a]
    dim = d - x.dim() if rng.random() < 0.3 else d
    return (x, arg), {"dim": dim}


def _gen_split_method(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (x, arg), kw = _gen_split_fn(rng)
    return (x, arg, kw["dim"]), {}


def _gen_chunk(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 3)
    d = rng.randrange(x.dim())
    chunks = rng.randint(1, x.shape[d] + 1)
    if rng.random() < 0.5:
        return (x, chunks), {"dim": d - x.dim() if rng.random() < 0.5 else d}
    return (x, chunks, d), {}


def _gen_unbind(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_tensor(rng, rand_shape(rng, 1, 3, sizes=(1, 2, 3, 4)))
    return (x, rand_dim(rng, x.dim())), {}


def _gen_tensor_split(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 3)
    d = rng.randrange(x.dim())
    if rng.random() < 0.5:
        ios: Any = rng.randint(1, x.shape[d] + 1)
    else:
        ios = sorted(rng.randint(0, x.shape[d]) for _ in range(rng.randint(1, 3)))
    return (x, ios), {"dim": d}


def register(registry: OpRegistry) -> None:
    """Register the split, chunk, unbind and tensor_split ops."""
    T = torch.Tensor
    reg = registry.register

    reg(torch.split, _split_fn_anno, name="torch.split", input_gen_fn=_gen_split_fn)
    reg(T.split, _split_method_anno, name="torch.Tensor.split", input_gen_fn=_gen_split_method)
    reg(torch.chunk, _chunk_anno, name="torch.chunk", aliases=(T.chunk,), input_gen_fn=_gen_chunk)
    reg(torch.unbind, _unbind_anno, name="torch.unbind", aliases=(T.unbind,), input_gen_fn=_gen_unbind)
    reg(torch.tensor_split, _tensor_split_anno, name="torch.tensor_split", aliases=(T.tensor_split,),
        input_gen_fn=_gen_tensor_split)
