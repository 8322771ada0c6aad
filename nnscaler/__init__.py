"""nnscaler: compile a single-device PyTorch model into a data, tensor and pipeline
parallel program, emitted as readable PyTorch code per rank."""

from __future__ import annotations

from nnscaler.anno import TransformRule
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

# Every error class, importable from ``nnscaler`` as before; not in ``__all__``: import
# them from ``nnscaler.errors``, their one home.
from nnscaler.errors import (  # noqa: F401
    AnnotationError,
    CheckpointError,
    CodegenError,
    CollectiveError,
    ComputeConfigError,
    CustomOpCheckError,
    DataDependentError,
    DuplicateRegistrationError,
    GenFilesError,
    GraphError,
    InterpreterError,
    LayoutError,
    NNScalerError,
    OptimizerStateError,
    ParallelizeError,
    ParallelModuleError,
    PartGroupError,
    PipelineError,
    PlanError,
    PluginError,
    PolicyError,
    PromiseBrokenError,
    RegistrationError,
    ReuseMismatchError,
    ScheduleError,
    StateDictMismatchError,
    TraceError,
    UnknownNameError,
    VerifyError,
)
from nnscaler.graph import IRGraph
from nnscaler.hookspecs import hookimpl  # noqa: F401 - plugin authors: nnscaler.extend
from nnscaler.ops.user_ops import register_op
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
from nnscaler.plugins import get_plugin_manager  # noqa: F401 - plugin authors: nnscaler.extend
from nnscaler.runtime.device import init, uninit
from nnscaler.runtime.module import ParallelModule
from nnscaler.runtime.reducer import sync_grad_when
from nnscaler.trace.markers import anchor, constant_folding, fold_constant, no_constant_folding

__version__ = "0.1.0"

#: The workflow: compile (parallelize, ComputeConfig), train (build_optimizer,
#: ParallelModule), check (verify), save and load (the checkpoint and pretrained-weights
#: functions), extend with ops and policies (register_op, TransformRule, IRGraph), nnScaler
#: 0.8's workflow names (init, sync_grad_when, the constant-folding markers, ...) and the
#: root of every error. Errors are in `nnscaler.errors`; plugin authors import from
#: `nnscaler.extend`.
__all__ = [
    "BroadcastGenFilesStrategy",
    "ComputeConfig",
    "IRGraph",
    "NNScalerError",
    "ParallelModule",
    "ReuseType",
    "TransformRule",
    "VerifyReport",
    "__version__",
    "anchor",
    "broadcast_weights",
    "build_optimizer",
    "constant_folding",
    "deduped_state_dict",
    "fold_constant",
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
