"""Helpers shared by the shape sub-families: size arguments, per-part size rewrites
and the random inputs of the promise tests.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nnscaler.anno import Split
from nnscaler.ops.builtin._common import (
    SPLITTABLE_SIZES,
    rand_shape,
    randn,
)


def sizes_arg(size: Sequence[Any]) -> tuple[Any, ...]:
    """A var-positional size argument (``view(2, 3)`` or ``view((2, 3))``) as one tuple."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        return tuple(size[0])
    return tuple(size)


def dims_arg(dims: Any) -> tuple[int, ...]:
    """An int-or-sequence dims argument as a tuple."""
    if dims is None:
        return ()
    if isinstance(dims, (tuple, list, torch.Size)):
        return tuple(int(d) for d in dims)
    return (int(dims),)


def out_split_dim(transform: Any, k: int = 0) -> int | None:
    layouts = transform.outputs
    layout = layouts[k] if k < len(layouts) else None
    return layout.dim if isinstance(layout, Split) else None


def divide_at(sizes: Sequence[Any], pos: int, num: int) -> list[Any]:
    """``sizes`` with entry ``pos`` divided by ``num`` (``-1`` stays ``-1``)."""
    out = list(sizes)
    if 0 <= pos < len(out) and int(out[pos]) != -1:
        out[pos] = int(out[pos]) // num
    return out


def rewrap(original: Sequence[Any], values: list[Any]) -> tuple[Any, ...]:
    """``values`` in the structure of a var-positional ``original`` (flat or one sequence)."""
    if len(original) == 1 and isinstance(original[0], (tuple, list, torch.Size)):
        inner = original[0]
        return (list(values),) if isinstance(inner, list) else (tuple(values),)
    return tuple(values)


def rewrap_seq(original: Any, values: list[Any]) -> Any:
    if isinstance(original, list):
        return list(values)
    return tuple(values)


def update_sizes(param: str) -> Callable[..., dict[str, Any]]:
    """``update_kwargs`` for an op whose var-positional ``param`` is the output shape."""

    def update(kwargs: dict[str, Any], transform: Any, part: int) -> dict[str, Any]:
        pos = out_split_dim(transform)
        if pos is None or param not in kwargs:
            return kwargs
        original = tuple(kwargs[param])
        sizes = sizes_arg(original)
        if any(isinstance(s, torch.dtype) for s in sizes):
            return kwargs
        kwargs[param] = rewrap(original, divide_at(sizes, pos, transform.num))
        return kwargs

    return update


def update_shape_seq(param: str) -> Callable[..., dict[str, Any]]:
    """``update_kwargs`` for an op whose plain sequence argument ``param`` is the output shape."""

    def update(kwargs: dict[str, Any], transform: Any, part: int) -> dict[str, Any]:
        pos = out_split_dim(transform)
        if pos is None or param not in kwargs:
            return kwargs
        original = kwargs[param]
        kwargs[param] = rewrap_seq(original, divide_at(tuple(original), pos, transform.num))
        return kwargs

    return update


def rand_tensor(rng: random.Random, shape: Sequence[int]) -> torch.Tensor:
    if not shape:
        return randn(rng, 1).reshape(())
    return randn(rng, *shape)


def small_shape(rng: random.Random, lo: int = 1, hi: int = 4) -> tuple[int, ...]:
    shape = list(rand_shape(rng, lo, hi, sizes=SPLITTABLE_SIZES + (1, 3)))
    while math.prod(shape) > 1000:  # small tensors keep the promise test fast
        k = shape.index(max(shape))
        shape[k] = rng.choice((2, 4, 6))
    return tuple(shape)


def rand_ndim(rng: random.Random, lo: int = 1, hi: int = 4) -> torch.Tensor:
    return rand_tensor(rng, small_shape(rng, lo, hi))


def rand_dim(rng: random.Random, n: int) -> int:
    d = rng.randrange(n)
    return d - n if rng.random() < 0.3 else d


def gen_upto_2d(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (rand_ndim(rng, 1, 2),), {}


def gen_2d(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (rand_ndim(rng, 2, 2),), {}


def shape_with_ones(rng: random.Random) -> tuple[int, ...]:
    return tuple(1 if rng.random() < 0.4 else s for s in small_shape(rng, 1, 3))
