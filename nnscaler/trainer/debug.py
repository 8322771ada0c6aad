"""``TrainerArgs.debug.check_gradient_sync_cross_devices``: after the gradients are
reduced, every rank that holds a copy of a parameter must hold the same gradient.

Each reducer owns parameters replicated over its ``ranks`` (the same position of every
scale unit, or every device of a unit for replicated weights); once summed, their
gradients are equal on all of them, bitwise. A difference means a rank reduced another
set of gradients (a missed or doubled reduction, a hook that scaled one rank only): the
check raises naming the parameter, the ranks and the largest difference. It gathers
every gradient to every rank, so it is for finding bugs on small runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nnscaler.trainer.errors import TrainerError

__all__ = ["check_gradient_sync"]


def _reducers(model: torch.nn.Module, optimizer: Any) -> list[Any]:
    from nnscaler.runtime.module import ParallelModule

    out = [r for m in model.modules() if isinstance(m, ParallelModule) for r in m.reducers]
    extra = getattr(optimizer, "_non_parallel_module_reducer", None)
    if extra is not None:
        out.append(extra)
    return out


def check_gradient_sync(model: torch.nn.Module, optimizer: Any) -> int:
    """Raise `TrainerError` if two holders of one parameter hold different reduced
    gradients (collective: every rank calls it). Returns the parameters compared here."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0
    reducers = _reducers(model, optimizer)
    if any(getattr(r, "zero", False) for r in reducers):
        raise TrainerError(
            "debug.check_gradient_sync_cross_devices compares each parameter's whole reduced "
            "gradient across its holders; with use_zero every rank holds only its shard of "
            "it. Fix: turn the check off, or run it without use_zero.")
    mine = [(tuple(r.ranks), [None if p.grad is None else p.grad.detach().cpu()
                              for p in r.params]) for r in reducers]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    rank = dist.get_rank()
    checked = 0
    for key, grads in _by_ranks(mine).items():
        for other in key[0]:
            if other == rank:
                continue
            theirs = _by_ranks(everyone[other]).get(key)
            if theirs is None or len(theirs) != len(grads):
                raise TrainerError(
                    f"debug.check_gradient_sync_cross_devices: rank {other} has no reducer "
                    f"over ranks {list(key[0])} with the {len(grads)} parameters that rank "
                    f"{rank}'s has; the ranks do not share their parameters as planned.")
            for j, (a, b) in enumerate(zip(grads, theirs)):
                checked += 1
                if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                    diff = "one is None" if a is None or b is None else \
                        f"max |difference| {float((a - b).abs().max()):.3g}"
                    raise TrainerError(
                        f"debug.check_gradient_sync_cross_devices: parameter {j} of the "
                        f"reducer over ranks {list(key[0])} has a different reduced gradient "
                        f"on rank {rank} and rank {other} ({diff}); the gradients were not "
                        f"reduced alike on every holder.")
    return checked


def _by_ranks(entries: list[Any]) -> dict[tuple[tuple[int, ...], int], list[Any]]:
    """Each reducer's gradients under (its ranks, how many reducers over the same ranks
    came before it): the holders of one parameter list their reducers alike."""
    seen: dict[tuple[int, ...], int] = {}
    out = {}
    for ranks, grads in entries:
        n = seen.get(ranks, 0)
        seen[ranks] = n + 1
        out[(ranks, n)] = grads
    return out
