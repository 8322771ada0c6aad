"""view / reshape / flatten / unflatten.

view and reshape relate input and output dims segment by segment: walking both shapes
(size-1 dims left out: they are the number ``1`` on either side) gives the shortest runs of
input dims and output dims with equal products. A run of one input dim and one output dim
keeps its identifier. In a longer run only the *leading* dims can be split, and only by
the divisors of ``g = gcd(first input dim, first output dim)``: the leading input dim is
``(a n)`` with ``n`` its size over ``g`` (or just ``a`` when ``g`` is its size), the
leading output dim likewise; the other input dims of the run are ``^`` and the other
output dims are numbers. ``x.view(b, s, 8, 64)`` on ``(b, s, 512)`` gives
``a b (c 64) -> a b c 64`` (``c``, the heads, may be split), a merge gives
``a b c d^ -> a b (c 64)``, and a view that reshuffles ``(6, 4) -> (4, 6)`` gives
``(a 3) b^ -> (a 2) 6``. Size arguments are rewritten per part by ``update_kwargs``
(the split output dim is divided by the number of parts; ``-1`` stays ``-1``).
"""

from __future__ import annotations

import math
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
    divide_at,
    out_split_dim,
    rand_tensor,
    rewrap_seq,
    sizes_arg,
    small_shape,
    update_shape_seq,
    update_sizes,
)
from nnscaler.ops.registry import OpRegistry


def _infer_shape(numel: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """``sizes`` with its one ``-1`` resolved for ``numel`` elements."""
    sizes = [int(s) for s in sizes]
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = numel // known if known else 0
    return tuple(sizes)


def reshape_dims(
    in_shape: Sequence[int], out_shape: Sequence[int], names: Sequence[str] | None = None
) -> tuple[list[str], list[str]]:
    """The dim annotations of a row-major reshape from ``in_shape`` to ``out_shape``.

    See the module docstring. ``names`` are the input identifiers (default a, b, c, ...).
    """
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    names = list(names) if names is not None else idents(len(in_shape))
    ins: list[str] = [f"{n}^" for n in names]
    outs: list[str] = [str(s) for s in out_shape]
    if math.prod(in_shape) != math.prod(out_shape) or 0 in in_shape or 0 in out_shape:
        return ins, outs
    for k, s in enumerate(in_shape):
        if s == 1:
            ins[k] = "1"
    nz_in = [(k, s) for k, s in enumerate(in_shape) if s != 1]
    nz_out = [(k, s) for k, s in enumerate(out_shape) if s != 1]
    i = j = 0
    while i < len(nz_in) and j < len(nz_out):
        seg_in, seg_out = [nz_in[i]], [nz_out[j]]
        p_in, p_out = nz_in[i][1], nz_out[j][1]
        i, j = i + 1, j + 1
        while p_in != p_out:
            if p_in < p_out:
                seg_in.append(nz_in[i])
                p_in *= nz_in[i][1]
                i += 1
            else:
                seg_out.append(nz_out[j])
                p_out *= nz_out[j][1]
                j += 1
        (k0, s0), (o0, t0) = seg_in[0], seg_out[0]
        name = names[k0]
        if len(seg_in) == 1 and len(seg_out) == 1:
            ins[k0], outs[o0] = name, name
            continue
        g = math.gcd(s0, t0)
        if g == 1:
            continue  # nothing lines up: the run keeps its '^' and numbers
        ins[k0] = name if g == s0 else f"({name} {s0 // g})"
        outs[o0] = name if g == t0 else f"({name} {t0 // g})"
    return ins, outs


def _reshape_to(x: torch.Tensor, sizes: Sequence[int]) -> str:
    out_shape = _infer_shape(x.numel(), sizes)
    ins, outs = reshape_dims(shape_of(x), out_shape)
    return join_anno([ins], [outs])


def _view_anno(self: torch.Tensor, *size: Any) -> str:
    sizes = sizes_arg(size)
    if len(sizes) == 1 and isinstance(sizes[0], torch.dtype):  # x.view(torch.int32)
        old, new = self.element_size(), sizes[0].itemsize
        names = idents(self.dim())
        if old == new or self.dim() == 0:
            return join_anno([names], [names])
        last = self.shape[-1] * old // new
        return join_anno([names[:-1] + [names[-1] + "^"]], [names[:-1] + [str(last)]])
    return _reshape_to(self, sizes)


def _reshape_method_anno(self: torch.Tensor, *shape: Any) -> str:
    return _reshape_to(self, sizes_arg(shape))


def _reshape_fn_anno(input: torch.Tensor, shape: Sequence[int]) -> str:
    return _reshape_to(input, tuple(shape))


def _as_anno(self: torch.Tensor, other: torch.Tensor) -> str:
    ins, outs = reshape_dims(shape_of(self), shape_of(other))
    return join_anno([ins, outs], [outs])


def _flatten_anno(input: torch.Tensor, start_dim: int = 0, end_dim: int = -1) -> str:
    shape = shape_of(input)
    if not shape:
        return join_anno([[]], [["1"]])
    s, e = norm_dim(start_dim, len(shape)), norm_dim(end_dim, len(shape))
    out = shape[:s] + (math.prod(shape[s:e + 1]),) + shape[e + 1:]
    return join_anno(*([d] for d in reshape_dims(shape, out)))


def _ravel_anno(input: torch.Tensor) -> str:
    return _flatten_anno(input)


def _unflatten_shape(shape: tuple[int, ...], dim: int, sizes: Sequence[int]) -> tuple[int, ...]:
    d = norm_dim(dim, len(shape))
    inner = _infer_shape(shape[d], sizes)
    return shape[:d] + inner + shape[d + 1:]


_UNFLAT = "unflat"


def _unflatten_anno(input: torch.Tensor, dim: int, sizes: Sequence[int]) -> str:
    shape = shape_of(input)
    out = _unflatten_shape(shape, dim, sizes)
    names = idents(len(shape))
    if shape:
        names[norm_dim(dim, len(shape))] = _UNFLAT
    return join_anno(*([d] for d in reshape_dims(shape, out, names)))


def _unflatten_method_anno(self: torch.Tensor, dim: int, sizes: Sequence[int]) -> str:
    return _unflatten_anno(self, dim, sizes)


def _update_unflatten(kwargs: dict[str, Any], transform: Any, part: int) -> dict[str, Any]:
    """Splitting the unflattened dim (input dim ``q``) splits output dim ``p``: ``sizes[p - q]``."""
    pos = out_split_dim(transform)
    if transform.ident != _UNFLAT or "sizes" not in kwargs or pos is None:
        return kwargs
    sizes = tuple(kwargs["sizes"])
    kwargs["sizes"] = rewrap_seq(kwargs["sizes"], divide_at(sizes, pos - transform.dim, transform.num))
    return kwargs


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def _random_reshape(rng: random.Random, shape: Sequence[int]) -> list[int]:
    """A random target shape with the same number of elements (merges, splits, shuffles)."""
    factors = [f for s in shape for f in _prime_factors(s)]
    if rng.random() < 0.2:
        rng.shuffle(factors)
    out: list[int] = []
    k = 0
    while k < len(factors):
        take = rng.randint(1, 3)
        out.append(math.prod(factors[k:k + take]))
        k += take
    if rng.random() < 0.3:
        out.insert(rng.randint(0, len(out)), 1)
    if not out:
        out = [1]
    if rng.random() < 0.4:
        out[rng.randrange(len(out))] = -1
    return out


def _gen_view(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_tensor(rng, small_shape(rng, 1, 4))
    if rng.random() < 0.1:
        return (x, torch.int32 if rng.random() < 0.5 else torch.float32), {}
    target = _random_reshape(rng, x.shape)
    if rng.random() < 0.3:
        return (x, tuple(target)), {}
    return (x, *target), {}


def _gen_reshape_method(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_tensor(rng, small_shape(rng, 1, 4))
    if rng.random() < 0.3:
        x = x.transpose(0, -1)  # reshape copes with non-contiguous tensors
    target = _random_reshape(rng, x.shape)
    if rng.random() < 0.3:
        return (x, torch.Size(target) if -1 not in target else tuple(target)), {}
    return (x, *target), {}


def _gen_reshape_fn(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_tensor(rng, small_shape(rng, 1, 4))
    target = _random_reshape(rng, x.shape)
    if rng.random() < 0.5:
        return (x,), {"shape": target}
    return (x, tuple(target)), {}


def _gen_as(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_tensor(rng, small_shape(rng, 1, 4))
    target = _infer_shape(x.numel(), _random_reshape(rng, x.shape))
    return (x, rand_tensor(rng, target)), {}


def _gen_flatten(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_tensor(rng, small_shape(rng, 0 if rng.random() < 0.1 else 1, 4))
    n = max(x.dim(), 1)
    kw: dict[str, Any] = {}
    if rng.random() < 0.7:
        s = rng.randrange(n)
        e = rng.randrange(s, n)
        kw["start_dim"] = s - n if rng.random() < 0.3 else s
        kw["end_dim"] = e - n if rng.random() < 0.5 else e
    return (x,), kw


def _gen_ravel(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (rand_tensor(rng, small_shape(rng, 1, 4)),), {}


def _gen_unflatten(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    shape = small_shape(rng, 1, 3)
    x = rand_tensor(rng, shape)
    d = rng.randrange(len(shape))
    sizes = [s for s in _random_reshape(rng, [shape[d]])]
    dim = d - len(shape) if rng.random() < 0.3 else d
    return (x, dim, tuple(sizes) if rng.random() < 0.5 else sizes), {}


def register(registry: OpRegistry) -> None:
    """Register the view, reshape, flatten and unflatten ops."""
    T = torch.Tensor
    reg = registry.register

    reg(T.view, _view_anno, name="torch.Tensor.view", input_gen_fn=_gen_view,
        update_kwargs=update_sizes("size"))
    reg(T.reshape, _reshape_method_anno, name="torch.Tensor.reshape", input_gen_fn=_gen_reshape_method,
        update_kwargs=update_sizes("shape"))
    reg(torch.reshape, _reshape_fn_anno, name="torch.reshape", input_gen_fn=_gen_reshape_fn,
        update_kwargs=update_shape_seq("shape"))
    reg(T.view_as, _as_anno, name="torch.Tensor.view_as", input_gen_fn=_gen_as)
    reg(T.reshape_as, _as_anno, name="torch.Tensor.reshape_as", input_gen_fn=_gen_as)
    reg(torch.flatten, _flatten_anno, name="torch.flatten", aliases=(T.flatten,), input_gen_fn=_gen_flatten)
    reg(torch.ravel, _ravel_anno, name="torch.ravel", aliases=(T.ravel,), input_gen_fn=_gen_ravel)
    reg(torch.unflatten, _unflatten_anno, name="torch.unflatten", input_gen_fn=_gen_unflatten,
        update_kwargs=_update_unflatten)
    reg(T.unflatten, _unflatten_method_anno, name="torch.Tensor.unflatten", input_gen_fn=_gen_unflatten,
        update_kwargs=_update_unflatten)
