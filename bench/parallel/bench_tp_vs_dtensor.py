"""Step time of nnscaler's ``tp`` policy vs PyTorch DTensor tensor parallelism.

Runs ``--world`` CPU processes (gloo, OMP_NUM_THREADS=1), one scale unit of ``--world``
devices (``plan_ngpus = runtime_ngpus = world``), training the same 4-layer
``GPTWithLoss`` (d_model 256, 4 heads, seq 128, vocab 1024, batch 8, the same batch on
every rank) with Adam, in each mode in turn, in the same processes (steps interleave, in
an order that alternates), and prints the median step time of each after warm-up (a step
lasts as long as its slowest rank), its ratio to DTensor (the median over iterations of
the ratio of the two steps of one iteration; the ratio of the medians too), and the loss
at step 0 of each next to the single-process model's (a sanity check), then one JSON line.
Modes:

- ``dtensor``: ``torch.distributed.tensor.parallel.parallelize_module`` on every block over
  ``DeviceMesh('cpu', range(world))``: ``ColwiseParallel`` on ``attn.q_proj``,
  ``attn.k_proj``, ``attn.v_proj`` and ``mlp.fc``, ``RowwiseParallel`` on ``attn.o_proj``
  and ``mlp.proj`` (Megatron); embeddings, norms and the LM head replicated. The
  attention module instances of this baseline are patched for their local shard: a
  ``n_head`` divided by the TP degree and a forward that views the heads back with -1
  (the model's forward views to the full width ``c``);
- ``tp``: ``parallelize(model, ..., 'tp', ComputeConfig(plan_ngpus=world,
  runtime_ngpus=world))`` + ``build_optimizer``; ``zero_grad``, forward, backward, step;
- ``tp_e2e``: the same with ``use_end2end=True`` and ``pm.train_step([batch])``.

Usage::

    python bench/parallel/bench_tp_vs_dtensor.py [--steps 30] [--warmup 3] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/_launch.py
from _launch import compare_modes, launch, time_modes, training_step  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from nnscaler import ComputeConfig, build_optimizer, parallelize
from nnscaler.models.gpt import CausalSelfAttention, GPTConfig, GPTWithLoss, make_batch

CONFIG = GPTConfig(vocab_size=1024, n_layer=4, n_head=4, d_model=256, seq_len=128)
BATCH = 8
LR = 1e-4
MODES = ("dtensor", "tp", "tp_e2e")
TARGET = 0.9  # tp / dtensor
LOSS_RTOL = 1e-5


def _model() -> GPTWithLoss:
    torch.manual_seed(0)
    return GPTWithLoss(CONFIG)


def _sharded_attention_forward(self: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """``CausalSelfAttention.forward`` for a column-sharded q/k/v: ``self.n_head`` local
    heads, and the heads merged back with -1 (the local width, not the input's)."""
    b, t, _ = x.shape
    q, k, v = (self._heads(x, p) for p in (self.q_proj, self.k_proj, self.v_proj))
    p = self.dropout if self.training else 0.0
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(b, t, -1)
    return self.resid_dropout(self.o_proj(y))


def dtensor_model(world: int) -> GPTWithLoss:
    """The baseline: the model, Megatron-parallelized with DTensor over ``world`` ranks."""
    if CONFIG.attn != "sdpa" or CONFIG.n_head % world:
        raise SystemExit(f"the DTensor baseline needs attn='sdpa' and n_head divisible by "
                         f"{world}, got {CONFIG}")
    model = _model()
    mesh = DeviceMesh("cpu", list(range(world)))
    plan = {
        "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(),
    }
    for block in model.gpt.blocks:
        parallelize_module(block, mesh, plan)
        attn = block.attn
        attn.n_head = CONFIG.n_head // world  # this instance only: the local heads
        attn.forward = types.MethodType(_sharded_attention_forward, attn)
    return model


def _make_step(mode: str, world: int, gen_savedir: str) -> Callable[[], torch.Tensor]:
    """Build ``mode``'s model and optimizer; return a function running one training step
    (and returning its loss)."""
    batch = make_batch(CONFIG, BATCH, seed=0)  # one scale unit: the same batch everywhere
    if mode == "dtensor":
        model = dtensor_model(world)
        return training_step(model, torch.optim.Adam(model.parameters(), lr=LR), batch)
    cfg = ComputeConfig(plan_ngpus=world, runtime_ngpus=world, use_end2end=mode == "tp_e2e")
    pm = parallelize(_model(), {"batch": batch}, "tp", cfg, gen_savedir=gen_savedir,
                     instance_name=mode)
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    return training_step(pm, opt, batch, end2end=mode == "tp_e2e")


def _run(rank: int, world: int, steps: int, warmup: int, gen_savedir: str
         ) -> dict[str, object]:
    fns = {mode: _make_step(mode, world, gen_savedir) for mode in MODES}
    return time_modes(fns, steps, warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode first")
    ap.add_argument("--world", type=int, default=2, help="processes = the TP degree")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as gen_savedir:
        results = launch(_run, args.world, args.steps, args.warmup, gen_savedir)
    with torch.no_grad():
        reference = float(_model()(make_batch(CONFIG, BATCH, seed=0)))
    summary = compare_modes(results, "dtensor", args.steps, "ratio_vs_dtensor")
    # every rank's loss at step 0, every mode, against the single-process model's
    losses = {m: [r["first_loss"][m] for r in results] for m in MODES}
    same = all(abs(x - reference) <= LOSS_RTOL * abs(reference)
               for values in losses.values() for x in values)
    nparams = sum(p.numel() for p in _model().parameters())
    print(f"GPTWithLoss {CONFIG}\n{nparams} params, batch {BATCH} (one scale unit), Adam, "
          f"TP degree {args.world}, {args.steps} steps after {args.warmup} warm-up (median "
          f"of the per-step max over ranks)")
    print(f"{'mode':>8} | {'median step':>11} | {'vs DTensor':>10} | {'medians':>7} | loss at "
          f"step 0 (every rank)")
    for m, v in summary.items():
        shown = ", ".join(f"{x:.6f}" for x in losses[m])
        print(f"{m:>8} | {v['median_ms']:8.1f} ms | {v['ratio_vs_dtensor']:10.3f} | "
              f"{v['ratio_of_medians']:7.3f} | {shown}")
    print("vs DTensor: median over iterations of (this step / the DTensor step of the same "
          "iteration); medians: ratio of the median step times")
    print(f"single-process loss at step 0: {reference:.6f}; every mode and rank within "
          f"rtol {LOSS_RTOL:g}: {'yes' if same else 'NO'}")
    ratio = summary["tp"]["ratio_vs_dtensor"]
    print(f"tp / dtensor = {ratio:.3f} (target <= {TARGET}): "
          f"{'ok' if ratio <= TARGET else 'MISSED'}")
    print(json.dumps({"bench": "tp_vs_dtensor", "world": args.world, "params": nparams,
                      "batch": BATCH, "steps": args.steps, "modes": summary,
                      "loss_step0": losses, "loss_step0_reference": reference,
                      "loss_step0_match": same, "target_tp_ratio": TARGET}))
    if not same:
        raise SystemExit("the losses at step 0 differ: a baseline or nnscaler is wrong")


if __name__ == "__main__":
    main()
