"""Built-in annotations for the torch functions that models call.

This package is a plugin like any other: its ``nnscaler_register_ops`` hook registers
every family listed in `FAMILIES`, and its ``nnscaler_register_attention_kernels`` hook
the math block kernel of ring attention. Each family (a module, or a package of
sub-family modules such as ``shape`` and ``indexing``) defines ``register(registry)``.
"""

from __future__ import annotations

import importlib

from nnscaler.hookspecs import hookimpl
from nnscaler.ops.registry import OpRegistry
from nnscaler.registry import Registry

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


@hookimpl
def nnscaler_register_attention_kernels(registry: Registry) -> None:
    """Register the math block kernel (`nnscaler.ops.builtin.attention_kernels.MATH`),
    which runs ring attention's blocks wherever no plugin's kernel applies."""
    from nnscaler.ops.builtin.attention_kernels import MATH

    registry.register(MATH.name, MATH)
