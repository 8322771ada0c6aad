"""How long tracing takes: a 24-layer GPT with both strategies, and growth with depth.

    python bench/trace/bench_trace.py              # the whole table (about a minute on 2 cores)
    python bench/trace/bench_trace.py --skip-real  # meta strategy only (seconds)

1. GPT, 24 layers, d_model 768, 12 heads, seq 1024, batch 1 (~124M parameters + the
   50k-token embedding): the meta strategy, cold (the first trace in the process pays
   torch's one-time loading of its meta kernels) and warm (median of 3); the real
   strategy next to a plain eager forward, so the tracer's own overhead shows.
2. Meta-strategy trace time for 6, 12, 24 and 48 layers (median of 3): it should grow
   linearly. These models are built on the meta device (no weights are allocated); the
   meta strategy never reads weights, so the time is the same as with real ones.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.trace import trace


def config(n_layer: int) -> GPTConfig:
    return GPTConfig(n_layer=n_layer, d_model=768, n_head=12, seq_len=1024)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_time(fn: Callable[[], object], repeat: int) -> float:
    return statistics.median(timed(fn) for _ in range(repeat))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 12, 24, 48])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-real", action="store_true", help="skip the real strategy")
    opts = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    cfg = config(24)
    model = GPTWithLoss(cfg)
    args = {"batch": make_batch(cfg, 1)}
    rows = []
    cold = timed(lambda: trace(model, args, strategy="meta"))
    n_ops = len(trace(model, args, strategy="meta").ops)
    warm = median_time(lambda: trace(model, args, strategy="meta"), opts.repeat)
    rows += [("meta, cold (first trace in process)", n_ops, cold),
             (f"meta, warm (median of {opts.repeat})", n_ops, warm)]
    if not opts.skip_real:
        real = timed(lambda: trace(model, args, strategy="real"))
        with torch.no_grad():
            eager = timed(lambda: model(**args))
        rows += [("real", n_ops, real), ("eager forward, no tracing (reference)", None, eager)]
    print("\nGPT 24 layers, d_model 768, 12 heads, seq 1024, batch 1")
    print(f"{'strategy':40} {'ops':>6} {'seconds':>8}")
    for name, ops, seconds in rows:
        print(f"{name:40} {'' if ops is None else ops:>6} {seconds:8.2f}")

    print(f"\nmeta strategy vs depth (median of {opts.repeat}; weights on the meta device)")
    print(f"{'layers':>6} {'ops':>6} {'seconds':>8} {'ms/layer':>9}")
    points = []
    for n in opts.layers:
        with torch.device("meta"):
            deep = GPTWithLoss(config(n))
        seconds = median_time(lambda deep=deep: trace(deep, args, strategy="meta"), opts.repeat)
        ops = len(trace(deep, args, strategy="meta").ops)
        points.append((n, seconds))
        print(f"{n:>6} {ops:>6} {seconds:8.3f} {1000 * seconds / n:9.1f}")
    if len(points) > 1:
        (n0, t0), (n1, t1) = points[0], points[-1]
        print(f"{n1 // n0}x the layers took {t1 / t0:.1f}x the time")


if __name__ == "__main__":
    main()
