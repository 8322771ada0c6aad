"""Step time of generated code under ``torch.compile`` (``ComputeConfig(compile=True)``)
vs the same generated code in eager mode vs DDP + ``torch.compile``.

Runs ``--world`` CPU processes (gloo, OMP_NUM_THREADS=1) training the same 2-layer
``GPTWithLoss`` (d_model 128, 4 heads, seq 64, vocab 512, batch 8 per rank) with Adam, in
each mode in turn, in the same processes (steps interleave, in an order that alternates,
so load drifts hit every mode alike), and prints the median step time of each after
warm-up (a step lasts as long as its slowest rank; the warm-up includes the
compilation), its ratio to the eager generated code and the ratio of the medians, then one
JSON line. Modes:

- ``dp``: ``parallelize(model, ..., 'dp', ComputeConfig(1, world, use_end2end=True))``,
  ``train_step`` + Adam (eager generated code);
- ``dp_compiled``: the same with ``compile=True`` (inductor; regions between
  communication compiled, the reducer eager);
- ``ddp_compiled``: ``torch.compile(DistributedDataParallel(model))`` (DDP's optimizer
  splits the graph at its buckets), ``zero_grad``, ``backward``, ``step``;
- with ``--tp``: ``tp`` and ``tp_compiled``: the ``tp`` policy on a unit of ``world``
  devices, eager and compiled (adapters and collective part ops break the graph).

Usage::

    python bench/parallel/bench_torch_compile.py [--steps 20] [--warmup 3] [--world 2] [--tp]
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

CONFIG = GPTConfig(vocab_size=512, n_layer=2, n_head=4, d_model=128, seq_len=64)
BATCH = 8
LR = 1e-4


def _model() -> GPTWithLoss:
    torch.manual_seed(0)
    return GPTWithLoss(CONFIG)


def _make_step(mode: str, rank: int, world: int, gen_savedir: str
               ) -> Callable[[], torch.Tensor]:
    """Build ``mode``'s model and optimizer; return a function running one training step
    (and returning its loss)."""
    if mode == "ddp_compiled":
        batch = make_batch(CONFIG, BATCH, seed=rank)
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=25)
        opt = torch.optim.Adam(ddp.parameters(), lr=LR)
        return training_step(torch.compile(ddp), opt, batch)
    policy, _, compiled = mode.partition("_")
    plan = 1 if policy == "dp" else world
    batch = make_batch(CONFIG, BATCH, seed=rank if plan == 1 else 0)
    cfg = ComputeConfig(plan, world, use_end2end=True, compile=bool(compiled))
    pm = parallelize(_model(), {"batch": batch}, policy, cfg, gen_savedir=gen_savedir,
                     instance_name=mode)
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    return training_step(pm, opt, batch, end2end=True)


def _run(rank: int, world: int, modes: list[str], steps: int, warmup: int,
         gen_savedir: str) -> dict[str, object]:
    fns = {mode: _make_step(mode, rank, world, gen_savedir) for mode in modes}
    return time_modes(fns, steps, warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps per mode first (the first one compiles)")
    ap.add_argument("--world", type=int, default=2, help="processes")
    ap.add_argument("--tp", action="store_true", help="also the tp policy, eager and compiled")
    args = ap.parse_args()
    modes = ["dp", "dp_compiled", "ddp_compiled"] + (["tp", "tp_compiled"] if args.tp else [])
    with tempfile.TemporaryDirectory() as gen_savedir:
        results = launch(_run, args.world, modes, args.steps, args.warmup, gen_savedir)
    summary = compare_modes(results, "dp", args.steps, "ratio_vs_dp_eager")
    losses = results[0]["first_loss"]
    nparams = sum(p.numel() for p in _model().parameters())
    print(f"GPTWithLoss {CONFIG}\n{nparams} params, batch {BATCH}/rank, Adam, world "
          f"{args.world}, torch {torch.__version__}, {args.steps} steps after {args.warmup} "
          f"warm-up (median of the per-step max over ranks)")
    print(f"{'mode':>13} | {'median step':>11} | {'vs dp':>6} | {'medians':>7} | "
          f"loss at step 0 (rank 0)")
    for m, v in summary.items():
        print(f"{m:>13} | {v['median_ms']:8.2f} ms | {v['ratio_vs_dp_eager']:6.3f} | "
              f"{v['ratio_of_medians']:7.3f} | {losses[m]:.6f}")
    ours = compare_modes(results, "ddp_compiled", args.steps, "r")["dp_compiled"]["r"]
    print(f"compiled / eager generated code (dp) = {summary['dp_compiled']['ratio_vs_dp_eager']:.3f}"
          f"; ours compiled / DDP compiled = {ours:.3f} (medians over iterations of the "
          f"ratio of two steps run back to back)")
    print(json.dumps({"bench": "torch_compile", "world": args.world, "params": nparams,
                      "batch_per_rank": BATCH, "steps": args.steps, "modes": summary,
                      "ours_compiled_vs_ddp_compiled": ours,
                      "loss_step0": losses, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
