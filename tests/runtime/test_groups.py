"""The process-group cache: same ranks -> same object, same creation order everywhere,
clear errors for groups never created and ranks outside the world."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed


def _groups(rank: int, world_size: int) -> dict:
    from nnscaler.runtime import (
        GroupError,
        created_groups,
        ensure_groups,
        get_group,
    )

    out: dict = {}
    ensure_groups([(1, 0), (2, 3), (3, 1), (0, 1, 2, 3), (2,), (0, 1)])
    out["order"] = created_groups()
    out["same"] = get_group((1, 0)) is get_group([0, 1]) and get_group((1, 3)) is get_group((3, 1))
    out["single"] = get_group((2,)) is None and get_group((rank,)) is None
    out["world"] = get_group(range(world_size)) is dist.group.WORLD

    try:
        get_group((0, 2))
    except GroupError as e:
        out["missing"] = str(e)
    try:
        ensure_groups([(0, 7)])
    except GroupError as e:
        out["outside"] = str(e)

    # created collectively on demand: every rank makes the same call at the same point
    group = get_group((2, 0), create=True)
    if rank in (0, 2):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        out["sum"] = t.item()
    out["order_after"] = created_groups()
    return out


def test_group_cache_is_consistent_on_every_rank():
    results = run_distributed(_groups, 4)
    assert results[0]["order"] == [(0, 1), (2, 3), (1, 3), (0, 1, 2, 3), (2,)]
    assert all(r["order"] == results[0]["order"] for r in results)
    assert all(r["order_after"] == results[0]["order"] + [(0, 2)] for r in results)
    assert all(r["same"] and r["single"] and r["world"] for r in results)
    assert results[0]["sum"] == 4.0 and results[2]["sum"] == 4.0
    assert "no process group for ranks (0, 2) was created" in results[0]["missing"]
    assert "ensure_groups" in results[0]["missing"]
    assert "ranks must be ints in [0, 4) (the world size is 4), got 7" in results[1]["outside"]


def test_groups_need_a_running_process_group():
    from nnscaler.runtime import GroupError, get_group

    if dist.is_initialized():
        pytest.skip("a default process group is running in this process")
    with pytest.raises(GroupError, match="torch.distributed is not initialized"):
        get_group((0, 1))
