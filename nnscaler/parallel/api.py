"""``parallelize``: trace a module, apply a policy, generate code per rank, load it.

See ``docs/parallelize.md`` for the user's view and ``docs/internals/parallel-runtime.md``
for the contract with code generation and the runtime.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nnscaler import gendir
from nnscaler.config import AUTO
from nnscaler.errors import ParallelizeError, ReuseMismatchError
from nnscaler.parallel import fingerprint, graph_pickle, locks, paths, staging, workers
from nnscaler.parallel.broadcast import broadcast_gen_files
from nnscaler.parallel.config import BroadcastGenFilesStrategy, ComputeConfig, ReuseType
from nnscaler.parallel.files import GenFilesChangedError, changed_message
from nnscaler.runtime.module import ParallelModule

__all__ = ["ParallelizeError", "ReuseMismatchError", "parallelize"]


PolicyFn = Callable[[Any, ComputeConfig], Any]


# -- argument checks (every rank, identical results) ------------------------------------
def _check_module_arg(module_or_module_class: Any, module_fn: Any, module_dtype: Any) -> bool:
    """Whether a class was given; raise on anything ``parallelize`` cannot take."""
    if isinstance(module_or_module_class, type):
        if not issubclass(module_or_module_class, torch.nn.Module):
            raise TypeError(
                f"parallelize takes a torch.nn.Module or a subclass of it, got the class "
                f"{paths.class_path(module_or_module_class)}"
            )
        if issubclass(module_or_module_class, ParallelModule):
            raise ParallelizeError(
                f"{module_or_module_class.__qualname__} is already a ParallelModule (generated "
                f"code); parallelize the original module instead"
            )
        if module_fn is not None and not callable(module_fn):
            raise TypeError(f"module_fn must be a callable that returns the module, got "
                            f"{module_fn!r}")
        if module_dtype is not None and not isinstance(module_dtype, torch.dtype):
            raise TypeError(f"module_dtype must be a torch.dtype (e.g. torch.bfloat16) or None, "
                            f"got {module_dtype!r}")
        return True
    if not isinstance(module_or_module_class, torch.nn.Module):
        raise TypeError(
            f"parallelize takes a torch.nn.Module or a subclass of it, got "
            f"{type(module_or_module_class).__name__} {module_or_module_class!r}"
        )
    if isinstance(module_or_module_class, ParallelModule):
        raise ParallelizeError(
            f"{type(module_or_module_class).__qualname__} is already a ParallelModule "
            f"(generated code); parallelize the original module instead"
        )
    for name, value in (("module_fn", module_fn), ("module_dtype", module_dtype)):
        if value is not None:
            raise ValueError(
                f"{name} only applies when a module class is given (it controls how "
                f"parallelize builds the module); got {name}={value!r} with a module object. "
                f"Build the module as you want it and pass it without {name}"
                + (", e.g. module.to(dtype)" if name == "module_dtype" else "")
            )
    return False


def _check_forward_signature(module_or_class: Any, dummy_forward_args: Any) -> None:
    """Dummy arguments against ``forward``'s signature, without building the module."""
    from nnscaler.trace import check_forward_args

    if isinstance(module_or_class, torch.nn.Module):
        check_forward_args(module_or_class, dummy_forward_args)
        return
    try:  # an instance with no __init__ run: enough to read the bound forward's signature
        probe = module_or_class.__new__(module_or_class)
    except Exception:  # noqa: BLE001 - an odd __new__: the trace checks the arguments later
        return
    check_forward_args(probe, dummy_forward_args)


def _resolve_policy(pas_policy: Any) -> PolicyFn:
    if isinstance(pas_policy, str):
        from nnscaler.plugins import get_plugin_manager

        return get_plugin_manager().policies.get(pas_policy)
    if callable(pas_policy):
        return pas_policy
    raise TypeError(
        f"pas_policy must be a registered policy name (e.g. 'dp', 'tp') or a callable "
        f"(graph, compute_config) -> graph, got {type(pas_policy).__name__} {pas_policy!r}"
    )


def _dist_info() -> tuple[bool, int, int]:
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank(), dist.get_world_size()
    return False, 0, 1


# -- building the module (rank 0) -------------------------------------------------------
def _build(cls: type, module_fn: Callable[[], torch.nn.Module] | None,
           module_dtype: torch.dtype | None, *, meta: bool) -> torch.nn.Module:
    make = module_fn if module_fn is not None else cls
    if meta:
        with torch.device("meta"):
            module = make()
    else:
        try:
            module = make()
        except TypeError as e:
            if module_fn is None:
                raise ParallelizeError(
                    f"parallelize could not build {cls.__qualname__}() without arguments "
                    f"({e}); pass module_fn=lambda: {cls.__qualname__}(...) to say how"
                ) from e
            raise
    if not isinstance(module, cls):
        raise TypeError(
            f"module_fn must return an instance of {paths.class_path(cls)}, got "
            f"{type(module).__name__}"
        )
    if module_dtype is not None:
        module = module.to(module_dtype)
    return module


def _check_no_nested(module: torch.nn.Module) -> None:
    for name, sub in module.named_modules():
        if isinstance(sub, ParallelModule):
            raise ParallelizeError(
                f"{type(module).__qualname__} holds the ParallelModule "
                f"{type(sub).__qualname__} at {name!r}: a parallel module cannot be "
                f"parallelized again. Parallelize the original submodule inside the bigger "
                f"model instead, or keep the parallel module outside the module you "
                f"parallelize"
            )


class _Generator:
    """What rank 0 (or every process, without torch.distributed) does: decide on reuse,
    trace, plan, generate."""

    def __init__(self, module_or_class: Any, is_class: bool, dummy_forward_args: Mapping[str, Any],
                 pas_policy: Any, policy_fn: PolicyFn, compute_config: ComputeConfig,
                 outdir: Path, reuse: ReuseType, instance_name: str | None,
                 module_fn: Callable[[], torch.nn.Module] | None,
                 module_dtype: torch.dtype | None) -> None:
        self.given = module_or_class
        self.is_class = is_class
        self.cls: type = module_or_class if is_class else type(module_or_class)
        self.args = dummy_forward_args
        self.pas_policy = pas_policy
        self.policy_fn = policy_fn
        self.config = compute_config
        self.outdir = outdir
        self.reuse = reuse
        self.instance_name = instance_name
        self.module_fn = module_fn
        self.module_dtype = module_dtype
        self._module: torch.nn.Module | None = None

    def module(self) -> torch.nn.Module:
        """The real module (built from the class on first use)."""
        if self._module is None:
            if self.is_class:
                self._module = _build(self.cls, self.module_fn, self.module_dtype, meta=False)
            else:
                self._module = self.given
            _check_no_nested(self._module)
        return self._module

    def fingerprint_module(self) -> torch.nn.Module:
        """A module to fingerprint: for a class, built on the meta device when possible."""
        if self._module is not None or not self.is_class:
            return self.module()
        try:
            probe = _build(self.cls, self.module_fn, self.module_dtype, meta=True)
        except Exception:  # noqa: BLE001 - e.g. __init__ reads data: build it for real
            return self.module()
        _check_no_nested(probe)
        return probe

    def run(self) -> bool:
        """Reuse or generate; True when new files were generated."""
        saved = gendir.read_config(self.outdir)
        module_fp = fingerprint.module_fingerprint(self.fingerprint_module())
        inputs_fp = fingerprint.inputs_fingerprint(self.args)
        match = fingerprint.match_key(self.config, self.pas_policy, module_fp, inputs_fp)
        if saved is not None and self.reuse in (ReuseType.MATCH, ReuseType.MOO):
            differences = fingerprint.diff(saved.get("match"), match)
            changed = [] if differences else gendir.changed_files(self.outdir, saved)
            if not differences and not changed:
                self._warn_stale_weights(saved)
                return False
            if changed:  # edited after generation: never reused, never run
                message = changed_message(self.outdir, changed, reuse=self.reuse.value)
                if self.reuse is ReuseType.MATCH:
                    raise GenFilesChangedError(message)
                warnings.warn(f"{message}. reuse='moo': regenerating them", stacklevel=3)
            elif self.reuse is ReuseType.MATCH:
                listed = "\n  ".join(differences)
                raise ReuseMismatchError(
                    f"reuse=MATCH: the generated files in {str(self.outdir)!r} were made with "
                    f"a different configuration than this call; what differs (saved vs "
                    f"now):\n  {listed}\nPass reuse='override' (or 'moo') to regenerate, or "
                    f"instance_name='...' to keep both versions."
                )
        graph = None
        if saved is not None and self.reuse is ReuseType.GRAPH:
            graph = self._saved_graph(saved, match)
        if graph is None:
            from nnscaler.trace import trace

            graph = trace(self.module(), self.args, strategy=self.config.tracing.strategy)
        from nnscaler.trace.data_dependent import check_data_dependent

        check_data_dependent(graph.data_dependent, allow=self.config.tracing.allow_data_dependent)
        # ReuseType other than MATCH: what was there goes, even if generation fails below
        # (a MATCH call only gets here when there is no complete directory)
        staging.remove_dir(self.outdir)
        with staging.staging_dir(self.outdir) as tmp:
            planned = self._plan(graph)
            if self.config.check_custom_ops:
                from nnscaler.parallel.op_checks import check_custom_ops

                check_custom_ops(planned)
            self._emit(planned, tmp)
            try:
                graph_pickle.save_graph(graph, tmp / gendir.GRAPH_FILE)
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                (tmp / gendir.GRAPH_FILE).unlink(missing_ok=True)
                warnings.warn(f"the traced graph could not be saved for ReuseType.GRAPH "
                              f"({type(e).__name__}: {e}); GRAPH reuse will trace again",
                              stacklevel=3)
            gendir.write_config(tmp, gendir.new_config(
                tmp, match, module_class=paths.class_path(self.cls),
                instance_name=self.instance_name, versions=fingerprint.versions(),
                extra={"graph_key": fingerprint.graph_key(match),
                       "weights_digest": fingerprint.weights_digest(self.module())}))
        return True

    def _warn_stale_weights(self, saved: Mapping[str, Any]) -> None:
        """Reused files start from the weights saved when they were generated: say so when
        the module object given now holds other values."""
        if self.is_class:
            return
        now = fingerprint.weights_digest(self.given)
        if now is not None and saved.get("weights_digest") not in (None, now):
            warnings.warn(
                f"parallelize reused the files in {str(self.outdir)!r}; the parallel module "
                f"starts from the weights saved with them ({gendir.FULLMODEL}), which differ "
                f"from the weights {type(self.given).__qualname__} holds now. Load your "
                f"weights into the parallel module (load_state_dict), or regenerate with "
                f"reuse='override'",
                stacklevel=4,
            )

    def _saved_graph(self, saved: Mapping[str, Any], match: Mapping[str, Any]) -> Any:
        path = self.outdir / gendir.GRAPH_FILE
        if saved.get("graph_key") != fingerprint.graph_key(match) or not path.is_file():
            return None
        if gendir.changed_files(self.outdir, saved, [gendir.GRAPH_FILE]):
            warnings.warn(f"{changed_message(self.outdir, [gendir.GRAPH_FILE], reuse='graph')}"
                          f"; tracing again", stacklevel=3)
            return None
        try:
            return graph_pickle.load_graph(path)
        except Exception as e:  # noqa: BLE001 - a stale or foreign pickle: trace again
            warnings.warn(f"the saved graph {str(path)!r} could not be loaded "
                          f"({type(e).__name__}: {e}); tracing again", stacklevel=3)
            return None

    def _plan(self, graph: Any) -> Any:
        from nnscaler.graph import IRGraph

        irgraph = IRGraph.from_graph(graph)
        name = self.pas_policy if isinstance(self.pas_policy, str) else getattr(
            self.pas_policy, "__qualname__", repr(self.pas_policy))
        result = self.policy_fn(irgraph, self.config)
        if result is None:  # a policy that edited the graph in place and returned nothing
            result = irgraph
        if not isinstance(result, IRGraph):
            raise ParallelizeError(
                f"the policy {name!r} must return the IRGraph it was given (after placing "
                f"its ops), got {type(result).__name__}"
            )
        self.config = _resolve_auto(self.config, result, name)
        try:
            result.check(self.config.plan_ngpus)
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(f"(the plan of policy {name!r} for plan_ngpus="
                           f"{self.config.plan_ngpus})")
            raise
        return result

    def _emit(self, graph: Any, outdir: Path) -> None:
        from nnscaler.codegen import emit_files

        module = self.module()
        emit_files(
            graph, outdir, plan_ngpus=self.config.plan_ngpus,
            runtime_ngpus=self.config.runtime_ngpus, state=module,
            end2end=self.config.use_end2end, inference_only=self.config.inference_only,
            compute_config=self.config, forward_signature=inspect.signature(module.forward),
            origin={"module": paths.class_path(self.cls), "policy": self._policy_name()},
        )

    def _policy_name(self) -> str:
        """The policy as the user named it (a registered name or a function's name)."""
        if isinstance(self.pas_policy, str):
            return repr(self.pas_policy)
        return getattr(self.pas_policy, "__qualname__", repr(self.pas_policy))


def _unit_size(graph: Any, policy: str, config: ComputeConfig) -> int:
    """The unit size a policy chose for ``plan_ngpus='auto'``: the devices its plan uses."""
    devices = {op.plan.device for op in graph.nodes() if op.plan.device is not None}
    n = max(devices, default=-1) + 1
    if n < 1 or config.runtime_ngpus % n:
        raise ParallelizeError(
            f"plan_ngpus='auto': the policy {policy!r} placed ops on {n} device(s), which is "
            f"not a unit size dividing runtime_ngpus={config.runtime_ngpus}; only a policy "
            f"that chooses the unit (autodist) can take plan_ngpus='auto'")
    return n


def _resolve_auto(config: ComputeConfig, graph: Any, policy: str) -> ComputeConfig:
    """``config`` with what the policy chose for its ``'auto'`` fields: the unit size
    (the devices its plan uses) and the ZeRO stage (``graph.zero_stage``)."""
    if config.plan_ngpus == AUTO:
        config = config.resolved(_unit_size(graph, policy, config))
    if config.zero_stage == AUTO:
        config = config.resolved(zero_stage=_zero_stage(graph, policy, config))
    return config


def _zero_stage(graph: Any, policy: str, config: ComputeConfig) -> int:
    """The ZeRO stage a policy chose for ``zero_stage='auto'`` (`IRGraph.choose_zero_stage`)."""
    stage = getattr(graph, "zero_stage", None)
    if stage not in config.zero_stages:
        raise ParallelizeError(
            f"zero_stage='auto': the policy {policy!r} chose "
            f"{'no ZeRO stage' if stage is None else f'ZeRO stage {stage}'}, where one of "
            f"{list(config.zero_stages)} is needed (IRGraph.choose_zero_stage); only a policy "
            f"that chooses the stage (autodist) can take zero_stage='auto', else give "
            f"zero_stage")
    return stage


# -- rank 0 -> everyone -----------------------------------------------------------------
def _share_outcome(outcome: Any) -> Any:
    """Rank 0 sends its outcome (``('ok', generated, digests)`` or ``('error',
    exception)``) to every rank, so that a failure on rank 0 fails every rank instead of
    hanging them; the other ranks serve the policy's work (`workers`) until then."""
    if dist.get_rank() != 0:
        return workers.serve()
    sent = outcome
    if outcome[0] == "error":
        try:  # the other ranks must be able to rebuild it, not only this one to send it
            pickle.loads(pickle.dumps(outcome[1]))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            exc = outcome[1]
            sent = ("error", ParallelizeError(f"{type(exc).__name__}: {exc}"))
    workers.finish(sent)
    return outcome  # rank 0 raises the exception itself


def parallelize(
    module_or_module_class: torch.nn.Module | type[torch.nn.Module],
    dummy_forward_args: dict[str, Any],
    pas_policy: str | PolicyFn,
    compute_config: ComputeConfig,
    *,
    gen_savedir: str | os.PathLike[str] = "./.nnscaler",
    reuse: ReuseType | str = ReuseType.MATCH,
    instance_name: str | None = None,
    load_module: bool = True,
    module_dtype: torch.dtype | None = None,
    module_fn: Callable[[], torch.nn.Module] | None = None,
    init_module_params: bool = True,
    broadcast_strategy: str | BroadcastGenFilesStrategy = "none",
) -> Any:
    """Turn a module (or module class) into a [`ParallelModule`][nnscaler.ParallelModule].

    Traces ``forward`` on ``dummy_forward_args`` (keyed by argument name), calls the policy
    (a registered name or ``(graph, compute_config) -> graph``), checks that every op was
    placed, and generates ``gencode{rank}.py`` for every one of ``compute_config.
    runtime_ngpus`` ranks under ``gen_savedir`` (reused according to ``reuse``). When
    ``torch.distributed`` is initialized, rank 0 generates and the other ranks wait.

    Returns the ParallelModule class when a class was given, an instance (built with
    ``init_params=init_module_params``) when a module object was given, and None when
    ``load_module`` is False (compiling needs no process group). See
    ``docs/parallelize.md``.
    """
    # -- checks that every rank makes identically (so all fail together) --
    is_class = _check_module_arg(module_or_module_class, module_fn, module_dtype)
    if not isinstance(compute_config, ComputeConfig):
        raise TypeError(f"compute_config must be a nnscaler.ComputeConfig, got "
                        f"{type(compute_config).__name__}")
    reuse = ReuseType.parse(reuse, "reuse")
    strategy = BroadcastGenFilesStrategy.parse(broadcast_strategy, "broadcast_strategy")
    paths.check_instance_name(instance_name)
    for name, value in (("load_module", load_module), ("init_module_params", init_module_params)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    _check_forward_signature(module_or_module_class, dummy_forward_args)
    policy_fn = _resolve_policy(pas_policy)
    distributed, rank, world_size = _dist_info()
    _check_launch(compute_config, load_module, strategy, distributed, world_size)
    module_class = module_or_module_class if is_class else type(module_or_module_class)
    outdir = paths.outdir_for(gen_savedir, module_class, instance_name)

    # -- generation: rank 0 (or this process alone), holding the instance's lock from
    # the reuse decision until every rank has loaded (two jobs sharing gen_savedir) --
    with contextlib.ExitStack() as held:
        outcome: Any = None
        if rank == 0:
            outcome = _generate_on_rank0(
                held, distributed, gen_savedir, outdir,
                _Generator(module_or_module_class, is_class, dummy_forward_args, pas_policy,
                           policy_fn, compute_config, outdir, reuse, instance_name,
                           module_fn, module_dtype))
        if distributed:
            outcome = _share_outcome(outcome)
            if outcome[0] == "error":
                exc = outcome[1]
                if rank != 0 and hasattr(exc, "add_note"):
                    exc.add_note(f"(raised on rank 0, which generates the code; this is rank "
                                 f"{rank})")
                raise exc
            if outcome[1] and strategy is not BroadcastGenFilesStrategy.NONE:
                broadcast_gen_files(outdir, strategy)
            dist.barrier()

        if not load_module:
            return None
        loaded = _load(outdir, rank, is_class, init_module_params, outcome[2])
        if not is_class:  # the module's mode carries over (nnScaler: an eval() module
            loaded.train(module_or_module_class.training)  # gives an eval() one)
        return loaded


def _check_launch(compute_config: ComputeConfig, load_module: bool,
                  strategy: BroadcastGenFilesStrategy, distributed: bool,
                  world_size: int) -> None:
    """Loading the module needs one process per runtime rank, and broadcasting the files
    needs torch.distributed: checked before anything is generated."""
    if load_module:
        if distributed and world_size != compute_config.runtime_ngpus:
            raise ParallelizeError(
                f"load_module=True: compute_config.runtime_ngpus ({compute_config.runtime_ngpus}) "
                f"must equal the number of processes (torch.distributed world size "
                f"{world_size}); launch {compute_config.runtime_ngpus} processes, change "
                f"runtime_ngpus, or compile only with load_module=False"
            )
        if not distributed and compute_config.runtime_ngpus != 1:
            raise ParallelizeError(
                f"load_module=True needs torch.distributed with runtime_ngpus="
                f"{compute_config.runtime_ngpus} processes, but it is not initialized; launch "
                f"with torchrun (and call torch.distributed.init_process_group or "
                f"nnscaler.runtime.init_distributed first), or compile only with "
                f"load_module=False"
            )
    if strategy is not BroadcastGenFilesStrategy.NONE and not distributed:
        raise ParallelizeError(
            f"broadcast_strategy={strategy.value!r} sends files over torch.distributed, which "
            f"is not initialized; use broadcast_strategy='none' outside torchrun"
        )


def _generate_on_rank0(held: contextlib.ExitStack, distributed: bool,
                       gen_savedir: str | os.PathLike[str], outdir: Path,
                       gen: _Generator) -> tuple[Any, ...]:
    """Rank 0 (or this process alone) generates the files under the instance's lock,
    which ``held`` keeps until every rank has loaded (two jobs sharing gen_savedir).
    Returns ``('ok', generated, digests)``, or ``('error', exception)`` under
    torch.distributed (shared with the other ranks, then raised); alone, it raises."""
    try:
        paths.check_writable(gen_savedir)
        held.enter_context(locks.instance_lock(outdir))
        with workers._ranks_listening() if distributed else contextlib.nullcontext():
            generated = gen.run()
        return ("ok", generated, _code_digests(outdir))
    except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised
        if not distributed:
            raise
        return ("error", e)


def _code_digests(outdir: Path) -> dict[str, str]:
    """The sha256 of every ``gencode*.py`` as recorded in ``config.json`` (checked
    against the files by the reuse decision, or just written)."""
    return gendir.code_digests(gendir.read_config(outdir))


def _load(outdir: Path, rank: int, is_class: bool, init_module_params: bool,
          digests: dict[str, str]) -> Any:
    """Load this rank's generated module, after checking that its file is the one rank 0
    generated or checked (sha256); every rank fails together if one cannot load."""
    from nnscaler.codegen import load_generated_class

    name = gendir.gencode_name(rank)
    path = outdir / name
    status = "ok"
    if not path.is_file():
        status = "missing"
    elif digests.get(name) != gendir.file_digest(path):
        status = "changed"
    everyone = [status]
    if dist.is_available() and dist.is_initialized():  # fail together, not hang in __init__
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, status)
    missing = [r for r, s in enumerate(everyone) if s == "missing"]
    changed = [r for r, s in enumerate(everyone) if s == "changed"]
    if missing:
        where = f"{str(path)!r} does not exist" if status == "missing" else (
            f"their {gendir.gencode_name(missing[0])} is not in their gen_savedir")
        raise ParallelizeError(
            f"rank(s) {missing} cannot load their generated code: {where}. With "
            f"broadcast_strategy='none' the files rank 0 generated must reach every node (a "
            f"shared gen_savedir, or copy them); or pass broadcast_strategy='all'"
        )
    if changed:
        where = (f"{str(path)!r} (sha256 {gendir.file_digest(path)[:12]}...)"
                 if status == "changed" else f"their {gendir.gencode_name(changed[0])}")
        raise GenFilesChangedError(
            f"rank(s) {changed} will not run their generated code: {where} is not the file "
            f"rank 0 generated or checked (sha256 {digests.get(name, '?')[:12]}... in "
            f"{gendir.CONFIG_FILE}); it was changed after generation. Fix: regenerate with "
            f"reuse='override', or make every node's copy the one in rank 0's gen_savedir"
        )
    cls = load_generated_class(outdir, rank)
    if is_class:
        return cls
    return cls(init_params=init_module_params)
