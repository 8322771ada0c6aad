"""Step time of the ``data`` policy on units of 2 devices vs ``dp`` on units of 1.

A batch split inside a scale unit is data parallelism: ``data`` with ``plan_ngpus=2``
should step as fast as ``dp`` with ``plan_ngpus=1`` on the same processes and the same
samples per device. Runs ``--world`` CPU processes (gloo, OMP_NUM_THREADS=1) training the
project's ``GPTWithLoss`` (4 layers, d_model 256, 4 heads, seq 128, vocab 1024; ``--layers``
and ``--vocab`` change them) with Adam
through a plain training loop (``zero_grad``, ``model(batch).backward()``, ``step``):

- ``dp``: ``ComputeConfig(plan_ngpus=1, runtime_ngpus=world)``, ``--batch`` samples per
  rank;
- ``data``: ``ComputeConfig(plan_ngpus=2, runtime_ngpus=world)``, ``2 * --batch`` samples
  per unit of 2 ranks (each device runs ``--batch`` of them).

Two measurements:

- *isolated*: each mode in processes of its own, ``--rounds`` launches in alternating
  order; a launch's figure is the median over its steps of the slowest rank's step, a
  mode's figure the median over its launches (``--rounds 0``: skipped);
- *paired*: both modes in the same processes, steps interleaved in alternating order
  (`time_modes`); the ratio is the median over iterations of ``data``'s step over
  ``dp``'s step of the same iteration (they ran back to back, under the same load).

Prints both ratios (goal <= 1.05) and one JSON line.

Usage::

    python bench/parallel/bench_data_vs_dp.py [--steps 30] [--warmup 3] [--world 2]
        [--rounds 3] [--batch 8] [--layers 4] [--vocab 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/_launch.py
from _launch import compare_modes, launch, slowest_steps, time_modes, training_step  # noqa: E402

from nnscaler import ComputeConfig, build_optimizer, parallelize
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch

LR = 1e-4
MODES = ("dp", "data")
PLAN = {"dp": 1, "data": 2}
TARGET = 1.05  # data / dp


def _config(layers: int, vocab: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, n_layer=layers, n_head=4, d_model=256, seq_len=128)


def _make_step(mode: str, rank: int, world: int, batch: int, model: tuple[int, int],
               gen_savedir: str) -> Callable[[], torch.Tensor]:
    """Build ``mode``'s parallel module and optimizer; return one training step."""
    config = _config(*model)
    plan = PLAN[mode]
    unit = rank // plan
    sample = make_batch(config, batch * plan, seed=unit)
    torch.manual_seed(0)
    cfg = ComputeConfig(plan_ngpus=plan, runtime_ngpus=world)
    pm = parallelize(GPTWithLoss(config), {"batch": sample}, mode, cfg,
                     gen_savedir=gen_savedir, instance_name=f"{mode}_{model[0]}_{model[1]}")
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    return training_step(pm, opt, sample)


def _run(rank: int, world: int, modes: tuple[str, ...], batch: int, model: tuple[int, int],
         steps: int, warmup: int, gen_savedir: str) -> dict[str, object]:
    fns = {mode: _make_step(mode, rank, world, batch, model, gen_savedir) for mode in modes}
    return time_modes(fns, steps, warmup)


def _isolated(args: argparse.Namespace, gen_savedir: str) -> dict[str, dict[str, object]]:
    """Each mode alone in its processes, ``args.rounds`` launches in alternating order."""
    launches: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            results = launch(_run, args.world, (mode,), args.batch,
                             (args.layers, args.vocab), args.steps, args.warmup, gen_savedir)
            launches[mode].append(statistics.median(slowest_steps(results, mode)))
    return {m: {"median_ms": round(statistics.median(v) * 1e3, 2) if v else None,
                "launches_ms": [round(x * 1e3, 2) for x in v]} for m, v in launches.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode and launch")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode first")
    ap.add_argument("--world", type=int, default=2, help="processes (an even number)")
    ap.add_argument("--rounds", type=int, default=3, help="isolated launches per mode")
    ap.add_argument("--batch", type=int, default=8, help="samples per device")
    ap.add_argument("--layers", type=int, default=4, help="GPT blocks")
    ap.add_argument("--vocab", type=int, default=1024, help="GPT vocabulary size")
    args = ap.parse_args()
    if args.world < 2 or args.world % 2:
        ap.error(f"--world must be an even number of processes (units of 2), got {args.world}")
    with tempfile.TemporaryDirectory() as gen_savedir:
        isolated = _isolated(args, gen_savedir)
        results = launch(_run, args.world, MODES, args.batch, (args.layers, args.vocab),
                         args.steps, args.warmup, gen_savedir)
    paired = compare_modes(results, "dp", args.steps, "ratio_vs_dp")
    iso_ratio = round(isolated["data"]["median_ms"] / isolated["dp"]["median_ms"], 3) \
        if args.rounds else None
    pair_ratio = paired["data"]["ratio_vs_dp"]
    print(f"GPTWithLoss {_config(args.layers, args.vocab)}\nAdam, world {args.world}, {args.batch} "
          f"samples per device, {args.steps} steps after {args.warmup} warm-up")
    print(f"{'mode':>5} | {'isolated':>11} | {'paired':>11} | launches (isolated, ms)")
    for m in MODES:
        alone = isolated[m]["median_ms"]
        print(f"{m:>5} | {'-' if alone is None else f'{alone:8.1f} ms':>11} | "
              f"{paired[m]['median_ms']:8.1f} ms"
              f" | {isolated[m]['launches_ms']}")
    for name, ratio in (("isolated", iso_ratio), ("paired", pair_ratio)):
        if ratio is None:
            continue
        print(f"data / dp ({name}) = {ratio:.3f} (target <= {TARGET}): "
              f"{'ok' if ratio <= TARGET else 'MISSED'}")
    print(json.dumps({"bench": "data_vs_dp", "world": args.world, "layers": args.layers,
                      "vocab": args.vocab,
                      "batch_per_device": args.batch, "steps": args.steps,
                      "isolated": isolated, "paired": paired,
                      "ratio_isolated": iso_ratio, "ratio_paired": pair_ratio,
                      "target": TARGET}))


if __name__ == "__main__":
    main()
