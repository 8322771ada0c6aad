"""A cache of process groups, keyed by the sorted tuple of their global ranks.

``torch.distributed.new_group`` is collective over the *whole* world: every rank must
call it, for every group, in the same order, even ranks that are not members; otherwise
the program hangs. So groups are created in one place:

- `ensure_groups` takes a list of rank tuples and creates the missing groups in
  list order. **Every rank calls it with the same list** (generated code does so once,
  at start-up, with the groups of all its adapters; `nnscaler.runtime.plan_groups`
  lists those of a layout plan).
- `get_group` only looks a group up. A group that was never ensured raises
  `GroupError` instead of hanging; ``get_group(ranks, create=True)`` creates it,
  and is then itself collective: every rank must make the same call at the same point.

A single-rank group needs no communicator: its entry is ``None`` and the collectives
treat it as a local operation. The group of all ranks is the default (world) group.
Neither needs `ensure_groups`: `get_group` returns them at any time.
The cache is dropped when the default process group changes (destroyed and started
again).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

from nnscaler.errors import GroupError
from nnscaler.runtime.device import collective_timeout

__all__ = [
    "GroupError",
    "clear_groups",
    "created_groups",
    "ensure_groups",
    "get_group",
    "group_key",
]


_cache: dict[tuple[int, ...], Any] = {}
_order: list[tuple[int, ...]] = []
_world: list[Any] = [None]


def _world_size() -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise GroupError(
            "process groups need a running default process group, but "
            "torch.distributed is not initialized. Fix: call "
            "nnscaler.runtime.init_distributed() (or torch.distributed.init_process_group) "
            "first."
        )
    world = dist.group.WORLD
    if _world[0] is not world:
        _cache.clear()
        _order.clear()
        _world[0] = world
    return dist.get_world_size()


def group_key(ranks: Iterable[int]) -> tuple[int, ...]:
    """The cache key of ``ranks``: sorted, each an int in ``[0, world_size)``, no repeats."""
    world_size = _world_size()
    items = list(ranks)
    for r in items:
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 0 <= r < world_size:
            raise GroupError(
                f"process group ranks must be ints in [0, {world_size}) (the world size is "
                f"{world_size}), got {r!r} in {items!r}. Fix: list global ranks of this job."
            )
    key = tuple(sorted(int(r) for r in items))
    if not key or len(set(key)) != len(key):
        raise GroupError(
            f"a process group needs at least one rank and no repeats, got {items!r}. "
            f"Fix: list each global rank once."
        )
    return key


def ensure_groups(rank_tuples: Iterable[Sequence[int]]) -> None:
    """Create, in list order, every group of ``rank_tuples`` not created yet.

    Collective: every rank must call it with the same list (same groups, same order).
    Duplicates (in any rank order) are created once. When it returns on any rank, every
    new group is connected on all of its members (it ends with a barrier of the world).
    """
    keys = [group_key(ranks) for ranks in rank_tuples]
    world_size = _world_size()
    connected = False
    for key in keys:
        if key in _cache:
            continue
        if len(key) == 1:
            _cache[key] = None
        elif len(key) == world_size:
            _cache[key] = dist.group.WORLD
        else:
            # the bound init_distributed set (None: torch's default)
            _cache[key] = dist.new_group(list(key), timeout=collective_timeout())
            connected = True
        _order.append(key)
    if connected:
        # new_group can return on one member before another has finished its handshake
        # with it (gloo); a member that then tore the group down (it had nothing left to
        # do) would fail the other's connection. Every rank creates the same groups, so
        # every rank takes this barrier: past it, every group is connected everywhere.
        dist.barrier()


def get_group(ranks: Iterable[int], *, create: bool = False) -> Any:
    """The process group of ``ranks`` (any order), or ``None`` for a single rank.

    Raises `GroupError` if the group was not created by `ensure_groups`,
    unless ``create=True``, which creates it here; that makes this call collective:
    every rank of the world must call ``get_group`` with the same ranks at the same point.
    """
    key = group_key(ranks)
    if key in _cache:
        return _cache[key]
    if len(key) == 1:
        return None
    if len(key) == dist.get_world_size():
        return dist.group.WORLD
    if not create:
        known = ", ".join(map(str, _order)) or "none"
        raise GroupError(
            f"no process group for ranks {key} was created (created so far: {known}). "
            f"Groups must be created by every rank in the same order, or the job hangs. "
            f"Fix: call nnscaler.runtime.ensure_groups([...]) on every rank with the same "
            f"list, including {key}, before communicating (plan_groups(plan) lists a "
            f"plan's groups), or call get_group({list(key)}, create=True) on every rank."
        )
    ensure_groups([key])
    return _cache[key]


def clear_groups() -> None:
    """Forget every cached group (the groups themselves stay alive in torch)."""
    _cache.clear()
    _order.clear()
    _world[0] = None


def created_groups() -> list[tuple[int, ...]]:
    """The keys of the cached groups, in creation order."""
    _world_size()
    return list(_order)
