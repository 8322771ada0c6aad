"""The README's main job: a small GPT trained with tensor parallelism on 2 processes.

Run with ``torchrun --nproc_per_node 2 examples/main_job.py`` (``scripts/main_job.sh``
does); started with plain ``python`` it relaunches itself that way. CPU processes talk
over gloo; with GPUs each process takes one and NCCL.

``nnscaler.parallelize`` traces the GPT, the built-in ``tp`` policy splits it over the 2
devices of one scale unit (attention by heads, MLPs Megatron-style), and each rank loads
its generated program (``.nnscaler/_parallel_modules/.../gencode{rank}.py``). It trains
a few Adam steps with ``train_step``; rank 0 also trains the same model, from the same
weights, on one device, and compares the losses step by step.
"""

from __future__ import annotations

import copy
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from nnscaler import ComputeConfig, build_optimizer, parallelize
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.runtime import init_distributed

NPROC = 2
STEPS = 10
LR = 1e-2


def relaunch_with_torchrun() -> None:
    print(f"relaunching with torchrun --nproc_per_node {NPROC}", flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run",
                              "--nproc_per_node", str(NPROC), *sys.argv])


def to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def main() -> None:
    if "RANK" not in os.environ:
        relaunch_with_torchrun()
    world = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        os.environ.setdefault("NNSCALER_DEVICE", "cpu")  # not one GPU per process: CPU
    device = init_distributed()
    rank = dist.get_rank()
    warnings.filterwarnings("ignore", category=UserWarning, module="nnscaler")

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=32)
    model = GPTWithLoss(config)
    reference = copy.deepcopy(model)
    # two batches, seen in turn: a model that learns shows a falling loss
    batches = [make_batch(config, batch_size=4, seed=step % 2) for step in range(STEPS)]

    # one scale unit of `world` devices: every rank sees the same batch
    compute_config = ComputeConfig(plan_ngpus=world, runtime_ngpus=world, use_end2end=True)
    start = time.perf_counter()
    parallel_model = parallelize(model, {"batch": batches[0]}, "tp", compute_config,
                                 reuse="moo")  # regenerate when the model or code changed
    optimizer = build_optimizer(parallel_model, torch.optim.Adam, lr=LR)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        mine = sum(p.numel() for p in parallel_model.parameters())
        print(f"GPT with {params:,} parameters on {world} {device.type} processes: "
              f"rank 0 holds {mine:,} of them (parallelize took "
              f"{time.perf_counter() - start:.2f} s)")
        where = os.path.relpath(type(parallel_model).generated_dir())
        print(f"rank 0 runs {where}/gencode0.py")

    losses = []
    for step, batch in enumerate(batches):
        t0 = time.perf_counter()
        (loss,) = parallel_model.train_step([to(batch, device)])
        optimizer.step()
        losses.append(float(loss))
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}  ({time.perf_counter() - t0:.3f} s)",
                  flush=True)

    if rank == 0:
        reference.to(device)
        ref_opt = torch.optim.Adam(reference.parameters(), lr=LR)
        ref_losses = []
        for batch in batches:
            ref_opt.zero_grad()
            loss = reference(to(batch, device))
            loss.backward()
            ref_opt.step()
            ref_losses.append(loss.item())
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        tolerance = 1e-5 if device.type == "cpu" else 1e-3
        print(f"tp on {world} processes vs one device over {STEPS} steps: final loss "
              f"{losses[-1]:.6f} vs {ref_losses[-1]:.6f}, largest relative difference "
              f"{worst:.2e} ({'matches' if worst <= tolerance else 'DIFFERS'}, "
              f"tolerance {tolerance:g})")
        ok = worst <= tolerance
    else:
        ok = True
    flag = [ok]
    dist.broadcast_object_list(flag, src=0)
    if not flag[0]:
        raise SystemExit(1)
    # a plain return: nnscaler's exit hook (nnscaler.runtime.teardown) destroys the
    # process groups and joins their threads before the interpreter exits


if __name__ == "__main__":
    main()
