"""Which parallel-module tensor each entry of an optimizer's state belongs to.

A torch optimizer's ``state_dict()`` numbers its tensors ``0, 1, ...`` in the order of its
parameter groups and says nothing about what they are. For a model made by
[`nnscaler.parallelize`][nnscaler.parallelize] the tensors are the ``parameters_for_optimizer()`` of
its parallel modules: parameter pieces, or flat ZeRO shards of reducer buckets. Merging needs
to know which is which:

- by default the order is the one [`nnscaler.build_optimizer`][nnscaler.build_optimizer] uses: every
  parallel module (in ``model.modules()`` order), its ``parameters_for_optimizer()`` in order;
- an optimizer that orders them otherwise (several parameter groups picked by a rule,
  e.g. no weight decay for biases) is described exactly by the ``"nnscaler"`` entry that
  `track_optimizer` adds to its ``state_dict()``.
  [`deduped_state_dict`][nnscaler.deduped_state_dict] adds it too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nnscaler.checkpoint.errors import (
    CheckpointError,
    OptimizerStateError,
    StateDictMismatchError,
)
from nnscaler.runtime.state import FORMAT, attr_record, descriptor_map, optimizer_entry_id

__all__ = [
    "OPTIMIZER_KEY",
    "is_scalar",
    "optimizer_metadata",
    "parallel_modules",
    "track_optimizer",
    "unmergeable",
]

#: The key `track_optimizer` adds to an optimizer's state dict.
OPTIMIZER_KEY = "nnscaler"
_TRACKED = "_nnscaler_checkpoint_tracked"


def parallel_modules(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(state dict prefix, module)`` of every ParallelModule in ``module``, in
    ``named_modules()`` order (the order of their entries in a state dict)."""
    from nnscaler.runtime.module import ParallelModule

    return [(f"{name}." if name else "", m) for name, m in module.named_modules()
            if isinstance(m, ParallelModule)]


def optimizer_name(optimizer: Any) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def tensor_entries(pms: list[Any]) -> dict[int, tuple[int, int, str, list[int]]]:
    """``id(tensor) -> (module index, position in its parameters_for_optimizer(), entry id,
    shape)`` for every tensor the parallel modules hand to an optimizer."""
    out: dict[int, tuple[int, int, str, list[int]]] = {}
    for i, pm in enumerate(pms):
        records = {a: attr_record(a, m) for a, m in pm.fullmap.items()}
        descs = descriptor_map(pm)
        for k, t in enumerate(pm.parameters_for_optimizer()):
            out[id(t)] = (i, k, optimizer_entry_id(str(i), descs[id(t)], records),
                          list(t.shape))
    return out


def optimizer_metadata(pms: list[Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The ``"nnscaler"`` entry of an optimizer state dict: for every tensor, in the
    optimizer's order, ``[module index, position, entry id, shape]`` (None for a tensor of
    no parallel module)."""
    where = tensor_entries(pms)
    params: list[Any] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = where.get(id(p))
            params.append(None if entry is None else [entry[0], entry[1], entry[2], entry[3]])
    return {"format": FORMAT, "optimizer": optimizer_name(optimizer), "params": params}


def _pms_of(optimizer: torch.optim.Optimizer, module: torch.nn.Module | None) -> list[Any]:
    if module is not None:
        return [pm for _, pm in parallel_modules(module)]
    state = getattr(optimizer, "_nnscaler_state", None)
    pms = getattr(state, "parallel_modules", None)
    if pms is None:
        raise CheckpointError(
            f"track_optimizer: {optimizer_name(optimizer)} was not built by "
            f"nnscaler.build_optimizer, so it does not know its parallel modules; pass the "
            f"model: track_optimizer(optimizer, model)"
        )
    return list(pms)


def track_optimizer(optimizer: torch.optim.Optimizer,
                    module: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """Make ``optimizer.state_dict()`` say which parallel-module tensor each entry is
    (the ``"nnscaler"`` key), and ``optimizer.load_state_dict`` check it.

    Needed for merging only when the optimizer orders its tensors differently from
    [`nnscaler.build_optimizer`][nnscaler.build_optimizer] (several parameter groups picked by a
    rule); harmless otherwise. ``module`` is the model, needed when the optimizer was not made by
    ``build_optimizer``. Calling it twice does nothing more. Returns the optimizer.
    """
    if getattr(optimizer, _TRACKED, False):
        return optimizer
    pms = _pms_of(optimizer, module)

    def post_hook(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict[OPTIMIZER_KEY] = optimizer_metadata(pms, opt)
        return state_dict

    def pre_hook(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get(OPTIMIZER_KEY)
        if isinstance(saved, Mapping) and "params" in saved:
            check_optimizer_metadata(saved, optimizer_metadata(pms, opt),
                                     f"{optimizer_name(opt)}.load_state_dict")

    optimizer.register_state_dict_post_hook(post_hook)
    optimizer.register_load_state_dict_pre_hook(pre_hook)
    setattr(optimizer, _TRACKED, True)
    return optimizer


def check_optimizer_metadata(saved: Mapping[str, Any], current: Mapping[str, Any],
                             where: str) -> None:
    """The first optimizer entry whose tensor differs is an error naming both shapes."""
    theirs, mine = list(saved.get("params", [])), list(current["params"])
    fix = ("Load each rank's own optimizer state into the optimizer of the same plan and "
           "rank; to change the plan, merge with nnscaler.merge_state_dicts and load with "
           "nnscaler.load_merged_state_dicts.")
    for i in range(max(len(theirs), len(mine))):
        a = theirs[i] if i < len(theirs) else None
        b = mine[i] if i < len(mine) else None
        same = (a is None and b is None) or (a is not None and b is not None
                                             and a[2] == b[2] and list(a[3]) == list(b[3]))
        if not same:
            what_a = "nothing" if a is None else a[2].split("|", 2)[-1]
            what_b = "nothing" if b is None else b[2].split("|", 2)[-1]
            raise StateDictMismatchError(
                f"{where}: the optimizer state belongs to another model or plan; the first "
                f"mismatching entry is {i}: the state dict has {what_a} (shape "
                f"{tuple(a[3]) if a else 'absent'}), this optimizer has {what_b} (shape "
                f"{tuple(b[3]) if b else 'absent'}). {fix}"
            )


def is_scalar(value: Any) -> bool:
    """Whether an optimizer state value is one value for the whole parameter (a step
    count, a 0-dim tensor), not one per element."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return value is None or isinstance(value, (bool, int, float, str))


def unmergeable(opt: str, key: Any, value: Any, what: str, shape: Sequence[int]
                ) -> OptimizerStateError:
    """The error for optimizer state ``key`` of ``what`` that is neither elementwise
    nor a scalar (it cannot be merged or cut)."""
    got = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
           else f"a {type(value).__name__}")
    return OptimizerStateError(
        f"{opt} keeps the state {key!r} of {what} as {got}, neither one value per element "
        f"(shape {tuple(shape)}) nor a scalar: its state cannot be merged or resharded. "
        f"Merging supports elementwise optimizers (Adam, AdamW, SGD with momentum, "
        f"Adagrad, RMSprop, ...); save per-rank state dicts for this optimizer (they reload "
        f"into the same plan), or train with an elementwise optimizer"
    )
