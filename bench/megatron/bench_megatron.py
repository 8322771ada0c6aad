"""Step time of the ``megatron`` policy against PyTorch's own tensor and pipeline
parallelism, each pair interleaved in the same processes.

``--part tp`` (2 CPU processes, gloo, one thread each): the GPT of
``bench/parallel/bench_tp_vs_dtensor.py`` (4 layers, d_model 256, 4 heads, seq 128, vocab
1024, batch 8, Adam), modes

- ``dtensor``: that script's baseline (``ColwiseParallel`` q/k/v/fc, ``RowwiseParallel``
  o_proj/proj on every block; embeddings, norms, LM head replicated);
- ``megatron``: ``parallelize(..., 'megatron', tensor_model_parallel_size=2)``;
- ``dtensor_sp``: the same with ``SequenceParallel`` on the norms, the row linears'
  outputs reduce-scattered to sequence shards and the attention/MLP inputs all-gathered
  (``PrepareModuleInput``);
- ``megatron_sp``: ``megatron`` with ``sequence_parallel=True``, compared to ``dtensor_sp``.

``--part pp``: the GPT and micro-batches of ``bench/pipeline/bench_pp_vs_torch.py``
(1F1B, 4 micro-batches), modes ``torch`` (``torch.distributed.pipelining``'s
``Schedule1F1B``, the model cut by hand at block 2, where ``megatron`` cuts 4 layers in
2 stages) and ``megatron`` (``pipeline_model_parallel_size=2``).

Prints the median step time of each (a step lasts as long as its slowest rank), the
median over iterations of its ratio to the baseline, the loss at step 0 of each next to
one process's, and one JSON line. Targets: megatron tp / dtensor <= 0.9; megatron pp /
torch <= 1.0.

Usage::

    python bench/megatron/bench_megatron.py --part tp [--steps 20] [--warmup 3]
    python bench/megatron/bench_megatron.py --part pp [--steps 10] [--warmup 2] [--micro 4]
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
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/_launch.py
sys.path.insert(0, str(HERE.parent / "parallel"))
sys.path.insert(0, str(HERE.parent / "pipeline"))
import bench_pp_vs_torch as ppb  # noqa: E402
import bench_tp_vs_dtensor as tpb  # noqa: E402
from _launch import compare_modes, launch, slowest_steps, time_modes, training_step  # noqa: E402
from nnscaler_policy_megatron import megatron_compute_config  # noqa: E402

from nnscaler import build_optimizer, parallelize  # noqa: E402
from nnscaler.models.gpt import make_batch  # noqa: E402

TP_TARGET, PP_TARGET = 0.9, 1.0
PP_SPLIT = 2  # megatron: 4 layers in 2 stages of 2


def dtensor_sp_model(world: int) -> Any:
    """The DTensor baseline with sequence parallelism: ``SequenceParallel`` on the block
    norms, the attention and MLP inputs all-gathered (``PrepareModuleInput``), the row
    linears reduce-scattered to sequence shards (``RowwiseParallel(output_layouts=
    Shard(1))``); the residual stream between blocks holds sequence shards, cut before
    the first block and gathered before the final norm."""
    import types

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model = tpb._model()
    mesh = DeviceMesh("cpu", list(range(world)))
    gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                  use_local_output=True)
    plan = {
        "ln_1": SequenceParallel(), "attn": PrepareModuleInput(**gather),
        "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_2": SequenceParallel(), "mlp": PrepareModuleInput(**gather),
        "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    blocks = model.gpt.blocks
    for block in blocks:
        parallelize_module(block, mesh, plan)
        block.attn.n_head = tpb.CONFIG.n_head // world
        block.attn.forward = types.MethodType(tpb._sharded_attention_forward, block.attn)
    parallelize_module(blocks[0], mesh, PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
    parallelize_module(model.gpt.ln_f, mesh, PrepareModuleInput(**gather))
    return model


def _tp_run(rank: int, world: int, steps: int, warmup: int, gen: str) -> dict[str, Any]:
    batch = make_batch(tpb.CONFIG, tpb.BATCH, seed=0)
    dt = tpb.dtensor_model(world)
    fns = {"dtensor": training_step(dt, torch.optim.Adam(dt.parameters(), lr=tpb.LR), batch)}
    dsp = dtensor_sp_model(world)
    fns["dtensor_sp"] = training_step(dsp, torch.optim.Adam(dsp.parameters(), lr=tpb.LR), batch)
    for mode, sp in (("megatron", False), ("megatron_sp", True)):
        cfg = megatron_compute_config(tensor_model_parallel_size=world, sequence_parallel=sp)
        pm = parallelize(tpb._model(), {"batch": batch}, "megatron", cfg, gen_savedir=gen,
                         instance_name=mode)
        fns[mode] = training_step(pm, build_optimizer(pm, torch.optim.Adam, lr=tpb.LR), batch)
    return time_modes(fns, steps, warmup)


def _pp_nnscaler_step(world: int, gen: str, data: list[dict[str, torch.Tensor]]):
    cfg = megatron_compute_config(pipeline_model_parallel_size=2, use_end2end=True,
                                  pas_config={"pipeline_nmicros": ppb.NMICROS,
                                              "pipeline_scheduler": "1f1b"})
    pm = parallelize(ppb._model(), {"batch": data[0]}, "megatron", cfg, gen_savedir=gen)
    opt = build_optimizer(pm, torch.optim.Adam, lr=ppb.LR)

    def step() -> list[float]:
        outs = pm.train_step(data)
        opt.step()
        return [float(x) for x in outs]

    return step


def _pp_run(rank: int, world: int, steps: int, warmup: int, micro: int, gen: str
            ) -> dict[str, Any]:
    data = [make_batch(ppb.CONFIG, micro, seed=m) for m in range(ppb.NMICROS)]
    fns = {"torch": ppb._torch_step(rank, PP_SPLIT, data),
           "megatron": _pp_nnscaler_step(world, gen, data)}
    times: dict[str, list[float]] = {m: [] for m in fns}
    first: dict[str, list[float]] = {}
    for i in range(warmup + steps):
        order = list(fns.items()) if i % 2 == 0 else list(reversed(fns.items()))
        for mode, fn in order:
            dist.barrier()
            t0 = time.perf_counter()
            losses = fn()
            elapsed = time.perf_counter() - t0
            if i == 0:
                first[mode] = losses
            if i >= warmup:
                times[mode].append(elapsed)
    return {"times": times, "first": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--part", choices=("tp", "pp"), required=True)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--micro", type=int, default=4, help="pp: sequences per micro-batch")
    args = ap.parse_args()
    world = 2
    with tempfile.TemporaryDirectory() as gen:
        if args.part == "tp":
            steps, warmup = args.steps or 20, args.warmup or 3
            results = launch(_tp_run, world, steps, warmup, gen)
            summary = compare_modes(results, "dtensor", steps, "ratio_vs_dtensor")
            with torch.no_grad():
                ref = float(tpb._model()(make_batch(tpb.CONFIG, tpb.BATCH, seed=0)))
            losses = {m: [r["first_loss"][m] for r in results] for m in summary}
            same = all(abs(x - ref) <= 1e-5 * abs(ref) for v in losses.values() for x in v)
            print(f"GPTWithLoss {tpb.CONFIG}, batch {tpb.BATCH}, Adam, tp=2, {steps} steps "
                  f"after {warmup} warm-up")
            for m, v in summary.items():
                print(f"{m:>12} | {v['median_ms']:8.1f} ms | vs dtensor "
                      f"{v['ratio_vs_dtensor']:.3f} (medians {v['ratio_of_medians']:.3f}) | "
                      f"loss@0 {', '.join(f'{x:.6f}' for x in losses[m])}")
            print(f"single-process loss at step 0 {ref:.6f}; all within rtol 1e-5: {same}")
            for m, base in (("megatron", "dtensor"), ("megatron_sp", "dtensor_sp")):
                r = statistics.median(
                    max(res["times"][m][i] for res in results)
                    / max(res["times"][base][i] for res in results) for i in range(steps))
                summary[m][f"ratio_vs_{base}"] = round(r, 3)
                print(f"{m} / {base} = {r:.3f} (target <= {TP_TARGET}): "
                      f"{'ok' if r <= TP_TARGET else 'MISSED'}")
            print(json.dumps({"bench": "megatron_tp_vs_dtensor", "modes": summary,
                              "loss_step0": losses, "reference": ref, "match": same}))
        else:
            steps, warmup = args.steps or 10, args.warmup or 2
            results = launch(_pp_run, world, steps, warmup, args.micro, gen)
            per_step = {m: slowest_steps(results, m) for m in ("torch", "megatron")}
            ratio = statistics.median(a / b for a, b in zip(per_step["megatron"],
                                                            per_step["torch"]))
            med = {m: statistics.median(v) * 1e3 for m, v in per_step.items()}
            first = {m: results[1]["first"][m] for m in per_step}
            print(f"GPTWithLoss {ppb.CONFIG}, {ppb.NMICROS} micro-batches of {args.micro}, "
                  f"1F1B, pp=2, {steps} steps after {warmup} warm-up")
            for m in per_step:
                print(f"{m:>9} | {med[m]:8.1f} ms | losses@0 "
                      f"{', '.join(f'{x:.6f}' for x in first[m])}")
            print(f"megatron / torch = {ratio:.3f} (target <= {PP_TARGET}): "
                  f"{'ok' if ratio <= PP_TARGET else 'MISSED'}")
            print(json.dumps({"bench": "megatron_pp_vs_torch", "median_ms": med,
                              "ratio": round(ratio, 3), "losses_step0": first}))


if __name__ == "__main__":
    main()
