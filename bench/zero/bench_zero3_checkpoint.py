"""ZeRO stage-3 checkpoints: per-rank file bytes and save/load time, against stage 0 and
against stage 3 saving gathered parameters (``model.state_dict()``, the old way).

Runs ``--world`` CPU processes (gloo, OMP_NUM_THREADS=1) on bench/zero's 24-layer
``GPTWithLoss`` (d_model 128), Adam, ``dp`` policy, one training step first. Modes, each
in the same processes:

- ``zero0``: stage 0, ``rank_state_dict`` (= ``state_dict()``);
- ``zero3_gathered``: stage 3, ``model.state_dict()`` (every unit gathered for the copy);
- ``zero3``: stage 3, ``nnscaler.checkpoint.rank_state_dict`` (the shards).

Per mode: the bytes of each rank's module file and optimizer file, the units gathered
while saving (a spy on ``gather_unit``), the median over ``--reps`` of the save (state
dict + atomic write of both files, slowest rank), of a per-rank load into the same plan
(``load_state_dict``) and of ``load_resharded`` of every rank's files into the same plan.

Usage::

    python bench/zero/bench_zero3_checkpoint.py [--world 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/_launch.py
from _launch import launch  # noqa: E402

import nnscaler  # noqa: E402
from nnscaler import ComputeConfig, build_optimizer, parallelize  # noqa: E402
from nnscaler import checkpoint as ck  # noqa: E402
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch  # noqa: E402
from nnscaler.runtime import zero3  # noqa: E402

CONFIG = GPTConfig(vocab_size=1024, n_layer=24, n_head=4, d_model=128, seq_len=64)
BATCH = 4
MODES = {"zero0": 0, "zero3_gathered": 3, "zero3": 3}


def _parallel(stage: int, world: int, gen: str, init: bool = True) -> Any:
    torch.manual_seed(0)
    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=world, zero_stage=stage,
                        use_end2end=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parallelize(GPTWithLoss(CONFIG), {"batch": make_batch(CONFIG, BATCH)}, "dp",
                           cfg, gen_savedir=gen, instance_name=f"ckpt{stage}",
                           init_module_params=init)


def _timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


class _GatherCount:
    """Counts the calls of ``nnscaler.runtime.zero3.gather_unit`` (the units gathered)."""

    def __init__(self) -> None:
        self.count = 0
        real = zero3.gather_unit

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return real(*args, **kwargs)

        zero3.gather_unit = spy


def _mode(mode: str, rank: int, world: int, gen: str, out: str, reps: int,
          spy: _GatherCount) -> dict[str, Any]:
    stage = MODES[mode]
    pm = _parallel(stage, world, gen)
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-4)
    pm.train_step([make_batch(CONFIG, BATCH, seed=rank)])
    opt.step()
    model_file = os.path.join(out, f"{mode}-model{rank}.pt")
    opt_file = os.path.join(out, f"{mode}-opt{rank}.pt")

    def save() -> None:
        sd = pm.state_dict() if mode == "zero3_gathered" else ck.rank_state_dict(pm)
        ck.save(sd, model_file)
        ck.save(opt.state_dict(), opt_file)

    spy.count = 0
    saves = [_timed(save) for _ in range(reps)]
    save_gathers = spy.count // reps
    target = _parallel(stage, world, gen, init=False)
    target_opt = build_optimizer(target, torch.optim.Adam, lr=1e-4)

    def load_own() -> None:
        target.load_state_dict(ck.load(model_file))
        target_opt.load_state_dict(ck.load(opt_file))

    files = [os.path.join(out, f"{mode}-model{r}.pt") for r in range(world)]
    opt_files = [os.path.join(out, f"{mode}-opt{r}.pt") for r in range(world)]

    def reshard() -> None:
        nnscaler.load_resharded(target, files, target_opt, opt_files)

    loads = [_timed(load_own) for _ in range(reps)]
    reshards = [_timed(reshard) for _ in range(reps)]
    return {
        "model_bytes": os.path.getsize(model_file), "opt_bytes": os.path.getsize(opt_file),
        "gathers_while_saving": save_gathers, "save_s": statistics.median(saves),
        "load_same_plan_s": statistics.median(loads),
        "load_resharded_s": statistics.median(reshards),
    }


def _run(rank: int, world: int, gen: str, out: str, reps: int) -> dict[str, Any]:
    spy = _GatherCount()
    return {mode: _mode(mode, rank, world, gen, out, reps, spy) for mode in MODES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gen, out = os.path.join(tmp, "gen"), os.path.join(tmp, "out")
        os.makedirs(out)
        results = launch(_run, args.world, gen, out, args.reps)
    report: dict[str, Any] = {"world": args.world, "reps": args.reps}
    for mode in MODES:
        rows = [r[mode] for r in results]
        report[mode] = {
            "model_bytes_per_rank": [r["model_bytes"] for r in rows],
            "opt_bytes_per_rank": [r["opt_bytes"] for r in rows],
            "gathers_while_saving": max(r["gathers_while_saving"] for r in rows),
            **{k: round(max(r[k] for r in rows), 3)
               for k in ("save_s", "load_same_plan_s", "load_resharded_s")},
        }
    base = report["zero0"]
    for mode in ("zero3_gathered", "zero3"):
        m = report[mode]
        m["model_bytes_vs_zero0"] = round(max(m["model_bytes_per_rank"])
                                          / max(base["model_bytes_per_rank"]), 3)
        m["save_vs_zero0"] = round(m["save_s"] / base["save_s"], 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
