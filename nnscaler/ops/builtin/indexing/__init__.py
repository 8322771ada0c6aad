"""Indexing ops, by sub-family: `subscript` (``x[key]``, ``x[key] = v``,
index_put), `gather` (gather, take_along_dim, take), `scatter` (scatter and
index_*), `masked` (masked_select, masked_scatter) and `counting` (histc,
bincount, searchsorted, bucketize, nonzero, argwhere).

Each sub-family module documents its rule and defines ``register``; the family's
``register`` below registers them all, in this order.
"""

from __future__ import annotations

from nnscaler.ops.builtin.indexing import counting, gather, masked, scatter, subscript
from nnscaler.ops.builtin.indexing.subscript import KeyPlan, setitem
from nnscaler.ops.registry import OpRegistry

__all__ = ["SUBFAMILIES", "KeyPlan", "register", "setitem"]

#: the sub-family modules, in registration order
SUBFAMILIES = (subscript, gather, scatter, masked, counting)


def register(registry: OpRegistry) -> None:
    """Register every indexing op (each sub-family in `SUBFAMILIES` order)."""
    for module in SUBFAMILIES:
        module.register(registry)
