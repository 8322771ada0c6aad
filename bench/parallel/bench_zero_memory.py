"""Optimizer-state bytes per rank with ZeRO stage 1 vs without.

Runs ``--world`` CPU processes (gloo, OMP_NUM_THREADS=1). Each parallelizes the 4-layer
``GPTWithLoss`` (d_model 256, 4 heads, seq 128, vocab 1024, batch 8 per rank) with the
``dp`` policy (``plan_ngpus=1, runtime_ngpus=world``) twice, with ``use_zero`` False and
True, builds Adam with ``build_optimizer`` for each, trains ``--steps`` steps (Adam creates
its state on the first), and sums the bytes of every tensor in ``optimizer.state`` on every
rank. Also reported: the bytes of the tensors the optimizer updates (with ZeRO, fp32 copies
of this rank's shard, held besides the model's parameters) and the loss of the last step
of both runs (ZeRO must not change training). Prints a table, then one JSON line.

Usage::

    python bench/parallel/bench_zero_memory.py [--world 2] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/_launch.py
from _launch import launch  # noqa: E402

from nnscaler import ComputeConfig, build_optimizer, parallelize
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch

CONFIG = GPTConfig(vocab_size=1024, n_layer=4, n_head=4, d_model=256, seq_len=128)
BATCH = 8
LR = 1e-4
TARGET = 0.55  # ZeRO / no ZeRO, optimizer state per rank
MODES = {"no_zero": False, "zero1": True}


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (Adam: exp_avg, exp_avg_sq, step)."""
    return _bytes([v for s in optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor)])


def _run(rank: int, world: int, steps: int, gen_savedir: str) -> dict[str, dict[str, float]]:
    out = {}
    batch = make_batch(CONFIG, BATCH, seed=rank)
    for mode, zero in MODES.items():
        torch.manual_seed(0)
        cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=world, use_zero=zero)
        pm = parallelize(GPTWithLoss(CONFIG), {"batch": batch}, "dp", cfg,
                         gen_savedir=gen_savedir, instance_name=mode)
        opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
        for _ in range(steps):
            opt.zero_grad()
            loss = pm(batch)
            loss.backward()
            opt.step()
        params = [p for g in opt.param_groups for p in g["params"]]
        out[mode] = {
            "state_bytes": state_bytes(opt),
            "optimizer_param_bytes": _bytes(params),
            "model_param_bytes": _bytes(list(pm.parameters())),
            "last_loss": float(loss),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--world", type=int, default=2, help="processes (data-parallel ranks)")
    ap.add_argument("--steps", type=int, default=2, help="training steps before measuring")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as gen_savedir:
        results = launch(_run, args.world, args.steps, gen_savedir)
    mib = 1 << 20
    print(f"GPTWithLoss {CONFIG}, dp policy, Adam, world {args.world}, measured after "
          f"{args.steps} steps")
    print(f"{'rank':>4} | {'mode':>7} | {'optimizer state':>15} | {'optimizer params':>16} | "
          f"{'model params':>12} | last loss")
    for rank, r in enumerate(results):
        for mode, v in r.items():
            print(f"{rank:>4} | {mode:>7} | {v['state_bytes'] / mib:11.3f} MiB | "
                  f"{v['optimizer_param_bytes'] / mib:12.3f} MiB | "
                  f"{v['model_param_bytes'] / mib:8.3f} MiB | {v['last_loss']:.6f}")
    worst = max(r["zero1"]["state_bytes"] / r["no_zero"]["state_bytes"] for r in results)
    with_copies = max(
        (r["zero1"]["state_bytes"] + r["zero1"]["optimizer_param_bytes"])
        / r["no_zero"]["state_bytes"] for r in results)
    same_loss = all(abs(r["zero1"]["last_loss"] - r["no_zero"]["last_loss"])
                    <= 1e-5 * abs(r["no_zero"]["last_loss"]) for r in results)
    print(f"optimizer state, ZeRO-1 / no ZeRO (worst rank): {worst:.3f} (target <= {TARGET}, "
          f"ideal {1 / args.world:.3f}): {'ok' if worst <= TARGET else 'MISSED'}")
    print(f"state + the fp32 shard copies ZeRO adds, / no-ZeRO state: {with_copies:.3f}")
    print(f"same loss after {args.steps} steps with and without ZeRO (rtol 1e-5): "
          f"{'yes' if same_loss else 'NO'}")
    print(json.dumps({"bench": "zero_memory", "world": args.world, "steps": args.steps,
                      "per_rank": results, "state_ratio": round(worst, 4),
                      "state_plus_shard_copies_ratio": round(with_copies, 4),
                      "same_loss": same_loss, "target_ratio": TARGET}))


if __name__ == "__main__":
    main()
