"""nnscaler: compile a single-device PyTorch model into a data, tensor and pipeline
parallel program, emitted as readable PyTorch code per rank."""

from __future__ import annotations

from nnscaler.anno import AnnotationError, TransformRule
from nnscaler.checkpoint import (
    deduped_state_dict,
    load_deduped_state_dict,
    load_merged_state_dicts,
    merge_state_dicts,
)
from nnscaler.errors import (
    DuplicateRegistrationError,
    NNScalerError,
    PluginError,
    UnknownNameError,
)
from nnscaler.graph import IRGraph
from nnscaler.hookspecs import hookimpl
from nnscaler.ops.registry import register_op
from nnscaler.parallel import (
    BroadcastGenFilesStrategy,
    ComputeConfig,
    ReuseType,
    VerifyReport,
    broadcast_weights,
    build_optimizer,
    parallelize,
    verify,
)
from nnscaler.plugins import get_plugin_manager
from nnscaler.runtime.module import ParallelModule

__version__ = "0.1.0"

__all__ = [
    "AnnotationError",
    "BroadcastGenFilesStrategy",
    "ComputeConfig",
    "DuplicateRegistrationError",
    "IRGraph",
    "NNScalerError",
    "ParallelModule",
    "PluginError",
    "ReuseType",
    "TransformRule",
    "UnknownNameError",
    "VerifyReport",
    "__version__",
    "broadcast_weights",
    "build_optimizer",
    "get_plugin_manager",
    "deduped_state_dict",
    "hookimpl",
    "load_deduped_state_dict",
    "load_merged_state_dicts",
    "merge_state_dicts",
    "parallelize",
    "register_op",
    "verify",
]

