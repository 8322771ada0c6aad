"""Run a function on N local CPU processes joined by a gloo process group: what the
parity tests of nnScaler and of its plugins stand on.

``run_distributed(fn, world_size, *args)`` forks ``world_size`` processes; each sets up
``torch.distributed`` (gloo, CPU, ``OMP_NUM_THREADS=1``), calls ``fn(rank, world_size,
*args)`` and sends its return value back. Results come back in rank order; an exception
in any rank fails the call with that rank's traceback, and a rank that dies or outlives
``timeout`` seconds fails it too.

The ranks meet through a file store in the call's temporary directory rather than a TCP
store: c10d names the peer of every TCP store socket by a reverse DNS lookup, which costs
5 s or more wherever the resolver drops the query. ``MASTER_ADDR`` and ``MASTER_PORT`` (a
free port on localhost) are still set for code that reads them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["free_port", "run_distributed"]


def free_port() -> int:
    """A TCP port on localhost that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, outdir: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    result: Any
    try:
        store = dist.FileStore(os.path.join(outdir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each
    in a forked process of a gloo group (see the module docstring)."""
    ctx = mp.get_context("fork")
    port = free_port()
    with tempfile.TemporaryDirectory() as outdir:
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, port, outdir, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world_size):
            path = os.path.join(outdir, f"{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died or timed out (exit code {procs[r].exitcode})")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results
