"""expand / broadcast_to / repeat / tile / repeat_interleave: expanded and repeated
dims are numbers in the output and ``^`` in the input they come from.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch

from nnscaler.ops.builtin._common import (
    idents,
    is_tensor,
    join_anno,
    norm_dim,
    shape_of,
)
from nnscaler.ops.builtin.shape.common import (
    out_split_dim,
    rand_dim,
    rand_ndim,
    rand_tensor,
    shape_with_ones,
    sizes_arg,
    update_shape_seq,
    update_sizes,
)
from nnscaler.ops.registry import OpRegistry


def _expand_to(input: torch.Tensor, sizes: Sequence[int]) -> str:
    shape = shape_of(input)
    names = idents(len(shape))
    lead = len(sizes) - len(shape)
    ins, outs = list(names), [str(int(s)) for s in sizes[:lead]]
    for k, (s, t) in enumerate(zip(shape, sizes[lead:], strict=True)):
        t = int(t)
        if t == -1 or t == s:
            outs.append(names[k])
        else:  # s == 1 expanded to t
            ins[k] = "1"
            outs.append(str(t))
    return join_anno([ins], [outs])


def _expand_anno(self: torch.Tensor, *sizes: Any) -> str:
    return _expand_to(self, sizes_arg(sizes))


def _broadcast_to_anno(input: torch.Tensor, size: Sequence[int]) -> str:
    return _expand_to(input, tuple(size))


def _expand_as_anno(self: torch.Tensor, other: torch.Tensor) -> str:
    shape, target = shape_of(self), shape_of(other)
    names = idents(len(target))
    lead = len(target) - len(shape)
    ins = [names[lead + k] if s == target[lead + k] else "1" for k, s in enumerate(shape)]
    return join_anno([ins, names], [names])


def _repeat_to(input: torch.Tensor, reps: Sequence[int]) -> str:
    shape = shape_of(input)
    reps = [int(r) for r in reps]
    if len(reps) < len(shape):  # tile pads the repeats with ones
        reps = [1] * (len(shape) - len(reps)) + reps
    names = idents(len(shape))
    lead = len(reps) - len(shape)
    ins, outs = list(names), [str(r) for r in reps[:lead]]
    for k, (s, r) in enumerate(zip(shape, reps[lead:], strict=True)):
        if r == 1:
            outs.append(names[k])
        else:
            ins[k] = names[k] + "^"
            outs.append(str(s * r))
    return join_anno([ins], [outs])


def _repeat_anno(self: torch.Tensor, *sizes: Any) -> str:
    return _repeat_to(self, sizes_arg(sizes))


def _tile_fn_anno(input: torch.Tensor, dims: Sequence[int]) -> str:
    return _repeat_to(input, tuple(dims))


def _tile_method_anno(self: torch.Tensor, *dims: Any) -> str:
    return _repeat_to(self, sizes_arg(dims))


_REPEATED = "rep"


def _repeat_interleave_anno(
    input: torch.Tensor, repeats: Any = None, dim: int | None = None, *, output_size: int | None = None
) -> str:
    shape = shape_of(input)
    names = idents(len(shape))
    if repeats is None:  # torch.repeat_interleave(repeats): indices repeated
        total = int(input.sum()) if input.numel() else 0
        return join_anno([[n + "^" for n in names]], [[str(total)]])
    r: int | None = None
    if is_tensor(repeats):
        if repeats.numel() == 1 and repeats.device.type != "meta":
            r = int(repeats.reshape(()))
        total = int(output_size) if output_size is not None else int(repeats.sum())
    else:
        r = int(repeats)
    if dim is None:
        numel = math.prod(shape)
        if r is None:
            return join_anno([[n + "^" for n in names], "?"], [[str(total)]])
        if not shape or r == 0:
            return join_anno([[n + "^" for n in names], "?"], [[str(numel * r)]])
        ins = [names[0]] + [n + "^" for n in names[1:]]
        members = [names[0]] + [n + "^" for n in names[1:]] + ([str(r)] if r != 1 else [])
        out = members[0] if len(members) == 1 else f"({' '.join(members)})"
        return join_anno([ins, "?"], [[out]])
    d = norm_dim(dim, len(shape))
    names[d] = _REPEATED
    ins, outs = list(names), list(names)
    if r is None:
        ins[d] += "^"
        outs[d] = str(total)
    elif r == 0:
        ins[d] += "^"
        outs[d] = "0"
    elif r != 1:
        outs[d] = f"({names[d]} {r})"
    return join_anno([ins, "?"], [outs])


def _update_output_size(kwargs: dict[str, Any], transform: Any, part: int) -> dict[str, Any]:
    """``output_size`` is the size of the repeated dim (of the output without ``dim``)."""
    if kwargs.get("output_size") is None or out_split_dim(transform) is None:
        return kwargs
    if kwargs.get("dim") is None or transform.ident == _REPEATED:
        kwargs["output_size"] = int(kwargs["output_size"]) // transform.num
    return kwargs


def _expand_target(rng: random.Random, shape: Sequence[int]) -> list[int]:
    target = [rng.choice((1, 2, 3)) for _ in range(rng.randint(0, 2))]
    for s in shape:
        if s == 1 and rng.random() < 0.7:
            target.append(rng.choice((2, 3, 4)))
        else:
            target.append(-1 if rng.random() < 0.4 else s)
    return target


def _gen_expand(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_tensor(rng, shape_with_ones(rng))
    target = _expand_target(rng, x.shape)
    return ((x, tuple(target)) if rng.random() < 0.3 else (x, *target)), {}


def _gen_broadcast_to(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_tensor(rng, shape_with_ones(rng))
    return (x, tuple(_expand_target(rng, x.shape))), {}


def _gen_expand_as(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_tensor(rng, shape_with_ones(rng))
    out = [rng.choice((2, 3)) for _ in range(rng.randint(0, 2))]
    out += [rng.choice((2, 4)) if s == 1 and rng.random() < 0.7 else s for s in x.shape]
    return (x, rand_tensor(rng, out)), {}


def _gen_repeat(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 3)
    reps = [rng.choice((1, 2)) for _ in range(rng.randint(0, 1))]
    reps += [1 if rng.random() < 0.6 else rng.choice((2, 3)) for _ in range(x.dim())]
    return ((x, tuple(reps)) if rng.random() < 0.3 else (x, *reps)), {}


def _gen_tile_fn(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 3)
    reps = [1 if rng.random() < 0.6 else rng.choice((2, 3)) for _ in range(rng.randint(1, x.dim() + 1))]
    return (x, tuple(reps)), {}


def _gen_tile_method(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (x, reps), _ = _gen_tile_fn(rng)
    return (x, *reps), {}


def _gen_repeat_interleave(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 1, 3)
    kind = rng.random()
    kw: dict[str, Any] = {}
    if kind < 0.5:
        reps: Any = rng.choice((1, 2, 3))
        if rng.random() < 0.3:
            reps = torch.tensor(reps)
    else:
        d = rng.randrange(x.dim())
        reps = torch.randint(0, 3, (x.shape[d],), generator=torch.Generator().manual_seed(rng.getrandbits(32)))
        kw["dim"] = d
    if "dim" not in kw and rng.random() < 0.7:
        kw["dim"] = rand_dim(rng, x.dim())
    if isinstance(reps, int) and rng.random() < 0.3:
        kw["output_size"] = (x.shape[kw["dim"]] if "dim" in kw else x.numel()) * reps
    return (x, reps), kw


def register(registry: OpRegistry) -> None:
    """Register the expand, broadcast_to, repeat, tile and repeat_interleave ops."""
    T = torch.Tensor
    reg = registry.register

    reg(T.expand, _expand_anno, name="torch.Tensor.expand", input_gen_fn=_gen_expand,
        update_kwargs=update_sizes("sizes"))
    reg(torch.broadcast_to, _broadcast_to_anno, name="torch.broadcast_to", aliases=(T.broadcast_to,),
        input_gen_fn=_gen_broadcast_to, update_kwargs=update_shape_seq("size"))
    reg(T.expand_as, _expand_as_anno, name="torch.Tensor.expand_as", input_gen_fn=_gen_expand_as)
    reg(T.repeat, _repeat_anno, name="torch.Tensor.repeat", input_gen_fn=_gen_repeat)
    reg(torch.tile, _tile_fn_anno, name="torch.tile", input_gen_fn=_gen_tile_fn)
    reg(T.tile, _tile_method_anno, name="torch.Tensor.tile", input_gen_fn=_gen_tile_method)
    reg(torch.repeat_interleave, _repeat_interleave_anno, name="torch.repeat_interleave",
        aliases=(T.repeat_interleave,), input_gen_fn=_gen_repeat_interleave,
        update_kwargs=_update_output_size)
