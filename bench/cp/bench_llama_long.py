"""examples/llama_long on CPU processes (gloo, one thread each): memory per rank and
throughput by context-parallel degree, and the longest sequence that trains in a fixed
per-process memory budget.

``--what table``: for each degree ``d`` in ``--degrees``, ``d`` processes train the
example's `LongLlama` (2 layers, width 64, 4 query / 2 key-value heads, vocabulary 256)
on one ``--seq``-token sequence per step under the ``sequence`` policy (zigzag ring
attention; degree 1 is the same policy on one process: the model as it is). Memory per
rank is counted as in ``bench/cp/bench_cp.py``: a ``TorchDispatchMode`` adds the bytes of
every storage the ops make until it is freed; ``peak`` is the largest count during one
training step (forward, backward, optimizer step), plus the parameters, gradients and
AdamW state the rank holds. The largest rank is reported. Throughput is tokens per
second of the whole job (median step of ``--steps`` after one warm-up step). On a
machine with fewer cores than processes the processes share them, so the speed-up is
bounded by the cores, not by the plan.

``--what longest``: for each degree in ``--degrees``, the longest sequence whose peak
fits in ``--budget`` MiB per process: lengths grow by doubling from ``--start`` until
one does not fit, then ``--halvings`` bisection steps between the last fit and the first
miss. Each length is one training step, the first (so the AdamW state it creates is
counted among the bytes the ops make, plus the parameters and their gradient buffers).

Prints a table, then one JSON line. Usage::

    python bench/cp/bench_llama_long.py --what table [--seq 16384] [--degrees 1 2 4]
    python bench/cp/bench_llama_long.py --what longest [--budget 150] [--degrees 1 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # _launch
sys.path.insert(0, str(ROOT / "bench" / "parallel"))  # LiveBytes
sys.path.insert(0, str(ROOT / "examples" / "llama_long"))  # the example
from _launch import launch  # noqa: E402
from bench_recompute_memory import LiveBytes  # noqa: E402

MIB = 2.0**20


def _held_bytes(pm: torch.nn.Module, opt: torch.optim.Optimizer, state: bool) -> int:
    """Parameters and their gradients this rank holds, and (``state``) the optimizer's."""
    params = sum(p.numel() * p.element_size() for p in pm.parameters())
    held = sum(t.numel() * t.element_size() for s in opt.state.values()
               for t in s.values() if isinstance(t, torch.Tensor))
    return 2 * params + (held if state else 0)


def _rank(rank: int, world: int, seq: int, steps: int, gen: str) -> dict[str, float]:
    import torch.distributed as dist
    from llama_long import byte_windows
    from train import build

    from nnscaler import build_optimizer

    pm, _ = build(seq, world, workdir=gen)
    opt = build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    data = byte_windows(seq, max(steps, 1) + (steps > 0))
    measured = 1 if steps else 0  # after the first step (which creates the AdamW state)
    counter = LiveBytes()
    times, loss = [], 0.0
    for i, batch in enumerate(data):
        dist.barrier()
        t0 = time.perf_counter()
        if i == measured:
            with counter:
                loss = float(pm.train_step([batch])[0])
                opt.step()
        else:
            loss = float(pm.train_step([batch])[0])
            opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"peak": (counter.peak + _held_bytes(pm, opt, state=measured > 0)) / MIB,
            "step": statistics.median(times[1:] or times), "loss": loss}


def _measure(degree: int, seq: int, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as gen:
        rows = launch(_rank, degree, seq, steps, gen)
    out = {"peak": max(r["peak"] for r in rows), "step": max(r["step"] for r in rows),
           "loss": rows[0]["loss"]}
    print(f"# degree {degree}, {seq} tokens: {json.dumps(out)}", flush=True)
    return out


def table(args: argparse.Namespace) -> dict[str, Any]:
    rows = {d: _measure(d, args.seq, args.steps) for d in args.degrees}
    base = rows[args.degrees[0]]
    print(f"LongLlama, one sequence of {args.seq} tokens per step, sequence policy (zigzag)")
    print(f"{'degree':>6} {'peak MiB/rank':>14} {'ratio':>6} {'s/step':>8} {'tokens/s':>9}")
    for d, r in rows.items():
        print(f"{d:>6} {r['peak']:>14.1f} {r['peak'] / base['peak']:>6.3f} {r['step']:>8.2f} "
              f"{args.seq / r['step']:>9.0f}")
    return {"what": "table", "seq": args.seq, "rows": rows}


def _longest(degree: int, budget: float, start: int, halvings: int) -> tuple[int, dict]:
    tried: dict[int, float] = {}
    seq, fit, miss = start, 0, 0
    while True:
        tried[seq] = _measure(degree, seq, 0)["peak"]
        if tried[seq] > budget:
            miss = seq
            break
        fit, seq = seq, seq * 2
    for _ in range(halvings if fit else 0):
        mid = (fit + miss) // 2 // (2 * degree) * (2 * degree)
        if not fit < mid < miss:
            break
        tried[mid] = _measure(degree, mid, 0)["peak"]
        fit, miss = (mid, miss) if tried[mid] <= budget else (fit, mid)
    return fit, tried


def longest(args: argparse.Namespace) -> dict[str, Any]:
    rows = {d: _longest(d, args.budget, args.start, args.halvings) for d in args.degrees}
    base = rows[args.degrees[0]][0]
    print(f"longest sequence in {args.budget:.0f} MiB per process (one training step)")
    print(f"{'degree':>6} {'longest':>8} {'ratio':>6}  peaks tried (tokens: MiB)")
    for d, (fit, tried) in rows.items():
        peaks = ", ".join(f"{s}: {m:.0f}" for s, m in sorted(tried.items()))
        print(f"{d:>6} {fit:>8} {fit / base if base else float('inf'):>6.2f}  {peaks}")
    return {"what": "longest", "budget_mib": args.budget,
            "rows": {d: {"longest": f, "tried": t} for d, (f, t) in rows.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--what", choices=("table", "longest"), required=True)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--degrees", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--budget", type=float, default=150.0, help="MiB per process")
    p.add_argument("--start", type=int, default=2048)
    p.add_argument("--halvings", type=int, default=3, help="bisection steps after doubling")
    args = p.parse_args()
    if args.degrees is None:
        args.degrees = [1, 2, 4] if args.what == "table" else [1, 4]
    out = table(args) if args.what == "table" else longest(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
