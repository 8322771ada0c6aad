"""nnscaler: compile a single-device PyTorch model into a data, tensor and pipeline
parallel program, emitted as readable PyTorch code per rank."""

from __future__ import annotations

from nnscaler.anno import AnnotationError, TransformRule
from nnscaler.errors import (
    DuplicateRegistrationError,
    NNScalerError,
    PluginError,
    UnknownNameError,
)
from nnscaler.hookspecs import hookimpl
from nnscaler.ops.registry import register_op
from nnscaler.plugins import get_plugin_manager

__version__ = "0.1.0"

__all__ = [
    "AnnotationError",
    "DuplicateRegistrationError",
    "NNScalerError",
    "PluginError",
    "TransformRule",
    "UnknownNameError",
    "__version__",
    "get_plugin_manager",
    "hookimpl",
    "register_op",
]
