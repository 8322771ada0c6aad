"""``build_optimizer``: an optimizer over parallel modules, patched for distributed training.

The optimizer gets every [`ParallelModule`][nnscaler.ParallelModule]'s
``parameters_for_optimizer()`` (ZeRO shards when ``use_zero``) plus the parameters of the
rest of the model, which run plain data parallel across scale units through
``optimizer._non_parallel_module_reducer``. Patched in:

- before ``step()``: `sync_shard_grad` (every reducer sums its gradients, once: the
  gradients count as synced until ``zero_grad()`` or the next backward that adds to
  them, so ``clip_gnorm()`` after ``step()`` does not sum them again, as in nnScaler);
- after ``step()``: every module's ``gather_params()`` (ZeRO: all-gather the shards);
- ``zero_grad()`` also zeroes the modules' gradient buffers;
- utilities ``sync_shard_grad()``, ``scale_grads(factor)``, ``clip_gnorm(max_norm)``,
  ``register_reducer_pre_hook(fn)``, ``register_reducer_post_hook(fn)``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from nnscaler.errors import OptimizerError
from nnscaler.parallel.config import ComputeConfig
from nnscaler.runtime.module import ParallelModule

__all__ = ["OptimizerError", "build_optimizer"]

OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)

ReducerHookFn = Callable[[Any, torch.Tensor], Any]


def _parallel_modules(module: torch.nn.Module) -> list[Any]:
    return [m for m in module.modules() if isinstance(m, ParallelModule)]


def _reducer_copies(reducer: Any, times: int = 1) -> list[tuple[torch.nn.Parameter, int]]:
    """The tensors ``reducer`` hands to the optimizer, each with how many ranks hold an
    identical copy of it once gradients are synced (for norms counted once)."""
    ranks = len(reducer.ranks)
    if getattr(reducer, "zero", False):
        return [(b.shard_param, times * ranks // b.nshards)
                for b in reducer.buckets if b.shard_param is not None]
    return [(p, times * ranks) for p in reducer.params]


class _OptimizerState:
    """What the patches of one optimizer share."""

    def __init__(self, parallel_modules: list[Any], reducer: Any,
                 copies: dict[int, int]) -> None:
        self.parallel_modules = parallel_modules
        self.reducer = reducer
        self.copies = copies
        self.synced = False

    def reducers(self) -> list[Any]:
        out = [r for pm in self.parallel_modules for r in pm.reducers]
        if self.reducer is not None:
            out.append(self.reducer)
        return out


def _state(optimizer: torch.optim.Optimizer) -> _OptimizerState:
    state = getattr(optimizer, "_nnscaler_state", None)
    if state is None:
        raise OptimizerError("this optimizer was not built by nnscaler.build_optimizer")
    return state


def sync_shard_grad(self: torch.optim.Optimizer) -> None:
    """Sum the gradients over their holders (every reducer); once per step.

    Called by the pre-step hook; call it yourself to read gradients before ``step()``
    (they are unreduced until then) or when ``step(closure)`` is used.
    """
    st = _state(self)
    if st.synced:
        return
    for pm in st.parallel_modules:
        pm.sync_grad()
    if st.reducer is not None:
        st.reducer.sync_grads()
    st.synced = True


def _optimizer_grads(self: torch.optim.Optimizer) -> list[tuple[torch.Tensor, int]]:
    st = _state(self)
    out = []
    for group in self.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                out.append((p.grad, st.copies.get(id(p), 1)))
    return out


def scale_grads(self: torch.optim.Optimizer, factor: float) -> None:
    """Multiply every gradient the optimizer will use by ``factor`` (after
    `sync_shard_grad`: before it, the gradients are not reduced yet)."""
    with torch.no_grad():
        for grad, _ in _optimizer_grads(self):
            grad.mul_(factor)


def clip_gnorm(self: torch.optim.Optimizer, max_norm: float | None = None) -> torch.Tensor:
    """The global L2 norm of the gradients; with ``max_norm``, scale them so it is at most
    ``max_norm``. Syncs the gradients first if needed. Collective: every rank calls it.

    Every element counts once, however many ranks hold a copy of it: a piece replicated on
    several ranks (data parallel replicas, replicated weights inside a scale unit, ZeRO
    shards replicated across groups) is divided by its number of copies before the sum
    over ranks.
    """
    sync_shard_grad(self)
    grads = _optimizer_grads(self)
    device = grads[0][0].device if grads else _default_device()
    local = torch.zeros((), dtype=torch.float64, device=device)
    for grad, copies in grads:
        local += grad.detach().double().pow(2).sum() / copies
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(local)
    total = local.sqrt().float()
    if max_norm is not None:
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for grad, _ in grads:
                    grad.mul_(coef)
    return total


def _default_device() -> torch.device:
    from nnscaler.runtime import current_device

    return current_device()


def register_reducer_pre_hook(self: torch.optim.Optimizer, fn: ReducerHookFn) -> None:
    """``fn(reducer, grad)`` runs on every bucket's gradient before its reduction, for
    every reducer (the parallel modules' and ``_non_parallel_module_reducer``)."""
    for reducer in _state(self).reducers():
        reducer.register_pre_hook(functools.partial(fn, reducer))


def register_reducer_post_hook(self: torch.optim.Optimizer, fn: ReducerHookFn) -> None:
    """``fn(reducer, grad)`` runs on every bucket's reduced gradient (the ZeRO shard with
    ``use_zero``), for every reducer."""
    for reducer in _state(self).reducers():
        reducer.register_post_hook(functools.partial(fn, reducer))


def _layout(pms: list[Any]) -> tuple[int, int]:
    """The ``(plan_ngpus, runtime_ngpus)`` the parallel modules share."""
    shapes = sorted({(int(pm.plan_ngpus), int(pm.runtime_ngpus)) for pm in pms})
    if len(shapes) > 1:
        raise OptimizerError(
            f"the parallel modules of one model must share plan_ngpus and runtime_ngpus (one "
            f"data-parallel layout for the rest of the model), got (plan_ngpus, "
            f"runtime_ngpus) = {shapes}; parallelize them with the same numbers"
        )
    return shapes[0]


def build_optimizer(
    module: torch.nn.Module,
    optimizer_fn: type[OptimizerT] | Callable[..., OptimizerT],
    compute_config: ComputeConfig | None = None,
    **kwargs: Any,
) -> OptimizerT:
    """An optimizer over ``module`` (which is or holds ParallelModules), patched for
    distributed training; ``optimizer_fn(params, **kwargs)`` builds it.

    ``compute_config`` configures the reducer of the parameters outside the parallel
    modules (ZeRO, async, bucket size); its ``plan_ngpus`` and ``runtime_ngpus`` must be the
    parallel modules'. None uses the defaults. See ``docs/parallelize.md``.
    """
    pms = _trainable_parallel_modules(module, optimizer_fn)
    np_cfg = _config_for(pms, compute_config)
    reducer, copies = _reducers(module, pms, np_cfg)
    params = [p for pm in pms for p in pm.parameters_for_optimizer()]
    if reducer is not None:
        params += reducer.parameters_for_optimizer()
    optimizer = optimizer_fn(params, **kwargs)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer_fn must return a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    _check_elementwise(optimizer, pms, reducer)
    state = _OptimizerState(pms, reducer, copies)
    _patch(optimizer, state)
    _reset_sync_on_new_grads(module, state)
    if pms:
        # state_dict() records which tensor each entry is, so checkpoints merge whatever
        # the parameter groups, and load_state_dict() checks it (nnscaler.checkpoint)
        from nnscaler.checkpoint import track_optimizer

        track_optimizer(optimizer, module)
    return optimizer


#: torch optimizers whose step needs whole tensors (a factored or matrix state, a line
#: search over all parameters): wrong on ZeRO's flat shards.
WHOLE_TENSOR_OPTIMIZERS = tuple(getattr(torch.optim, n) for n in ("Adafactor", "LBFGS", "Muon")
                                if hasattr(torch.optim, n))


def _check_elementwise(optimizer: torch.optim.Optimizer, pms: Sequence[ParallelModule],
                       reducer: Any) -> None:
    """ZeRO hands the optimizer flat shards cut across parameters: refuse an optimizer
    known to need whole tensors."""
    reducers = [r for pm in pms for r in pm.reducers] + ([reducer] if reducer else [])
    stages = sorted({r.stage for r in reducers if r.zero})
    if stages and isinstance(optimizer, WHOLE_TENSOR_OPTIMIZERS):
        raise OptimizerError(
            f"{type(optimizer).__name__} needs whole tensors in its step (a factored or "
            f"matrix state, or a search over all parameters), but ZeRO stage {stages[-1]} "
            f"gives the optimizer flat shards of this rank's share of several parameters; "
            f"use an elementwise optimizer (SGD, Adam, AdamW, ...) or zero_stage=0"
        )


def _trainable_parallel_modules(module: torch.nn.Module, optimizer_fn: Any) -> list[ParallelModule]:
    """The ParallelModules of ``module``, after checking the arguments of build_optimizer."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"build_optimizer takes the model (a torch.nn.Module), got "
                        f"{type(module).__name__}")
    if not callable(optimizer_fn):
        raise TypeError(f"optimizer_fn must be an optimizer class or a factory "
                        f"(params, **kwargs) -> optimizer, got {optimizer_fn!r}")
    pms = _parallel_modules(module)
    if not pms:
        raise OptimizerError(
            f"{type(module).__qualname__} holds no ParallelModule: build_optimizer is for "
            f"models made with nnscaler.parallelize; call parallelize first (or use a plain "
            f"torch optimizer)"
        )
    for pm in pms:
        if pm.inference_only:
            raise OptimizerError(
                f"{type(pm).__qualname__} was generated with inference_only=True and cannot "
                f"be trained; parallelize it with inference_only=False"
            )
    return pms


def _config_for(pms: Sequence[ParallelModule], compute_config: ComputeConfig | None
                ) -> ComputeConfig:
    """The config of the reducer outside the parallel modules: the one given (checked
    against the modules' layout), else the defaults for that layout."""
    plan_ngpus, runtime_ngpus = _layout(pms)
    if compute_config is None:
        return ComputeConfig(plan_ngpus=plan_ngpus, runtime_ngpus=runtime_ngpus)
    if not isinstance(compute_config, ComputeConfig):
        raise TypeError(f"compute_config must be a ComputeConfig or None, got "
                        f"{type(compute_config).__name__}")
    compute_config = as_chosen(compute_config, pms, plan_ngpus)
    if (compute_config.plan_ngpus, compute_config.runtime_ngpus) != (plan_ngpus, runtime_ngpus):
        raise OptimizerError(
            f"compute_config has plan_ngpus={compute_config.plan_ngpus}, runtime_ngpus="
            f"{compute_config.runtime_ngpus}, but the parallel modules were generated for "
            f"plan_ngpus={plan_ngpus}, runtime_ngpus={runtime_ngpus}; pass the "
            f"config they were parallelized with, or None"
        )
    return compute_config


def as_chosen(config: ComputeConfig, pms: Sequence[ParallelModule], plan_ngpus: int
               ) -> ComputeConfig:
    """``config`` with what ``parallelize`` chose for its ``'auto'`` fields: the unit
    size and the ZeRO stage the parallel modules were generated with."""
    from nnscaler.config import AUTO, ReducerConfig

    auto_unit = config.plan_ngpus == AUTO
    stage = None
    if config.zero_stage == AUTO:
        stage = ReducerConfig.from_options(pms[0].reducer_config).zero_stage
    if not auto_unit and stage is None:
        return config
    return config.resolved(plan_ngpus if auto_unit else None, zero_stage=stage)


def _reducers(module: torch.nn.Module, pms: Sequence[ParallelModule], np_cfg: ComputeConfig
              ) -> tuple[Any, dict[int, int]]:
    """The reducer of the trainable parameters outside the parallel modules (None when
    there are none) and, by ``id``, how many devices hold a copy of each parameter."""
    in_pm = {id(p) for pm in pms for p in pm.parameters()}
    rest = [p for p in _unique(module.parameters()) if id(p) not in in_pm and p.requires_grad]
    reducer = None
    copies: dict[int, int] = {}
    if rest:
        from nnscaler.runtime.reducer import Reducer

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        reducer = Reducer(
            rest, np_cfg.replica_ranks(rank), bucket_cap_mb=np_cfg.bucket_cap_mb,
            async_op=np_cfg.use_async_reducer, zero=np_cfg.use_zero,
            zero_ngroups=np_cfg.zero_ngroups, zero_stage=np_cfg.reducer.zero_stage,
        )
        # replicated on every device of a scale unit, summed across units
        copies.update((id(p), n) for p, n in _reducer_copies(reducer, np_cfg.plan_ngpus))
    for pm in pms:
        for r in pm.reducers:
            copies.update((id(p), n) for p, n in _reducer_copies(r))
    return reducer, copies


def _patch(optimizer: torch.optim.Optimizer, state: _OptimizerState) -> None:
    """Give ``optimizer`` the nnscaler methods and hooks: gradients synced before a step,
    parameters gathered after it, the modules' gradients zeroed with its own."""
    optimizer._nnscaler_state = state  # type: ignore[attr-defined]
    optimizer._non_parallel_module_reducer = state.reducer  # type: ignore[attr-defined]
    for fn in (sync_shard_grad, scale_grads, clip_gnorm, register_reducer_pre_hook,
               register_reducer_post_hook):
        setattr(optimizer, fn.__name__, types.MethodType(fn, optimizer))

    def pre_step(opt: torch.optim.Optimizer, args: Any, kw: Any) -> None:
        sync_shard_grad(opt)

    def post_step(opt: torch.optim.Optimizer, args: Any, kw: Any) -> None:
        for pm in state.parallel_modules:
            pm.gather_params()
        if state.reducer is not None:
            state.reducer.gather_params()

    optimizer.register_step_pre_hook(pre_step)
    optimizer.register_step_post_hook(post_step)
    original_zero_grad = optimizer.zero_grad

    @functools.wraps(original_zero_grad)
    def zero_grad(set_to_none: bool = True) -> None:
        original_zero_grad(set_to_none=set_to_none)
        for pm in state.parallel_modules:
            pm.zero_grad()
        if state.reducer is not None:
            state.reducer.zero_grad()
        state.synced = False

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


def _reset_sync_on_new_grads(module: torch.nn.Module, state: _OptimizerState) -> None:
    """The synced flag is cleared when a new gradient is accumulated into any parameter
    (a backward after the sync; nnScaler clears it at the next forward), not after
    ``step()``: a ``clip_gnorm()`` called after the step would otherwise sum the
    already-summed gradients again. Whatever runs the backward (a call of the module,
    ``train_step``, a pipeline schedule) is covered."""

    def clear(param: torch.Tensor) -> None:
        state.synced = False

    for p in _unique(module.parameters()):
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(clear)


def _unique(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
