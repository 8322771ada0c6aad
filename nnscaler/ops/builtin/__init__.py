"""Built-in annotations for the torch functions that models call.

This package is a plugin like any other: its ``nnscaler_register_ops`` hook registers
every family module listed in :data:`FAMILIES`. Each family module defines
``register(registry)``.
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
    "conv",
    "attention",
    "shape",
    "indexing",
)


@hookimpl
def nnscaler_register_ops(registry: OpRegistry) -> None:
    for family in FAMILIES:
        try:
            module = importlib.import_module(f"{__name__}.{family}")
        except ModuleNotFoundError as e:
            if e.name == f"{__name__}.{family}":
                continue  # family not written yet
            raise
        module.register(registry)
