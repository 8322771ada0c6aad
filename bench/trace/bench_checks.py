"""What the "refuse or honour" checks cost, each against the work it guards, in one process.

- the run-time input check (``boundary.check_inputs``, emitted at the top of every
  generated forward) against one training step (forward + backward) of the same parallel
  module, interleaved: the ratio of the check's time to the step's;
- the tracer putting the module's state back (buffers, parameters written in place, RNG)
  against tracing without it (``SavedState`` replaced by a no-op), interleaved;
- the promise check of a custom op at ``parallelize``: a compile that runs it, one that
  finds it in the process cache, and one with ``check_custom_ops=False``.

Usage: ``.venv/bin/python bench/trace/bench_checks.py [--layers 4] [--repeats 20]``.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings

import torch
from torch import nn

import nnscaler
from nnscaler import ComputeConfig, parallelize
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.parallel import op_checks
from nnscaler.runtime import boundary
from nnscaler.trace import trace, tracer


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def bench_input_check(layers: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=1024, n_layer=layers, n_head=4, d_model=256, seq_len=128)
    batch = make_batch(config, batch_size=4)
    with tempfile.TemporaryDirectory() as d:
        pm = parallelize(GPTWithLoss(config), {"batch": batch}, "dp",
                         ComputeConfig(plan_ngpus=1, runtime_ngpus=1), gen_savedir=d)
    spec = {f"batch[{k!r}]": (v, tuple(v.shape), v.dtype) for k, v in batch.items()}
    checks, steps = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(100):
            boundary.check_inputs(spec)
        checks.append((time.perf_counter() - t0) / 100)
        t0 = time.perf_counter()
        pm(batch).backward()
        steps.append(time.perf_counter() - t0)
    return {"check_us": statistics.median(checks) * 1e6, "step_ms": statistics.median(steps) * 1e3,
            "check_over_step": _median_ratio(checks, steps)}


class _NoSave:
    def __init__(self, module: nn.Module) -> None:
        pass

    def keep(self, tensors: list) -> None:
        pass

    def restore(self) -> None:
        pass


def bench_state_restore(layers: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=1024, n_layer=layers, n_head=4, d_model=256, seq_len=128)
    model = GPTWithLoss(config)
    batch = {"batch": make_batch(config, batch_size=4)}
    saved_cls = tracer.SavedState
    with_, without = [], []
    try:
        for _ in range(repeats):
            tracer.SavedState = saved_cls
            t0 = time.perf_counter()
            trace(model, batch)
            with_.append(time.perf_counter() - t0)
            tracer.SavedState = _NoSave  # type: ignore[assignment,misc]
            t0 = time.perf_counter()
            trace(model, batch)
            without.append(time.perf_counter() - t0)
    finally:
        tracer.SavedState = saved_cls
    return {"trace_ms": statistics.median(with_) * 1e3,
            "trace_without_restore_ms": statistics.median(without) * 1e3,
            "restore_ratio": _median_ratio(with_, without)}


@nnscaler.register_op("n d^ -> n d^", name="bench.row_scale")
def row_scale(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True)


class UsesRowScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(256, 256)
        self.fc2 = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(row_scale(self.fc1(x))).pow(2).mean()


def bench_op_check(repeats: int) -> dict[str, float]:
    import os
    import shutil

    x = torch.randn(64, 256)
    times: dict[str, list[float]] = {"checked": [], "cached": [], "off": []}
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as cache:
        os.environ["NNSCALER_CACHE_DIR"] = cache

        def compile_(check: bool) -> float:
            cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, check_custom_ops=check)
            t0 = time.perf_counter()
            parallelize(UsesRowScale(), {"x": x}, "data", cfg, gen_savedir=d, reuse="override",
                        load_module=False)
            return time.perf_counter() - t0

        compile_(False)  # warm-up: imports, the plugin manager
        for _ in range(repeats):
            op_checks._passed.clear()
            shutil.rmtree(op_checks.checked_cache_dir(), ignore_errors=True)
            times["checked"].append(compile_(True))
            times["cached"].append(compile_(True))
            times["off"].append(compile_(False))
    return {f"compile_{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    result = {**bench_input_check(args.layers, args.repeats),
              **bench_state_restore(args.layers, max(3, args.repeats // 4)),
              **bench_op_check(max(3, args.repeats // 4))}
    for k, v in result.items():
        print(f"{k:28s} {v:12.4f}")
    print(json.dumps({k: round(v, 6) for k, v in result.items()}))


if __name__ == "__main__":
    main()
