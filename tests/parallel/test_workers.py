"""Work a policy hands to every rank while rank 0 plans (nnscaler.parallel.workers)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

from nnscaler import ComputeConfig, parallelize
from nnscaler.parallel import WorkerError, call_on_every_rank, map_over_ranks
from nnscaler.policies import dp


def square_where(x: int) -> tuple[int, int]:
    """The square, and the rank that computed it (-1 without a process group)."""
    return x * x, dist.get_rank() if dist.is_initialized() else -1


def all_reduce_rank() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), float(t)


def fail_on_rank_1(x: int) -> int:
    if dist.get_rank() == 1:
        raise ValueError(f"item {x} refused")
    return x


def refuse(x: int) -> int:
    raise ValueError(f"item {x} refused")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).sum()


def _parallelize(policy, gen: str) -> None:
    world = dist.get_world_size()
    parallelize(Net(), {"x": torch.ones(2, 4)}, policy,
                ComputeConfig(plan_ngpus=1, runtime_ngpus=world), gen_savedir=gen,
                load_module=False)


def _spread(rank: int, world: int, gen: str) -> dict:
    seen: dict = {}

    def policy(graph, cfg):  # noqa: ANN001, ANN202 - runs on rank 0 only
        seen["map"] = map_over_ranks(square_where, list(range(7)))
        seen["call"] = call_on_every_rank(all_reduce_rank)
        seen["empty"] = map_over_ranks(square_where, [])
        return dp(graph, cfg)

    _parallelize(policy, gen)
    return seen


@pytest.mark.parametrize("world", [2, 3])
def test_work_is_spread_over_every_rank(world, tmp_path):
    results = run_distributed(_spread, world, str(tmp_path))
    got = results[0]
    assert [v for v, _ in got["map"]] == [x * x for x in range(7)]
    assert [r for _, r in got["map"]] == [x % world for x in range(7)]  # round robin
    total = float(sum(range(1, world + 1)))
    assert got["call"] == [(r, total) for r in range(world)]
    assert got["empty"] == []
    assert all(not r for r in results[1:])  # the policy ran on rank 0 only


def _failing(rank: int, world: int, gen: str) -> str:
    def policy(graph, cfg):  # noqa: ANN001, ANN202
        map_over_ranks(fail_on_rank_1, [0, 1, 2, 3])
        return dp(graph, cfg)

    with pytest.raises(WorkerError) as info:
        _parallelize(policy, gen)
    return str(info.value)


def test_a_failure_elsewhere_fails_every_rank_and_names_it(tmp_path):
    messages = run_distributed(_failing, 2, str(tmp_path))
    for msg in messages:
        assert "failed on rank 1" in msg and "item 1 refused" in msg
        assert "fail_on_rank_1" in msg


def _unpicklable(rank: int, world: int, gen: str) -> str:
    def policy(graph, cfg):  # noqa: ANN001, ANN202
        map_over_ranks(lambda x: x, [1, 2])
        return dp(graph, cfg)

    with pytest.raises(WorkerError) as info:
        _parallelize(policy, gen)
    return str(info.value)


def test_a_function_that_cannot_travel_is_refused_with_the_fix(tmp_path):
    for msg in run_distributed(_unpicklable, 2, str(tmp_path)):
        assert "module-level function" in msg


def test_alone_it_runs_here():
    assert map_over_ranks(square_where, [2, 3]) == [(4, -1), (9, -1)]
    assert call_on_every_rank(square_where, 5) == [(25, -1)]
    with pytest.raises(ValueError, match="refused"):  # raised as it is, here
        map_over_ranks(refuse, [1])
