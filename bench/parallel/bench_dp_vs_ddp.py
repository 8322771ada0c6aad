"""Step time of nnscaler's ``dp`` policy vs torch DistributedDataParallel.

Runs ``--world`` CPU processes (gloo, OMP_NUM_THREADS=1) training the same 4-layer
``GPTWithLoss`` (d_model 256, 4 heads, seq 128, vocab 1024, batch 8 per rank) with Adam,
in each mode in turn, in the same processes (steps interleave, in an order that
alternates, so load drifts on the machine hit every mode alike), and prints the median
step time of each after warm-up (a step lasts as long as its slowest rank), its ratio to
DDP (the median over iterations of the ratio of the two steps of one iteration, which ran
back to back under the same load) and the ratio of the medians, then one JSON line. Modes:

- ``ddp``: ``DistributedDataParallel(model, bucket_cap_mb=25)``, ``zero_grad``,
  ``ddp(batch).backward()``, ``step``;
- ``dp``: ``parallelize(model, ..., 'dp', ComputeConfig(plan_ngpus=1,
  runtime_ngpus=world))`` + ``build_optimizer``, then the same three calls on the parallel
  module: what a user of a plain training loop writes;
- ``dp_async``: the same with ``use_async_reducer=True`` (gradient reduction overlapping
  backward, like DDP);
- ``dp_e2e``: ``use_end2end=True`` and ``pm.train_step([batch])`` (what the trainer does).

Usage::

    python bench/parallel/bench_dp_vs_ddp.py [--steps 30] [--warmup 3] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/_launch.py
from _launch import compare_modes, launch, time_modes, training_step  # noqa: E402
from torch.nn.parallel import DistributedDataParallel

from nnscaler import ComputeConfig, build_optimizer, parallelize
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch

CONFIG = GPTConfig(vocab_size=1024, n_layer=4, n_head=4, d_model=256, seq_len=128)
BATCH = 8
LR = 1e-4
MODES = ("ddp", "dp", "dp_async", "dp_e2e")
TARGET = 1.05  # dp / ddp


def _model() -> GPTWithLoss:
    torch.manual_seed(0)
    return GPTWithLoss(CONFIG)


def _make_step(mode: str, rank: int, world: int, gen_savedir: str
               ) -> Callable[[], torch.Tensor]:
    """Build ``mode``'s model and optimizer; return a function running one training step
    (and returning its loss)."""
    batch = make_batch(CONFIG, BATCH, seed=rank)
    if mode == "ddp":
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=25)
        return training_step(ddp, torch.optim.Adam(ddp.parameters(), lr=LR), batch)
    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=world, use_end2end=mode == "dp_e2e",
                        use_async_reducer=mode == "dp_async")
    pm = parallelize(_model(), {"batch": batch}, "dp", cfg, gen_savedir=gen_savedir,
                     instance_name=mode)
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    return training_step(pm, opt, batch, end2end=mode == "dp_e2e")


def _run(rank: int, world: int, steps: int, warmup: int, gen_savedir: str
         ) -> dict[str, object]:
    fns = {mode: _make_step(mode, rank, world, gen_savedir) for mode in MODES}
    return time_modes(fns, steps, warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode first")
    ap.add_argument("--world", type=int, default=2, help="processes (data-parallel ranks)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as gen_savedir:
        results = launch(_run, args.world, args.steps, args.warmup, gen_savedir)
    summary = compare_modes(results, "ddp", args.steps, "ratio_vs_ddp")
    losses = results[0]["first_loss"]
    nparams = sum(p.numel() for p in _model().parameters())
    print(f"GPTWithLoss {CONFIG}\n{nparams} params, batch {BATCH}/rank, Adam, world "
          f"{args.world}, {args.steps} steps after {args.warmup} warm-up (median of the "
          f"per-step max over ranks)")
    print(f"{'mode':>9} | {'median step':>11} | {'vs DDP':>6} | {'medians':>7} | loss at step 0 "
          f"(rank 0)")
    for m, v in summary.items():
        print(f"{m:>9} | {v['median_ms']:8.1f} ms | {v['ratio_vs_ddp']:6.3f} | "
              f"{v['ratio_of_medians']:7.3f} | {losses[m]:.6f}")
    print("vs DDP: median over iterations of (this step / the DDP step of the same "
          "iteration); medians: ratio of the median step times")
    ratio = summary["dp"]["ratio_vs_ddp"]
    print(f"dp / ddp = {ratio:.3f} (target <= {TARGET}): {'ok' if ratio <= TARGET else 'MISSED'}")
    print(json.dumps({"bench": "dp_vs_ddp", "world": args.world, "params": nparams,
                      "batch_per_rank": BATCH, "steps": args.steps, "modes": summary,
                      "loss_step0": losses, "target_dp_ratio": TARGET}))


if __name__ == "__main__":
    main()
