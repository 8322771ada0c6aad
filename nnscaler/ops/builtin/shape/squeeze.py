"""squeeze / unsqueeze: a removed or added dim of size 1 is the number ``1``; the dims
squeeze looks at but keeps are ``^`` (a part whose share of one is 1 would lose it too).
"""

from __future__ import annotations

import random
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
    rand_dim,
    rand_ndim,
    rand_tensor,
    shape_with_ones,
)
from nnscaler.ops.registry import OpRegistry


def _squeeze_anno(input: torch.Tensor, dim: Any = None) -> str:
    shape = shape_of(input)
    names = idents(len(shape))
    # A part whose share of a dim is 1 would lose that dim too, so the dims that squeeze
    # looks at but keeps (all of them without ``dim``) are '^'.
    if dim is None:
        looked = set(range(len(shape)))
    else:
        looked = {norm_dim(d, len(shape)) for d in dims_arg(dim)} if shape else set()
    drop = {k for k in looked if shape[k] == 1}
    dims = [n + "^" if k in looked else n for k, n in enumerate(names)]
    ins = ["1" if k in drop else d for k, d in enumerate(dims)]
    outs = [d for k, d in enumerate(dims) if k not in drop]
    return join_anno([ins], [outs])


def _unsqueeze_anno(input: torch.Tensor, dim: int) -> str:
    names = idents(input.dim())
    d = dim if dim >= 0 else dim + input.dim() + 1
    return join_anno([names], [names[:d] + ["1"] + names[d:]])


def _gen_squeeze(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_tensor(rng, shape_with_ones(rng))
    r = rng.random()
    if r < 0.3:
        return (x,), {}
    if r < 0.7:
        return (x, rand_dim(rng, x.dim())), {}
    return (x, tuple(rng.sample(range(x.dim()), rng.randint(1, x.dim())))), {}


def _gen_unsqueeze(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = rand_ndim(rng, 0 if rng.random() < 0.1 else 1, 3)
    n = x.dim() + 1
    return (x, rng.randrange(-n, n)), {}


def register(registry: OpRegistry) -> None:
    """Register the squeeze and unsqueeze ops."""
    T = torch.Tensor
    reg = registry.register

    reg(torch.squeeze, _squeeze_anno, name="torch.squeeze", aliases=(T.squeeze,), input_gen_fn=_gen_squeeze)
    reg(T.squeeze_, _squeeze_anno, name="torch.Tensor.squeeze_", input_gen_fn=_gen_squeeze)
    reg(torch.unsqueeze, _unsqueeze_anno, name="torch.unsqueeze", aliases=(T.unsqueeze,),
        input_gen_fn=_gen_unsqueeze)
    reg(T.unsqueeze_, _unsqueeze_anno, name="torch.Tensor.unsqueeze_", input_gen_fn=_gen_unsqueeze)
