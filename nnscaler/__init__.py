"""nnscaler: compile a single-device PyTorch model into a data, tensor and pipeline
parallel program, emitted as readable PyTorch code per rank."""

from __future__ import annotations

from nnscaler.anno import AnnotationError, PromiseBrokenError, TransformRule
from nnscaler.anno.partgroup import PartGroupError
from nnscaler.checkpoint import (
    deduped_state_dict,
    load_deduped_state_dict,
    load_merged_state_dict,
    load_merged_state_dicts,
    load_pretrained,
    load_resharded,
    load_sharded_state_dict,
    merge_state_dicts,
    meta_parameters,
    save_pretrained,
)
from nnscaler.codegen.errors import CodegenError
from nnscaler.config import ComputeConfigError
from nnscaler.errors import (
    CheckpointError,
    DuplicateRegistrationError,
    NNScalerError,
    OptimizerStateError,
    PluginError,
    RegistrationError,
    StateDictMismatchError,
    UnknownNameError,
)
from nnscaler.graph import IRGraph
from nnscaler.graph.errors import PlanError
from nnscaler.hookspecs import hookimpl
from nnscaler.ir.graph import GraphError
from nnscaler.ir.interpreter import InterpreterError
from nnscaler.layout import LayoutError
from nnscaler.ops.user_ops import register_op
from nnscaler.parallel import (
    BroadcastGenFilesStrategy,
    ComputeConfig,
    ReuseType,
    VerifyError,
    VerifyReport,
    broadcast_weights,
    build_optimizer,
    parallelize,
    verify,
)
from nnscaler.parallel.api import ParallelizeError, ReuseMismatchError
from nnscaler.parallel.op_checks import CustomOpCheckError
from nnscaler.parallel.paths import GenFilesError
from nnscaler.plugins import get_plugin_manager
from nnscaler.policies.common import PolicyError
from nnscaler.runtime.collectives import CollectiveError
from nnscaler.runtime.device import init, uninit
from nnscaler.runtime.module import ParallelModule, ParallelModuleError
from nnscaler.runtime.pipeline import PipelineError
from nnscaler.runtime.reducer import sync_grad_when
from nnscaler.schedule.errors import ScheduleError
from nnscaler.trace.errors import DataDependentError, TraceError
from nnscaler.trace.markers import anchor, constant_folding, fold_constant, no_constant_folding

__version__ = "0.1.0"

__all__ = [
    "AnnotationError",
    "BroadcastGenFilesStrategy",
    "CheckpointError",
    "CodegenError",
    "CollectiveError",
    "ComputeConfig",
    "ComputeConfigError",
    "CustomOpCheckError",
    "DataDependentError",
    "DuplicateRegistrationError",
    "GenFilesError",
    "GraphError",
    "IRGraph",
    "InterpreterError",
    "LayoutError",
    "NNScalerError",
    "OptimizerStateError",
    "ParallelModule",
    "ParallelModuleError",
    "ParallelizeError",
    "PartGroupError",
    "PipelineError",
    "PlanError",
    "PluginError",
    "PolicyError",
    "PromiseBrokenError",
    "RegistrationError",
    "ReuseMismatchError",
    "ReuseType",
    "ScheduleError",
    "StateDictMismatchError",
    "TraceError",
    "TransformRule",
    "UnknownNameError",
    "VerifyError",
    "VerifyReport",
    "__version__",
    "anchor",
    "broadcast_weights",
    "build_optimizer",
    "constant_folding",
    "deduped_state_dict",
    "fold_constant",
    "get_plugin_manager",
    "hookimpl",
    "init",
    "load_deduped_state_dict",
    "load_merged_state_dict",
    "load_merged_state_dicts",
    "load_pretrained",
    "load_resharded",
    "load_sharded_state_dict",
    "merge_state_dicts",
    "meta_parameters",
    "no_constant_folding",
    "parallelize",
    "register_op",
    "save_pretrained",
    "sync_grad_when",
    "uninit",
    "verify",
]
