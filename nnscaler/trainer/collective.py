"""The few collectives the Trainer's parts share, each a no-op answer in a single
process (no process group)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "agree",
    "all_gather",
    "any_rank",
    "barrier",
    "gather",
    "is_distributed",
    "sum_over_units",
    "wake_local_peers",
]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _backend_device(device: torch.device) -> torch.device:
    """Where a tensor must be for the process group's backend (NCCL: this rank's GPU)."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def agree(ok: bool, device: torch.device) -> bool:
    """True when ``ok`` on every rank."""
    if not is_distributed():
        return ok
    flag = torch.tensor([0.0 if ok else 1.0])
    if dist.get_backend() == "nccl":
        flag = flag.to(device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag.item()) == 0.0


def any_rank(flag: torch.Tensor, device: torch.device) -> bool:
    """True when the 0/1 ``flag`` is set on some rank."""
    if is_distributed():
        flag = flag.to(_backend_device(device))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def all_gather(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def gather(obj: Any, rank: int, world_size: int) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere)."""
    if not is_distributed():
        return [obj]
    out: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def sum_over_units(t: torch.Tensor, device: torch.device, plan_ngpus: int) -> torch.Tensor:
    """Sum ``t`` over the scale units (every rank of a unit holds the same value)."""
    t = t.to(_backend_device(device))
    dist.all_reduce(t)
    return (t / plan_ngpus).cpu()


def wake_local_peers(peers: Sequence[tuple[str, int]], rank: int) -> None:
    """Continue stopped ranks on this host (SIGCONT) as this rank fails: torchrun
    then ends the job at once; a stopped process would ignore its SIGTERM and hold
    the job for torchrun's 30 s grace period. A running rank is not affected.
    ``peers``: every rank's (host name, process id)."""
    me = socket.gethostname()
    for other, (host, pid) in enumerate(peers):
        if other != rank and host == me:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
