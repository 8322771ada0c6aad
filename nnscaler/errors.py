"""Every exception nnscaler raises on purpose, in one module.

The rule: an error class of the kernel is defined here, whichever room raises it, under
the banner of that room; the room imports it from here (and its old import path, such as
``nnscaler.trace.errors.TraceError``, keeps working). So ``from nnscaler.errors import X``
reaches every error, and a contributor looking for one looks in one place.
`tests/test_error_root.py` enforces the rule.

Every exception derives from `NNScalerError` and refines a builtin (``ValueError``,
``LookupError``, ...) so that code which already catches the builtin keeps working; the
message states the rule, the value seen and how to fix it.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nnscaler.schedule.actions import Action


class NNScalerError(Exception):
    """Base class of every error that nnscaler raises on purpose."""


class UnknownNameError(NNScalerError, LookupError):
    """A name (op, policy, schedule, adapter) that no plugin registered was asked for."""

    def __str__(self) -> str:  # LookupError/KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateRegistrationError(NNScalerError, ValueError):
    """Two plugins registered the same name in one registry."""


class PluginError(NNScalerError, RuntimeError):
    """A plugin failed while loading or while running one of its hooks."""


class RegistrationError(NNScalerError, TypeError, ValueError):
    """A plugin (or user code) registered a value its registry cannot use: a policy that
    is not a callable ``(graph, compute_config)``, an adapter that is not a ``Primitive``,
    an op whose annotation does not fit its function, ... The message names the entry,
    the plugin that registered it, the rule and the fix. It refines both ``TypeError``
    (a value of the wrong kind) and ``ValueError`` (the right kind, a wrong value)."""


class CheckpointError(NNScalerError, ValueError):
    """A checkpoint that cannot be saved, merged or loaded as asked."""


class StateDictMismatchError(CheckpointError):
    """A state dict that belongs to another model, plan or rank (the message names the
    first mismatching key and both shapes)."""


class OptimizerStateError(CheckpointError):
    """Optimizer state that cannot be merged or split (e.g. state that is not elementwise,
    as LBFGS or Adafactor keep)."""


# -- the annotation grammar (`nnscaler.anno`) ----------------------------------------


class AnnotationError(NNScalerError, ValueError):
    """An annotation that is malformed, or that disagrees with the shapes of a call.

    ``str(err)`` is the reason, the annotation quoted on its own line and, when the
    offending token is known, a caret under it.
    """

    def __init__(self, reason: str, *, annotation: str = "", position: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.annotation = annotation
        self.position = position

    def __str__(self) -> str:
        lines = [self.reason]
        if self.annotation:
            lines.append(f"    '{self.annotation}'")
            if self.position is not None:
                # 4 spaces of indent and 1 quote character come before the annotation
                lines.append(" " * (5 + self.position) + "^")
        return "\n".join(lines)


class PromiseBrokenError(NNScalerError, AssertionError):
    """Running an op on the parts of a split and recombining did not give the whole result."""


class PartGroupError(NNScalerError, RuntimeError):
    """A collective part op was misused (bad reduce op, parts that disagree, a failed part)."""


# -- layouts (`nnscaler.layout`) -----------------------------------------------------


class LayoutError(NNScalerError, ValueError):
    """A layout, plan or per-device tensor set breaks a rule of the RVD algebra."""


# -- pipeline schedules (`nnscaler.schedule`) ----------------------------------------


class ScheduleError(NNScalerError, ValueError):
    """A schedule (or a schedule's arguments) breaks a rule of the pipeline.

    ``device`` and ``action`` name where the problem was found, when it is one place.
    """

    def __init__(self, message: str, *, device: int | None = None, action: Action | None = None):
        super().__init__(message)
        self.device = device
        self.action = action


# -- the graph IR (`nnscaler.ir`) ----------------------------------------------------


class GraphError(NNScalerError, ValueError):
    """A graph whose ops do not connect: a tensor read before any op produced it."""


class InterpreterError(NNScalerError, ValueError):
    """Arguments or state that do not fit the graph being run."""


class GraphMismatchError(NNScalerError, AssertionError):
    """The graph computed something other than the module it was traced from."""


# -- the compute configuration (`nnscaler.config`) and small helpers (`nnscaler.utils`) ---


class ComputeConfigError(NNScalerError, ValueError):
    """A ``ComputeConfig`` field with a value that cannot work."""


class CompileConfigError(NNScalerError, ValueError):
    """A ``compile`` value that ``torch.compile`` of generated code cannot take
    (``ComputeConfig`` raises it as its ``ComputeConfigError``)."""


class LoggerLevelError(NNScalerError, ValueError):
    """A logging level that the logging module does not know."""


# -- the built-in ops (`nnscaler.ops`) -----------------------------------------------


class MoEError(NNScalerError, ValueError):
    """An MoE layer that cannot run as asked: bad shapes, an unknown activation, an expert
    count the parts cannot divide, or a capacity that would drop tokens unasked."""


class ContextParallelError(NNScalerError, ValueError):
    """Attention cannot be split along the sequence as asked (a length the parts do not
    divide, too few heads for Ulysses, a mask or dropout the split cannot keep)."""


# -- tracing (`nnscaler.trace`) ------------------------------------------------------


class TraceError(NNScalerError, RuntimeError):
    """The model could not be traced; the message names the op and the model's line."""


class ForwardSignatureError(TraceError, TypeError):
    """``dummy_forward_args`` do not fit ``forward``'s signature, or the signature has a form
    that cannot be called by name (positional-only arguments, ``*args``)."""


class MetaTraceError(TraceError):
    """A call failed on the ``meta`` device, where no values are computed."""


class DataDependentError(TraceError):
    """The model reads Python values or sizes from tensor data (``x.item()``, ``if x.any():``,
    ``torch.nonzero(x)``): with the ``meta`` strategy, which has no data, while tracing; at
    ``parallelize``, because the traced graph would keep the values seen on the dummy
    inputs for every batch."""


class MetaDataDependentError(DataDependentError, MetaTraceError):
    """A value read from tensor data while tracing with the ``meta`` strategy."""


class ConstantFoldingError(TraceError):
    """A forward asked the tracer not to fold Python values into constants."""


class UnplacedExpertsWarning(UserWarning):
    """A module looks like an expert stack but cannot be recorded as `moe_experts`."""


class OpaqueOpWarning(UserWarning):
    """A torch function with no dim annotation was recorded as an opaque op (replicated only)."""


# -- the policy writer's API (`nnscaler.graph`) and the policies (`nnscaler.policies`) ---


class PlanError(NNScalerError, ValueError):
    """A policy asked the graph for something it cannot do."""


class PartitionError(PlanError):
    """An op cannot be split as asked: opaque, or not a split of its transform space."""


class StagingError(PlanError):
    """Pipeline stages that do not start at the first op, overlap, or repeat an op."""


class PlanCheckError(PlanError):
    """A planned graph that is incomplete or inconsistent (found by ``check``)."""


class RunPlanError(PlanError):
    """The plan simulator cannot run a planned graph."""


class PolicyError(PlanError):
    """A built-in policy cannot plan the graph with the compute config it was given."""


# -- code generation (`nnscaler.codegen`) --------------------------------------------


class CodegenError(NNScalerError, ValueError):
    """A planned graph that cannot be turned into per-rank programs; the message says
    which rule it breaks, what was seen, and how to fix the plan or the model."""


# -- the runtime (`nnscaler.runtime`) ------------------------------------------------


class CollectiveError(NNScalerError, RuntimeError):
    """A collective called with arguments that cannot work on this rank."""


class CompileError(NNScalerError, RuntimeError):
    """``ComputeConfig(compile=...)`` asked for something ``torch.compile`` cannot do here."""


class DeviceError(NNScalerError, RuntimeError):
    """A device choice or a process-group start-up that cannot work."""


class GroupError(NNScalerError, RuntimeError):
    """A process group that is malformed, or that was not created collectively."""


class MixedPrecisionError(NNScalerError, ValueError):
    """A precision setting that cannot work."""


class ParallelModuleError(NNScalerError, RuntimeError):
    """A parallel module used in a way its generated program does not support."""


class PipelineError(ParallelModuleError):
    """A pipelined module was called in a way its schedule cannot run."""


# -- parallelize, verify and their files (`nnscaler.parallel`) -----------------------


class ParallelizeError(NNScalerError, RuntimeError):
    """``parallelize`` cannot do what it was asked (the message says why and the fix)."""


class ReuseMismatchError(ParallelizeError, ValueError):
    """``ReuseType.MATCH`` found generated files made with a different configuration."""


class BroadcastError(NNScalerError, RuntimeError):
    """A broadcast of files or weights that cannot be done as asked."""


class GenFilesError(NNScalerError, OSError):
    """``gen_savedir`` cannot be used (not writable, not a directory, ...)."""


class GenFilesLockedError(GenFilesError, TimeoutError):
    """Another process held an instance directory's lock for longer than the timeout."""


class GenFilesChangedError(NNScalerError, ValueError):
    """A generated file differs from the one recorded in ``config.json`` (edited after
    generation): nnscaler does not run or reuse it."""


class UnsafeGraphFileError(NNScalerError, pickle.UnpicklingError, ValueError):
    """``graph.pkl`` names something the restricted unpickler does not allow."""


class CustomOpCheckError(NNScalerError, ValueError):
    """A custom op does not keep the promise of its annotation for a split the plan uses."""


class OptimizerError(NNScalerError, ValueError):
    """``build_optimizer`` cannot build an optimizer for this module as asked."""


class VerifyError(NNScalerError, RuntimeError):
    """``verify`` could not run the comparison (a rank failed, a bad argument)."""


class WorkerError(NNScalerError, RuntimeError):
    """Work handed to another rank failed there (the message names the rank, the
    function and the remote traceback)."""


# -- the Trainer (`nnscaler.trainer`) ------------------------------------------------


class ConfigError(NNScalerError, ValueError):
    """A Trainer configuration that cannot be used; ``key`` is the dotted key at fault."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class TrainerError(NNScalerError, RuntimeError):
    """The Trainer cannot go on (a setting that does not fit the job, a failed save)."""


class TrainerCheckpointError(NNScalerError, ValueError):
    """A checkpoint folder that cannot be resumed from, or a save that failed."""


# -- the command line and the integrations (`nnscaler.cli`, `nnscaler.integration`) ---


class LoggerError(NNScalerError, RuntimeError):
    """A logger that cannot be built or used (e.g. its optional package is missing)."""


class ChunkedLossError(NNScalerError, ValueError):
    """Arguments of `chunk_linear_cross_entropy` that do not fit together."""


class LightningIntegrationError(NNScalerError, ValueError):
    """The LightningModule or the Trainer is set up in a way the strategy cannot run."""
