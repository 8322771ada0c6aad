"""Shared by the benchmarks: run ``fn(rank, world, *args)`` on ``world`` forked CPU
processes joined by gloo (:func:`launch`), time several modes step by step in the same
processes (:func:`time_modes`) and compare them with a baseline (:func:`compare_modes`).

Shared by the scripts under ``bench/`` (they put this folder on ``sys.path``). Every
process runs with ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(threads)``, so
the ranks do not fight over the cores. Results come back in rank order; a failure on any
rank raises with that rank's traceback.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.testing import free_port


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
    port = free_port()
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


def training_step(model: Any, opt: torch.optim.Optimizer, batch: Any, *,
                  end2end: bool = False) -> Callable[[], torch.Tensor]:
    """A function running one training step and returning its loss: ``zero_grad``,
    ``model(batch).backward()``, ``step``; with ``end2end``, ``model.train_step([batch])``
    (a ParallelModule's, which zeroes the gradients first) then ``step``."""
    if end2end:

        def e2e_step() -> torch.Tensor:
            loss = model.train_step([batch])[0]
            opt.step()
            return loss

        return e2e_step

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(batch)
        loss.backward()
        opt.step()
        return loss

    return step


def time_modes(fns: dict[str, Callable[[], Any]], steps: int, warmup: int,
               seconds: float = 0.0, max_steps: int = 1000) -> dict[str, Any]:
    """Run one step of every mode per iteration (alternating which goes first), behind a
    barrier; return this rank's timed seconds per mode and each mode's loss at step 0.

    With ``seconds``, the timed iterations are at least ``steps`` and enough to last about
    ``seconds`` (judged from the slowest rank's warmup, at most ``max_steps``), so that a
    fast model's median is taken over as many steps as a slow one's time allows; every
    rank times the same number.
    """
    modes = list(fns)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    first_loss: dict[str, float] = {}
    total = warmup + steps
    i = 0
    while i < total:
        t_iter = time.perf_counter()
        for mode in modes if i % 2 == 0 else modes[::-1]:  # no mode always runs first
            dist.barrier()
            t0 = time.perf_counter()
            loss = fns[mode]()
            elapsed = time.perf_counter() - t0
            if i == 0:
                first_loss[mode] = float(loss)
            if i >= warmup:
                times[mode].append(elapsed)
        i += 1
        if seconds > 0 and i == max(warmup, 1):
            per_iter = torch.tensor([time.perf_counter() - t_iter], dtype=torch.float64)
            dist.all_reduce(per_iter, op=dist.ReduceOp.MAX)
            want = math.ceil(seconds / max(float(per_iter), 1e-6))
            total = warmup + min(max(steps, want), max(steps, max_steps))
    return {"times": times, "first_loss": first_loss}


def slowest_steps(results: list[dict[str, Any]], mode: str) -> list[float]:
    """``mode``'s timed steps from :func:`time_modes` results of every rank, each as slow as
    its slowest rank (a step ends when every rank's part of it has)."""
    return [max(step) for step in zip(*(r["times"][mode] for r in results))]


def compare_modes(results: list[dict[str, Any]], baseline: str, steps: int,
                  ratio_key: str) -> dict[str, dict[str, float]]:
    """Per mode: the median step (a step is as slow as its slowest rank), the median over
    iterations of this step / the baseline's step of the same iteration (they ran back to
    back, under the same load) as ``ratio_key``, and the ratio of the medians."""
    modes = list(results[0]["times"])
    per_step = {m: slowest_steps(results, m)[:steps] for m in modes}
    medians = {m: statistics.median(t) for m, t in per_step.items()}
    return {
        m: {"median_ms": round(v * 1e3, 2),
            ratio_key: round(statistics.median(
                a / b for a, b in zip(per_step[m], per_step[baseline])), 3),
            "ratio_of_medians": round(v / medians[baseline], 3)}
        for m, v in medians.items()
    }
