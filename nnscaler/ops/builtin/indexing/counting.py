"""histc / bincount / searchsorted / bucketize / nonzero / argwhere. ``histc`` with fixed
bounds counts parts that add up (its input dims are ``+``); an output whose size depends on
the data (bincount's length, the number of nonzero elements) is a number and the input
dims are ``^``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from nnscaler.ops.builtin._common import (
    idents,
    is_tensor,
    join_anno,
    randbool,
    randint,
    randn,
)
from nnscaler.ops.builtin.indexing.common import (
    Call,
    frozen_dims,
    rand_tensor,
    small_shape,
)
from nnscaler.ops.registry import OpRegistry


def _histc_anno(input: torch.Tensor, bins: int = 100, min: Any = 0, max: Any = 0) -> str:
    names = idents(input.dim())
    # fixed bounds: the counts of the parts add up; bounds 0, 0 mean "the data's range",
    # which differs between parts
    mark = "+" if float(min) != float(max) else "^"
    return join_anno([[n + mark for n in names]], [[str(int(bins))]])


def _bincount_anno(input: torch.Tensor, weights: Any = None, minlength: int = 0) -> str:
    # the output length is max(input) + 1: it depends on the data of each part
    length = max(int(input.max()) + 1 if input.numel() else 0, int(minlength))
    if is_tensor(weights):
        return join_anno(["a^", "a^"], [[str(length)]])
    return join_anno(["a^"], [[str(length)]])


def _searchsorted_anno(
    sorted_sequence: torch.Tensor, input: Any, *, out_int32: bool = False, right: bool = False,
    side: str | None = None, sorter: Any = None,
) -> str:
    s = sorted_sequence.dim()
    if not is_tensor(input):
        return join_anno([frozen_dims(idents(s)), "?"], ["1"])
    n = input.dim()
    names = idents(n + 1)
    mine, last = names[:n], names[n] + "^"
    if s == 1:
        return join_anno([[last], mine], [mine])
    lead = mine[:-1]
    if is_tensor(sorter):
        lead = frozen_dims(lead)  # the sorter is taken whole
    inp = lead + [mine[-1]]
    return join_anno([lead + [last], inp], [inp])


def _bucketize_anno(input: Any, boundaries: torch.Tensor, *, out_int32: bool = False, right: bool = False) -> str:
    if not is_tensor(input):
        return join_anno(["?", "z^"], ["1"])
    names = idents(input.dim())
    return join_anno([names or "1", "z^"], [names or "1"])


def _nonzero_anno(input: torch.Tensor, *, out: Any = None, as_tuple: bool = False) -> str:
    nnz = int(input.count_nonzero())
    dims = frozen_dims(idents(input.dim())) or "1"
    if as_tuple:
        return join_anno([dims], [[str(nnz)]] * max(input.dim(), 1))
    return join_anno([dims], [[str(nnz), str(input.dim())]])


def _argwhere_anno(input: torch.Tensor) -> str:
    return _nonzero_anno(input)


def _gen_histc(rng: random.Random) -> Call:
    shape = small_shape(rng, 1, 3)
    bins = rng.choice((3, 4, 8))
    if rng.random() < 0.6:  # the MoE pattern: expert ids counted in fixed bins
        x = randint(rng, 0, bins, *shape).float()
        return (x,), {"bins": bins, "min": 0, "max": bins - rng.choice((0, 1))}
    x = rand_tensor(rng, shape)
    if rng.random() < 0.3:
        return (x, bins), {}
    return (x, bins, -1.0, 1.0), {}


def _gen_bincount(rng: random.Random) -> Call:
    x = randint(rng, 0, 6, rng.choice((4, 6, 8)))
    kw: dict[str, Any] = {}
    if rng.random() < 0.5:
        kw["minlength"] = rng.randint(0, 8)
    if rng.random() < 0.5:
        return (x, randn(rng, x.shape[0], dtype=torch.float64)), kw
    return (x,), kw


def _sorted(rng: random.Random, *shape: int) -> torch.Tensor:
    return randn(rng, *shape).sort(-1).values


def _gen_searchsorted(rng: random.Random) -> Call:
    kw: dict[str, Any] = {}
    if rng.random() < 0.3:
        kw["right"] = True
    if rng.random() < 0.5:
        seq = _sorted(rng, rng.choice((3, 5)))
        if rng.random() < 0.15:
            return (seq, rng.uniform(-2, 2)), kw
        return (seq, rand_tensor(rng, small_shape(rng, 1, 3))), kw
    lead = small_shape(rng, 1, 2)
    seq = _sorted(rng, *lead, rng.choice((3, 5)))
    if rng.random() < 0.3:
        shuffled = randn(rng, *seq.shape)
        kw["sorter"] = shuffled.argsort(-1)
        seq = shuffled
    return (seq, rand_tensor(rng, (*lead, rng.choice((2, 4, 6))))), kw


def _gen_bucketize(rng: random.Random) -> Call:
    b = _sorted(rng, rng.choice((3, 5)))
    if rng.random() < 0.1:
        return (rng.uniform(-2, 2), b), {}
    return (rand_tensor(rng, small_shape(rng, 1, 3)), b), {"right": rng.random() < 0.5}


def _gen_nonzero(rng: random.Random) -> Call:
    x = randbool(rng, *small_shape(rng, 1, 3)).float()
    return (x,), ({"as_tuple": True} if rng.random() < 0.4 else {})


def _gen_argwhere(rng: random.Random) -> Call:
    return (randbool(rng, *small_shape(rng, 1, 3)).float(),), {}


def register(registry: OpRegistry) -> None:
    """Register the histc, bincount, searchsorted, bucketize, nonzero and argwhere ops."""
    T = torch.Tensor
    reg = registry.register

    reg(torch.histc, _histc_anno, name="torch.histc", aliases=(T.histc,), input_gen_fn=_gen_histc)
    reg(torch.bincount, _bincount_anno, name="torch.bincount", aliases=(T.bincount,),
        input_gen_fn=_gen_bincount)
    reg(torch.searchsorted, _searchsorted_anno, name="torch.searchsorted", input_gen_fn=_gen_searchsorted)
    reg(torch.bucketize, _bucketize_anno, name="torch.bucketize", input_gen_fn=_gen_bucketize)
    reg(torch.nonzero, _nonzero_anno, name="torch.nonzero", aliases=(T.nonzero,), input_gen_fn=_gen_nonzero)
    reg(torch.argwhere, _argwhere_anno, name="torch.argwhere", aliases=(T.argwhere,),
        input_gen_fn=_gen_argwhere)
