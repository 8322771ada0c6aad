"""ZeRO stages: memory per rank and step time, against DDP and FSDP2 (``fully_shard``).

Runs ``--world`` CPU processes (gloo, OMP_NUM_THREADS=1) on a 24-layer ``GPTWithLoss``
(d_model 128, 4 heads, seq 64, vocab 1024, batch 4 per rank), Adam, ``dp`` policy
(``plan_ngpus=1``), 1 MiB reducer buckets. Three parts:

1. **Memory by count** (exact): for ZeRO stage 0, 1, 2 and 3, after backward of the
   second step (the gradients' high point) and after its ``step()``, the bytes per rank
   of the parameters (stage 3: what the units hold outside forward and backward, none),
   the gradients (stage 2 and 3: the fp32 shard gradients plus the packed buckets still
   reducing) and the optimizer state (Adam's moments plus, with ZeRO, the fp32 master
   shards the optimizer updates, which are stage 3's parameters). Ratios to stage 0.
2. **Step time**: ``ddp`` (``DistributedDataParallel``), ``zero0`` (nnscaler ``dp``),
   ``zero2``, ``zero3`` and ``fsdp2`` (``fully_shard`` on every block, then on the
   model), interleaved in the same processes (`time_modes`), a step as slow as its
   slowest rank; ratios per iteration to ``ddp`` and to ``fsdp2``.
3. **Peak resident memory of a step**: each mode in fresh processes; after building the
   model and optimizer and one warm-up step, the peak RSS is reset
   (``/proc/self/clear_refs``) and read after ``--steps-peak`` steps, minus the RSS the
   process had before building anything (what the model, gradients, optimizer state and
   activations add). Ratios of ``zero2`` and ``zero3`` to ``fsdp2``.

Usage::

    python bench/zero/bench_zero.py [--world 4] [--steps 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/_launch.py
from _launch import compare_modes, launch, time_modes, training_step  # noqa: E402

from nnscaler import ComputeConfig, build_optimizer, parallelize
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch

CONFIG = GPTConfig(vocab_size=1024, n_layer=24, n_head=4, d_model=128, seq_len=64)
BATCH = 4
LR = 1e-4
CAP_MB = 1.0
STAGES = (0, 1, 2, 3)
TIMED = ("ddp", "zero0", "zero2", "zero3", "fsdp2")


def _model() -> GPTWithLoss:
    torch.manual_seed(0)
    return GPTWithLoss(CONFIG)


def _parallel(stage: int, world: int, gen_savedir: str, load: bool = True) -> Any:
    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=world, zero_stage=stage,
                        reducer_bucket_cap_mb=CAP_MB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parallelize(_model(), {"batch": make_batch(CONFIG, BATCH)}, "dp", cfg,
                           gen_savedir=gen_savedir, instance_name=f"zero{stage}",
                           load_module=load)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _count(pm: Any, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = list(pm.parameters())
    mine = {id(p) for p in params}
    grads = [p.grad for p in params if p.grad is not None]
    masters = [p for g in opt.param_groups for p in g["params"] if id(p) not in mine]
    grads += [p.grad for p in masters if p.grad is not None]
    grads += [b.packed for r in pm.reducers for b in r.buckets if b.packed is not None]
    state = [v for s in opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": _storage_bytes(params), "grads": _storage_bytes(grads),
            "optimizer": _storage_bytes(state) + _storage_bytes(masters)}


def _memory(rank: int, world: int, gen_savedir: str) -> dict[str, dict[str, int]]:
    out = {}
    batch = make_batch(CONFIG, BATCH, seed=rank)
    for stage in STAGES:
        pm = _parallel(stage, world, gen_savedir)
        opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
        for _ in range(2):
            opt.zero_grad()
            pm(batch).backward()
            after_backward = _count(pm, opt)
            opt.step()
        after_step = _count(pm, opt)
        out[f"zero{stage}"] = {"params": after_step["params"],
                               "grads": after_backward["grads"],
                               "optimizer": after_step["optimizer"]}
        del pm, opt
        gc.collect()
    return out


def _make_step(mode: str, rank: int, world: int, gen_savedir: str) -> Callable[[], Any]:
    batch = make_batch(CONFIG, BATCH, seed=rank)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
        return training_step(ddp, torch.optim.Adam(ddp.parameters(), lr=LR), batch)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = _model()
        for block in model.gpt.blocks:
            fully_shard(block)
        fully_shard(model)
        return training_step(model, torch.optim.Adam(model.parameters(), lr=LR), batch)
    pm = _parallel(int(mode[-1]), world, gen_savedir)
    return training_step(pm, build_optimizer(pm, torch.optim.Adam, lr=LR), batch)


def _timing(rank: int, world: int, steps: int, warmup: int, gen_savedir: str) -> Any:
    fns = {mode: _make_step(mode, rank, world, gen_savedir) for mode in TIMED}
    return time_modes(fns, steps, warmup)


def _kib(key: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", status).group(1))  # type: ignore[union-attr]


def _peak(rank: int, world: int, mode: str, steps: int, gen_savedir: str) -> int:
    """Bytes the step's peak resident memory lies above the process's start."""
    gc.collect()
    start = _kib("VmRSS")
    step = _make_step(mode, rank, world, gen_savedir)
    step()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from here
    for _ in range(steps):
        step()
    return (_kib("VmHWM") - start) * 1024


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--world", type=int, default=4, help="processes (data-parallel ranks)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    ap.add_argument("--steps-peak", type=int, default=3, help="steps of the peak run")
    args = ap.parse_args()
    mib = 1 << 20
    report: dict[str, Any] = {"bench": "zero", "world": args.world, "config": str(CONFIG)}
    with tempfile.TemporaryDirectory() as gen_savedir:
        for stage in STAGES:  # generate once, here: the runs below only load
            _parallel(stage, args.world, gen_savedir, load=False)
        memory = launch(_memory, args.world, gen_savedir)
        timing = launch(_timing, args.world, args.steps, args.warmup, gen_savedir)
        peaks = {mode: max(launch(_peak, args.world, mode, args.steps_peak, gen_savedir))
                 for mode in TIMED}
    print(f"GPTWithLoss {CONFIG}, batch {BATCH} per rank, Adam, {args.world} processes")
    print(f"{'mode':>6} | {'params':>9} | {'grads':>9} | {'optimizer':>9} | {'total':>9} | "
          f"/ stage 0 (worst rank)")
    base = [sum(r["zero0"].values()) for r in memory]
    report["memory"] = {}
    for stage in STAGES:
        key = f"zero{stage}"
        worst = max(sum(r[key].values()) / b for r, b in zip(memory, base))
        m = memory[0][key]
        print(f"{key:>6} | {m['params'] / mib:7.2f} M | {m['grads'] / mib:7.2f} M | "
              f"{m['optimizer'] / mib:7.2f} M | {sum(m.values()) / mib:7.2f} M | {worst:.3f}")
        report["memory"][key] = {**m, "ratio_to_stage0": round(worst, 3)}
    vs_ddp = compare_modes(timing, "ddp", args.steps, "per_step_ratio_to_ddp")
    vs_fsdp = compare_modes(timing, "fsdp2", args.steps, "per_step_ratio_to_fsdp2")
    print(f"{'mode':>6} | median step | / ddp | / fsdp2 | peak RSS over start")
    for mode in TIMED:
        print(f"{mode:>6} | {vs_ddp[mode]['median_ms']:8.1f} ms | "
              f"{vs_ddp[mode]['per_step_ratio_to_ddp']:5.3f} | "
              f"{vs_fsdp[mode]['per_step_ratio_to_fsdp2']:7.3f} | {peaks[mode] / mib:7.1f} MiB")
    report["time"] = {m: {**vs_ddp[m], **vs_fsdp[m]} for m in TIMED}
    report["peak_bytes"] = peaks
    for mode in ("zero2", "zero3"):
        report[f"peak_{mode}_over_fsdp2"] = _ratio(peaks[mode], peaks["fsdp2"])
        print(f"peak, {mode} / fsdp2: {report[f'peak_{mode}_over_fsdp2']}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
