"""Every hook that nnscaler calls, in one place.

A plugin is a module or object with functions named like the hooks below, decorated
with [`nnscaler.hookimpl`][nnscaler.hookimpl]. Built-in features are plugins too: the built-in ops,
policies, schedules and adapters register through exactly these hooks.

A third-party package makes itself known through the entry-point group ``nnscaler`` in
its ``pyproject.toml``::

    [project.entry-points.nnscaler]
    megatron = "nnscaler_policy_megatron"

and implements whichever hooks it needs::

    import nnscaler

    @nnscaler.hookimpl
    def nnscaler_register_policies(registry):
        registry.register("megatron", megatron_policy)

Every ``nnscaler_register_*`` hook is called once per plugin when the plugin manager
loads (lazily, on first use). Results are ignored: plugins act on the registry they are
given. A plugin that raises is named in the error together with the hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from nnscaler.ops.registry import OpRegistry
    from nnscaler.registry import Registry

PROJECT_NAME = "nnscaler"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# ---------------------------------------------------------------------------------------
# Plugin set-up
# ---------------------------------------------------------------------------------------


@hookspec(historic=True)
def nnscaler_add_hookspecs(pluginmanager: pluggy.PluginManager) -> None:
    """Let a plugin declare hooks of its own.

    :param pluginmanager: the ``pluggy.PluginManager``; call
        ``pluginmanager.add_hookspecs(my_hookspec_module)``.

    Called when the plugin is registered, before any ``nnscaler_register_*`` hook.
    No plugin shipped with nnscaler uses it today; it is there for a plugin that wants
    other plugins to extend it (say, a policy that takes cost models from other packages
    through a ``@hookspec`` of its own, declared here and called with ``pm.hook``).
    """


# ---------------------------------------------------------------------------------------
# What a plugin contributes
# ---------------------------------------------------------------------------------------


@hookspec
def nnscaler_register_ops(registry: OpRegistry) -> None:
    """Register operators with dim annotations.

    :param registry: the `nnscaler.ops.registry.OpRegistry`. Call
        ``registry.register(fn, annotation, name=..., ...)`` with the same arguments as
        [`nnscaler.register_op`][nnscaler.register_op].

    Everything is checked when it is registered: the annotation is parsed (a malformed
    one raises ``AnnotationError`` naming the op and this plugin, with a caret), and a
    non-callable, an annotation of another type, more annotated inputs than the
    function's parameters or a bad option raise
    [`nnscaler.RegistrationError`][nnscaler.errors.RegistrationError] naming the op and this plugin.
    Example::

        @nnscaler.hookimpl
        def nnscaler_register_ops(registry):
            registry.register(my_attention, "b s h^ d^, b t h^ d^ -> b s h^ d^")
    """


@hookspec
def nnscaler_register_policies(registry: Registry) -> None:
    """Register PAS (partition-assign-schedule) policies by name.

    :param registry: a `nnscaler.registry.Registry` of policies. A policy is a
        callable ``(graph, compute_config) -> graph``; anything else (not callable, or a
        signature that cannot take those two arguments) raises
        [`nnscaler.RegistrationError`][nnscaler.errors.RegistrationError] naming this plugin.

    ``parallelize(..., pas_policy="name")`` looks the name up here. Example::

        @nnscaler.hookimpl
        def nnscaler_register_policies(registry):
            registry.register("megatron", megatron_policy)
    """


@hookspec
def nnscaler_register_schedules(registry: Registry) -> None:
    """Register pipeline schedules by name.

    :param registry: a `nnscaler.registry.Registry` of schedules. A schedule is a
        callable ``(nstages, nmicros, nvirtual) -> list of per-device action lists``;
        anything else raises [`nnscaler.RegistrationError`][nnscaler.errors.RegistrationError]
        naming this plugin.

    ``pas_config={"pipeline_scheduler": "name"}`` (read into
    ``ComputeConfig.pipeline.scheduler``) looks the name up here. Example::

        @nnscaler.hookimpl
        def nnscaler_register_schedules(registry):
            registry.register("zero_bubble", zero_bubble_schedule)
    """


@hookspec
def nnscaler_register_adapters(registry: Registry) -> None:
    """Register communication primitives used to move a tensor between layouts.

    :param registry: a `nnscaler.registry.Registry` of primitives (all-reduce,
        all-gather, reduce-scatter, all-to-all, chunk, point-to-point, ...). Each
        primitive knows its forward transition and its adjoint for backward. An entry
        must be a hashable `nnscaler.layout.Primitive` registered under its own
        name, with a transition of `nnscaler.layout.steps.TRANSITIONS` (or None),
        and its adjoint must be registered by some plugin (checked once all have
        loaded); else [`nnscaler.RegistrationError`][nnscaler.errors.RegistrationError] names this
        plugin.

    The layout planner only composes registered primitives, so a plugin can add a
    faster or a hierarchical one. The one registration brings both sides of the
    primitive: the planner uses its ``forward``, ``cost`` and adjoint, and the runtime
    runs each of its steps with its ``run_step(step, rank, x, ctx)`` (and gives its groups
    process groups when ``needs_process_group`` is true); a subclass of a built-in
    primitive inherits the built-in's runtime side. Example::

        @nnscaler.hookimpl
        def nnscaler_register_adapters(registry):
            registry.register("all_reduce_2d", TwoLevelAllReduce())
    """


@hookspec
def nnscaler_register_attention_kernels(registry: Registry) -> None:
    """Register block kernels for ring attention (context parallelism).

    :param registry: a `nnscaler.registry.Registry` of kernels. A kernel is a
        `nnscaler.ops.builtin.attention_kernels.BlockKernel`: ``accepts(q, k, v)``,
        ``forward(q, k, v, *, causal, scale, packed=None) -> (out, lse)`` and
        ``backward(dout, q, k, v, out, lse, *, causal, scale, packed=None) -> (dq, dk,
        dv)``; an object without those methods raises
        [`nnscaler.RegistrationError`][nnscaler.errors.RegistrationError] naming this plugin.

    The ring runs each key/value block with the last registered kernel whose ``accepts``
    is true for the tensors (plugins load after the built-in ``math`` kernel, so theirs
    win where they apply). ``plugins/ops_flash_attn`` registers flash-attention's kernels
    this way, for CUDA tensors in half precision. Example::

        @nnscaler.hookimpl
        def nnscaler_register_attention_kernels(registry):
            registry.register("my_kernel", MyBlockKernel())
    """


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------


@hookspec
def nnscaler_register_loggers(registry: Registry) -> None:
    """Register metric loggers for the Trainer by name.

    :param registry: a `nnscaler.registry.Registry` of logger classes. A logger
        is built as ``cls(**LogConfig.args)`` on rank 0 and has ``setup(config)``,
        ``log_metrics(metrics, step, tag)`` and ``finalize()`` (see
        `nnscaler.cli.loggers.LoggerBase`).

    ``TrainerArgs(log=[LogConfig(type="name", args={...})])`` looks the name up here;
    the built-in plugin registers ``tensorboard``. Example (a W&B package)::

        @nnscaler.hookimpl
        def nnscaler_register_loggers(registry):
            registry.register("wandb", WandbLogger)
    """
