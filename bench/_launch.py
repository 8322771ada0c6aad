"""Run ``fn(rank, world, *args)`` on ``world`` forked CPU processes joined by gloo.

Shared by the scripts under ``bench/`` (they put this folder on ``sys.path``). Every
process runs with ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(threads)``, so
the ranks do not fight over the cores. Results come back in rank order; a failure on any
rank raises with that rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable[..., Any], rank: int, world: int, port: int, q: mp.Queue,
            threads: int, args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    q.put((rank, result))


def launch(fn: Callable[..., Any], world: int, *args: Any, threads: int = 1,
           timeout: float = 1800.0) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each in its process."""
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, q, threads, args))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, (status, value) = q.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
