"""Built-in annotations for the torch functions that models call.

This package is a plugin like any other: its ``nnscaler_register_ops`` hook registers
every family listed in `FAMILIES`. Each family (a module, or a package of
sub-family modules such as ``shape`` and ``indexing``) defines ``register(registry)``.
"""

from __future__ import annotations

import importlib

from nnscaler.hookspecs import hookimpl
from nnscaler.ops.registry import OpRegistry

FAMILIES: tuple[str, ...] = (
    "elementwise",
    "compare",
    "creation",
    "reduce",
    "linalg",
    "nn",
    "norm",
    "loss",
    "token_loss",
    "conv",
    "attention",
    "context_parallel",
    "shape",
    "indexing",
    "moe",
)


@hookimpl
def nnscaler_register_ops(registry: OpRegistry) -> None:
    """Register the ops of every family in `FAMILIES`, in that order."""
    for family in FAMILIES:
        importlib.import_module(f"{__name__}.{family}").register(registry)
