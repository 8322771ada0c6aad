"""Step time of the nnScaler Reducer (blocking and async) vs torch DistributedDataParallel.

Runs ``--world`` CPU processes (gloo, OMP_NUM_THREADS=1) training the same 4-layer
``GPTWithLoss`` (d_model 256, seq 128, vocab 1024, batch 8 per rank) with each gradient
synchronizer in turn, in the same processes, and prints the median step time of each
(after warm-up) and its ratio to DDP. Usage::

    python bench/runtime/bench_reducer.py [--steps 20] [--warmup 3] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.runtime.reducer import Reducer

CONFIG = GPTConfig(vocab_size=1024, n_layer=4, n_head=4, d_model=256, seq_len=128)
BATCH = 8
MODES = ("ddp", "reducer_sync", "reducer_async", "reducer_zero")


def _make_step(mode: str, rank: int, world: int) -> Callable[[], None]:
    """Build ``mode``'s model and optimizer; return a function running one training step."""
    torch.manual_seed(0)
    model = GPTWithLoss(CONFIG)
    batch = make_batch(CONFIG, BATCH, seed=rank)
    if mode == "ddp":
        ddp = DistributedDataParallel(model, bucket_cap_mb=25)
        ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)

        def ddp_step() -> None:
            ddp_opt.zero_grad()
            ddp(batch).backward()
            ddp_opt.step()

        return ddp_step
    reducer = Reducer(
        model.parameters(),
        range(world),
        async_op=mode == "reducer_async",
        zero=mode == "reducer_zero",
    )
    opt = torch.optim.Adam(reducer.parameters_for_optimizer(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        reducer.zero_grad()
        model(batch).backward()
        reducer.sync_grads()
        opt.step()
        reducer.gather_params()

    return step


def _run(rank: int, world: int, steps: int, warmup: int) -> dict[str, list[float]]:
    # steps of the modes interleave, so machine load drifts affect every mode alike
    fns = {mode: _make_step(mode, rank, world) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(warmup + steps):
        for mode, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[mode].append(time.perf_counter() - t0)
    return times


def _worker(rank: int, world: int, port: int, steps: int, warmup: int, q: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = _run(rank, world, steps, warmup)
        if rank == 0:
            q.put(result)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, port, args.steps, args.warmup, q))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join()
    medians = {m: statistics.median(t) for m, t in result.items()}
    summary = {
        m: {"median_s": round(v, 4), "ratio_vs_ddp": round(v / medians["ddp"], 3)}
        for m, v in medians.items()
    }
    nparams = sum(p.numel() for p in GPTWithLoss(CONFIG).parameters())
    if args.json:
        print(json.dumps({"world": args.world, "params": nparams, "modes": summary}))
        return
    print(f"GPTWithLoss {CONFIG}, {nparams} params, batch {BATCH}/rank, world {args.world}")
    for m, v in summary.items():
        print(
            f"{m:>14}: median step {v['median_s'] * 1e3:8.1f} ms  ratio vs DDP {v['ratio_vs_ddp']:.3f}"
        )


if __name__ == "__main__":
    main()
