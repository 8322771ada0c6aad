"""The collectives the checkpoint functions share: who this process is, gathering a
Python value from every rank, and failing on every rank together.

Each works without a process group too (one process, rank 0 of 1), so the same loading
code serves a single process and a job.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nnscaler.errors import CheckpointError

__all__ = ["agree", "gather", "world"]


def world() -> tuple[bool, int, int]:
    """``(distributed, rank, world_size)``; ``(False, 0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank(), dist.get_world_size()
    return False, 0, 1


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (collective)."""
    distributed, _, size = world()
    if not distributed:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj)
    return out


def agree(error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank when any rank failed, so none waits forever in a
    later collective; a rank raises its own error, the others a
    [`CheckpointError`][nnscaler.errors.CheckpointError] naming the first rank that failed and its
    message."""
    messages = gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {message}")


def comm_device() -> torch.device:
    """Where tensors sent between ranks live: the current CUDA device under NCCL, else
    the CPU (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
