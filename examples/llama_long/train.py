"""Train `LongLlama` on one long sequence per step with context parallelism.

    torchrun --nproc_per_node=4 train.py --seq 16384             # the sequence split in 4
    torchrun --nproc_per_node=4 train.py --seq 16384 --degree 2  # split in 2, x 2 data parallel

Every process holds ``seq / degree`` tokens of every activation; attention is ring
attention (zigzag balanced, since it is causal) and the LM head and loss run on each
device's own tokens. ``--degree`` is ``plan_ngpus`` of the ``sequence`` policy and must
divide the number of processes (the rest is data parallelism: each scale unit trains on
its own sequences). On GPUs, launch the same way (NCCL is picked by the device).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama_long

from llama_long import SMALL, LongLlama, byte_windows  # noqa: E402


def build(seq: int, degree: int, *, attention: str = "ring", workdir: str = ".",
          chunk_size: int = 1024, **sizes: Any) -> tuple[torch.nn.Module, list[dict]]:
    """The parallel module on this process (the default process group must be running)
    and a dummy batch."""
    import torch.distributed as dist

    from nnscaler import ComputeConfig, parallelize

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = LongLlama(**{**SMALL, **sizes}, max_positions=max(seq, 1024), chunk_size=chunk_size)
    dummy = byte_windows(seq, 1)[0]
    config = ComputeConfig(plan_ngpus=degree, runtime_ngpus=world, use_end2end=True,
                           pas_config={"attention": attention})
    pm = parallelize(model, {"batch": dummy}, "sequence", config,
                     gen_savedir=str(Path(workdir) / ".nnscaler"),
                     instance_name=f"llama_long_s{seq}_d{degree}_w{world}")
    return pm, dummy


OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def train(seq: int, steps: int, degree: int, *, lr: float = 3e-3, workdir: str = ".",
          log: bool = True, optimizer: str = "adamw", **kw: Any) -> dict[str, Any]:
    """Train ``steps`` steps; returns this rank's losses and seconds per step."""
    import torch.distributed as dist

    from nnscaler import build_optimizer

    pm, _ = build(seq, degree, workdir=workdir, **kw)
    opt = build_optimizer(pm, OPTIMIZERS[optimizer], lr=lr)
    units = dist.get_world_size() // degree
    unit = dist.get_rank() // degree
    data = byte_windows(seq, steps * units)
    losses, seconds = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        loss = float(pm.train_step([data[step * units + unit]])[0])
        opt.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(loss)
        if log and dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.4f}, {seconds[-1]:.2f} s, "
                  f"{seq * units / seconds[-1]:.0f} tokens/s", flush=True)
    return {"losses": losses, "seconds": seconds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16384, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--degree", type=int, default=None,
                        help="context-parallel degree (plan_ngpus); default: every process")
    parser.add_argument("--attention", choices=("ring", "ulysses"), default="ring")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    parser.add_argument("--workdir", default=".")
    ns = parser.parse_args(argv)
    from nnscaler.runtime import init_distributed

    init_distributed()
    import torch.distributed as dist

    degree = ns.degree or dist.get_world_size()
    return train(ns.seq, ns.steps, degree, lr=ns.lr, workdir=ns.workdir,
                 optimizer=ns.optimizer, attention=ns.attention)


if __name__ == "__main__":
    main()
