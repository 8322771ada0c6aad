"""The parts of a split that talk to each other, across processes: `ProcessPartGroup`.

Generated code passes one to every call of a collective part op (see
`nnscaler.anno.partgroup`): ``group=self.part_group((0, 1))`` names the plan devices
of the parts in part order, and `ParallelModule.part_group` maps them to the ranks of this scale
unit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from nnscaler.anno.partgroup import PartGroup, check_peers, check_reduce_op, check_splits
from nnscaler.runtime.collectives import (
    all_gather,
    all_reduce,
    all_to_all_uneven,
    this_rank,
)
from nnscaler.runtime.compiling import outside_compiled
from nnscaler.runtime.groups import get_group

__all__ = ["ProcessPartGroup"]


class ProcessPartGroup(PartGroup):
    """The parts run by ``ranks`` (in part order); this process is one of them."""

    def __init__(self, ranks: Sequence[int], rank: int | None = None) -> None:
        self.ranks = tuple(int(r) for r in ranks)
        rank = this_rank() if rank is None else rank
        if rank not in self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ProcessPartGroup: the ranks {list(self.ranks)} must be distinct "
                             f"and include this process's rank {rank}")
        self.size = len(self.ranks)
        self.index = self.ranks.index(rank)

    @outside_compiled
    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        check_reduce_op(op)
        if self.size == 1:
            return x if op == "sum" else x.detach()
        if op == "sum":  # the exact adjoint: each part's x gets the sum of the gradients
            return all_reduce(x, self.ranks, grad="exact")
        out = x.detach().clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=get_group(self.ranks))
        return out

    @outside_compiled
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x.unsqueeze(0)
        # the ranks are in part order, so the members' chunks are too; exact adjoint:
        # each part's x gets the reduce-scatter of the gradients
        return all_gather(x.unsqueeze(0), self.ranks, 0, grad="exact")

    @outside_compiled
    def send_recv(self, x: torch.Tensor, dst: int, src: int) -> torch.Tensor:
        check_peers(self, dst, src)
        if dst == self.index and src == self.index:
            return x
        return _SendRecv.apply(x, self.ranks[dst], self.ranks[src])

    @outside_compiled
    def all_to_all(self, x: torch.Tensor, send_splits: Sequence[int],
                   recv_splits: Sequence[int]) -> torch.Tensor:
        check_splits(self, x, send_splits, recv_splits)
        if self.size == 1:
            return x
        return all_to_all_uneven(x, self.ranks, send_splits, recv_splits)

    def __repr__(self) -> str:
        return f"ProcessPartGroup(ranks={list(self.ranks)}, index={self.index})"


def _exchange(x: torch.Tensor, dst: int, src: int) -> torch.Tensor:
    """Send ``x`` to global rank ``dst`` while receiving its like from ``src``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    works = [dist.isend(x, dst), dist.irecv(out, src)]
    for work in works:
        work.wait()
    return out


class _SendRecv(torch.autograd.Function):
    """Point to point between ranks; the adjoint sends the gradient back the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dst: int, src: int) -> torch.Tensor:  # type: ignore[override]
        ctx.peers = (dst, src)
        return _exchange(x, dst, src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        dst, src = ctx.peers
        return _exchange(grad, src, dst), None, None
