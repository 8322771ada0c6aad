"""Shape ops, by sub-family: `reshape` (view, reshape, flatten, unflatten),
`permute` (transposes, permute, movedim), `split` (split, chunk, unbind),
`concat` (cat, stack, hstack, vstack), `repeat` (expand, repeat, tile),
`squeeze` (squeeze, unsqueeze) and `slicing` (narrow, select, roll, flip,
unfold, diagonal).

Common to all of them: dims whose output size is not a share of an input dim (split
outputs, expanded and repeated dims, new dims) are numbers; the input dim they come from
is ``^``. Each sub-family module documents its own rule and defines ``register``; the
family's ``register`` below registers them all, in this order.
"""

from __future__ import annotations

from nnscaler.ops.builtin.shape import concat, permute, repeat, reshape, slicing, split, squeeze
from nnscaler.ops.builtin.shape.concat import TensorListSignature, cat, hstack, stack, vstack
from nnscaler.ops.builtin.shape.reshape import reshape_dims
from nnscaler.ops.registry import OpRegistry

__all__ = [
    "SUBFAMILIES",
    "TensorListSignature",
    "cat",
    "hstack",
    "register",
    "reshape_dims",
    "stack",
    "vstack",
]

#: the sub-family modules, in registration order
SUBFAMILIES = (reshape, permute, split, concat, repeat, squeeze, slicing)


def register(registry: OpRegistry) -> None:
    """Register every shape op (each sub-family in `SUBFAMILIES` order)."""
    for module in SUBFAMILIES:
        module.register(registry)
