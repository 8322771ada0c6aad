"""ZeRO stage 1 helpers: how data-parallel ranks are split into sharding groups.

With ``zero_ngroups = k`` the ``n`` data-parallel ranks (in the order given) are cut into
``k`` contiguous *zero groups* of ``n // k`` ranks. Optimizer state is sharded inside each
zero group and replicated across groups. The ranks holding the same shard index in every
group form a *cross group*; after a reduce-scatter inside the zero group, the shard is
all-reduced over the cross group so that it holds the sum over all ``n`` replicas.

``zero_ngroups = 1`` shards over all ranks; ``zero_ngroups = n`` degenerates to no sharding
(every zero group has one rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from nnscaler.runtime.groups import GroupError, get_group


@dataclass(frozen=True)
class ZeroGroups:
    """The zero group and cross group of one rank."""

    zero_ranks: tuple[int, ...]
    """Ranks sharing one copy of the optimizer state (shards are split among them)."""
    cross_ranks: tuple[int, ...]
    """Ranks holding the same shard index, one per zero group."""
    shard_index: int
    """This rank's position inside its zero group (which shard it owns)."""

    @property
    def zero_size(self) -> int:
        return len(self.zero_ranks)


def zero_groups(ranks: list[int] | tuple[int, ...], ngroups: int, rank: int) -> ZeroGroups:
    """Split ``ranks`` (sorted first: a torch group ranks its members in ascending order)
    into ``ngroups`` zero groups and return ``rank``'s groups."""
    ranks = tuple(sorted(ranks))
    if ngroups < 1:
        raise ValueError(f"zero_ngroups must be >= 1, got {ngroups}; use 1 to shard over all ranks")
    if len(ranks) % ngroups != 0:
        raise ValueError(
            f"zero_ngroups must divide the number of data-parallel ranks: {len(ranks)} ranks "
            f"cannot be split into {ngroups} groups; pick a divisor of {len(ranks)}"
        )
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not one of the data-parallel ranks {list(ranks)}")
    size = len(ranks) // ngroups
    pos = ranks.index(rank)
    group_id, shard_index = divmod(pos, size)
    zero_ranks = ranks[group_id * size : (group_id + 1) * size]
    cross_ranks = tuple(ranks[g * size + shard_index] for g in range(ngroups))
    return ZeroGroups(zero_ranks=zero_ranks, cross_ranks=cross_ranks, shard_index=shard_index)


def padded_numel(numel: int, nshards: int) -> int:
    """``numel`` rounded up to a multiple of ``nshards`` (so a flat buffer splits evenly)."""
    return -(-numel // nshards) * nshards


def new_group(ranks: tuple[int, ...] | list[int]) -> dist.ProcessGroup | None:
    """A process group over ``ranks``; only the member ranks need to call this.

    Returns None (meaning "no communication needed") for a single rank, the group cached by
    `nnscaler.runtime.groups` when one exists, the default group for the whole world,
    and otherwise a new group created with local synchronization (members only).
    """
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return None
    if not dist.is_initialized():
        raise RuntimeError(
            f"communication over ranks {ranks} needs torch.distributed; call "
            "torch.distributed.init_process_group() first"
        )
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    try:
        return get_group(ranks)
    except GroupError:
        pass
    return dist.new_group(ranks, use_local_synchronization=True)
