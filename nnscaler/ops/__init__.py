"""Operators: the op registry, ``register_op``, the built-in annotations of torch functions
(`nnscaler.ops.builtin`, a plugin like any other) and the promise check of a
registered op against its annotation (`nnscaler.ops.verify`).
"""

from nnscaler.ops.registry import OpDef, OpRegistry
from nnscaler.ops.user_ops import register_op

__all__ = ["OpDef", "OpRegistry", "register_op"]
