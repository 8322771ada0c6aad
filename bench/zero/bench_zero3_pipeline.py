"""ZeRO stage 3 in a pipeline: gather each unit per micro-batch (the default) or keep
the units gathered across the step's micro-batches (`kept_gathered`), against stage 2.

Runs ``--world`` CPU processes (gloo, OMP_NUM_THREADS=1): a 2-stage ``pp`` plan (1F1B,
``--nmicros`` micro-batches of 4 samples) on a 16-layer ``GPTWithLoss`` (d_model 128, 4
heads, seq 64, vocab 1024), data parallel over ``world // 2`` scale units, Adam. Modes:

- ``zero2``: stage 2 (whole parameters; gradients reduce-scattered after every
  micro-batch's backward);
- ``zero3``: stage 3, each unit gathered in every micro-batch's forward and backward;
  gradients summed whole over the micro-batches and reduce-scattered once per step;
- ``zero3_kept``: stage 3 inside ``kept_gathered``: each unit gathered once per step.

Reported: the median step time (interleaved in the same processes, a step as slow as its
slowest rank, ratios to ``zero3``), the all-gathers per step of a rank, and the peak
bytes of parameter values (gathered units, or whole parameters) and whole gradients a
rank holds during a step, by count; and the peak resident memory of a step above the
process's start, in fresh processes per mode.

Usage::

    python bench/zero/bench_zero3_pipeline.py [--world 4] [--nmicros 4] [--steps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/_launch.py
from _launch import compare_modes, launch, time_modes  # noqa: E402
from bench_zero import _kib  # noqa: E402

from nnscaler import ComputeConfig, build_optimizer, parallelize
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.runtime import zero3

CONFIG = GPTConfig(vocab_size=1024, n_layer=16, n_head=4, d_model=128, seq_len=64)
BATCH = 4
MODES = ("zero2", "zero3", "zero3_kept")


def _parallel(stage: int, world: int, nmicros: int, gen_savedir: str, load: bool = True) -> Any:
    cfg = ComputeConfig(2, world, zero_stage=stage, use_end2end=True,
                        pas_config={"pipeline_nmicros": nmicros, "pipeline_scheduler": "1f1b"})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parallelize(GPTWithLoss(CONFIG), {"batch": make_batch(CONFIG, BATCH)}, "pp",
                           cfg, gen_savedir=gen_savedir, instance_name=f"pp-zero{stage}",
                           load_module=load)


def _make_step(mode: str, rank: int, world: int, nmicros: int, gen_savedir: str) -> Any:
    pm = _parallel(2 if mode == "zero2" else 3, world, nmicros, gen_savedir)
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-4)
    unit = rank // 2
    batches = [make_batch(CONFIG, BATCH, seed=100 * unit + m) for m in range(nmicros)]

    def step() -> torch.Tensor:
        with zero3.kept_gathered(pm) if mode == "zero3_kept" else contextlib.nullcontext():
            loss = pm.train_step(batches)[0]
        opt.step()
        opt.zero_grad()
        return loss

    return pm, step


def _held(pm: Any) -> int:
    """Bytes of parameter values and whole gradients this rank holds now."""
    seen: dict[int, int] = {}
    for p in pm.parameters():
        for t in (p, p.grad):
            if t is not None and t.untyped_storage().nbytes():
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _count(rank: int, world: int, nmicros: int, gen_savedir: str) -> dict[str, Any]:
    """All-gathers per step and the peak of `_held` (sampled at every gather and every
    gradient hook) per mode."""
    out = {}
    real = zero3.gather_unit
    for mode in MODES:
        pm, step = _make_step(mode, rank, world, nmicros, gen_savedir)
        gathers, peak = [0], [0]

        def counting(reducer: Any, bucket: Any, async_op: bool = False,
                     pm: Any = pm, gathers: list = gathers, peak: list = peak) -> None:
            gathers[0] += not bucket.gathered
            real(reducer, bucket, async_op)
            peak[0] = max(peak[0], _held(pm))

        for p in pm.parameters():
            p.register_post_accumulate_grad_hook(
                lambda _, pm=pm, peak=peak: peak.__setitem__(0, max(peak[0], _held(pm))))
        zero3.gather_unit = counting
        step()
        gathers[0], peak[0] = 0, _held(pm)
        step()
        zero3.gather_unit = real
        out[mode] = {"gathers": gathers[0], "held_peak": peak[0]}
    return out


def _timing(rank: int, world: int, nmicros: int, steps: int, warmup: int,
            gen_savedir: str) -> Any:
    fns = {mode: _make_step(mode, rank, world, nmicros, gen_savedir)[1] for mode in MODES}
    return time_modes(fns, steps, warmup)


def _peak(rank: int, world: int, mode: str, nmicros: int, gen_savedir: str) -> int:
    import gc

    gc.collect()
    start = _kib("VmRSS")
    _, step = _make_step(mode, rank, world, nmicros, gen_savedir)
    step()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    for _ in range(2):
        step()
    return (_kib("VmHWM") - start) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4, help="processes (2 stages x world/2)")
    ap.add_argument("--nmicros", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    args = ap.parse_args()
    mib = 1 << 20
    with tempfile.TemporaryDirectory() as gen_savedir:
        for stage in (2, 3):
            _parallel(stage, args.world, args.nmicros, gen_savedir, load=False)
        counts = launch(_count, args.world, args.nmicros, gen_savedir)
        timing = launch(_timing, args.world, args.nmicros, args.steps, args.warmup, gen_savedir)
        peaks = {m: max(launch(_peak, args.world, m, args.nmicros, gen_savedir)) for m in MODES}
    times = compare_modes(timing, "zero3", args.steps, "ratio_to_zero3")
    print(f"GPTWithLoss {CONFIG}, pp 2 x dp {args.world // 2}, 1F1B, {args.nmicros} "
          f"micro-batches of {BATCH}, Adam")
    print(f"{'mode':>10} | median step | / zero3 | gathers | params+grads held | peak RSS")
    report: dict[str, Any] = {"bench": "zero3_pipeline", "world": args.world,
                              "nmicros": args.nmicros, "modes": {}}
    for mode in MODES:
        held = max(c[mode]["held_peak"] for c in counts)
        gathers = max(c[mode]["gathers"] for c in counts)
        print(f"{mode:>10} | {times[mode]['median_ms']:8.1f} ms | "
              f"{times[mode]['ratio_to_zero3']:7.3f} | {gathers:7d} | {held / mib:13.2f} MiB"
              f" | {peaks[mode] / mib:6.1f} MiB")
        report["modes"][mode] = {**times[mode], "gathers": gathers, "held_peak": held,
                                 "peak_rss": peaks[mode]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
