"""masked_select / masked_scatter: how many elements a mask selects depends on the data,
so the masked dims are ``^`` and the selected count is a number.
"""

from __future__ import annotations

import math
import random

import torch

from nnscaler.ops.builtin._common import (
    broadcast_anno,
    idents,
    join_anno,
    randbool,
)
from nnscaler.ops.builtin.indexing.common import (
    Call,
    frozen_dims,
    rand_tensor,
    small_shape,
)
from nnscaler.ops.registry import OpRegistry


def _masked_select_anno(input: torch.Tensor, mask: torch.Tensor) -> str:
    ins, _ = broadcast_anno([input, mask], out_mark="^")
    nnz = int(torch.broadcast_to(mask, torch.broadcast_shapes(input.shape, mask.shape)).count_nonzero())
    return join_anno(ins, [[str(nnz)]])


def _masked_scatter_anno(input: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> str:
    ins, out = broadcast_anno([input, mask], out_mark="^")
    n = max(input.dim(), mask.dim())
    src = frozen_dims(idents(n + source.dim())[n:])
    return join_anno([*ins, src], [out])


def _gen_masked_select(rng: random.Random) -> Call:
    shape = small_shape(rng, 1, 3)
    mshape = [1 if rng.random() < 0.3 else s for s in shape][rng.randint(0, len(shape) - 1):]
    return (rand_tensor(rng, shape), randbool(rng, *mshape)), {}


def _gen_masked_scatter(rng: random.Random) -> Call:
    shape = small_shape(rng, 1, 3)
    mshape = [1 if rng.random() < 0.3 else s for s in shape][rng.randint(0, len(shape) - 1):]
    mask = randbool(rng, *mshape)
    return (rand_tensor(rng, shape), mask, rand_tensor(rng, (math.prod(shape) + rng.randint(0, 3),))), {}


def _gen_masked_scatter_(rng: random.Random) -> Call:
    shape = small_shape(rng, 1, 3)
    mshape = [1 if rng.random() < 0.3 else s for s in shape][rng.randint(0, len(shape) - 1):]
    return (rand_tensor(rng, shape), randbool(rng, *mshape), rand_tensor(rng, (math.prod(shape),))), {}


def register(registry: OpRegistry) -> None:
    """Register the masked_select and masked_scatter ops."""
    T = torch.Tensor
    reg = registry.register

    reg(torch.masked_select, _masked_select_anno, name="torch.masked_select", aliases=(T.masked_select,),
        input_gen_fn=_gen_masked_select)
    reg(torch.masked_scatter, _masked_scatter_anno, name="torch.masked_scatter", aliases=(T.masked_scatter,),
        input_gen_fn=_gen_masked_scatter)
    reg(T.masked_scatter_, _masked_scatter_anno, name="torch.Tensor.masked_scatter_",
        input_gen_fn=_gen_masked_scatter_)
