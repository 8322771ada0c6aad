"""Step time of the Trainer over a hand-written ``train_step`` loop on the same
ParallelModule.

Runs ``--world`` CPU processes (gloo, OMP_NUM_THREADS=1). One Trainer is set up (data
parallel ``dp``, the project's 4-layer ``GPTWithLoss``: d_model 256, seq 128, vocab 1024,
micro-batch 8 per rank, AdamW, grad_reduction 'mean', log line every 10 steps, no
progress bar, no checkpoints). Two modes then alternate step by step on its module and
optimizer, in the same processes:

- ``hand``: the loop a user writes: take a micro-batch from a DataLoader over the same
  dataset, ``model.train_step([batch], scale_fn=mean)``, ``optimizer.step()``;
- ``trainer``: one step of the Trainer's own loop (its loader, loss aggregation across
  ranks, hooks, LR bookkeeping, logging, ...).

Prints the median step of each and the median over iterations of trainer / hand (goal
<= 1.03), then one JSON line. Usage::

    python bench/trainer/bench_trainer_overhead.py [--steps 40] [--warmup 5] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/_launch.py

from _launch import compare_modes, launch, time_modes  # noqa: E402

from nnscaler.models.gpt import GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=1024, n_layer=4, n_head=4, d_model=256, seq_len=128)
BATCH = 8


class TokenData:
    """Random token windows, fixed by index."""

    def __init__(self, size: int = 4096) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, CONFIG.vocab_size, (size, CONFIG.seq_len + 1),
                                    generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class BenchGPT(torch.nn.Module):
    """GPTWithLoss with plain constructor arguments (a ModelConfig builds it)."""

    def __init__(self) -> None:
        super().__init__()
        from nnscaler.models.gpt import GPTWithLoss

        self.inner = GPTWithLoss(CONFIG)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.inner(batch)


def _run(rank: int, world: int, workdir: str, steps: int, warmup: int) -> dict:
    from nnscaler.cli.trainer import Trainer
    from nnscaler.cli.trainer_args import (
        CheckpointConfig,
        ComputeConfig,
        DatasetConfig,
        ModelConfig,
        OptimizerConfig,
        TrainerArgs,
    )

    args = TrainerArgs(
        compute_config=ComputeConfig(plan_ngpus=1, runtime_ngpus=world, use_end2end=True),
        model=ModelConfig(type=BenchGPT),
        optimizer=OptimizerConfig(type=torch.optim.AdamW, args={"lr": 1e-4}),
        dataset=DatasetConfig(type=TokenData),
        pas_policy="dp", gen_savedir=f"{workdir}/gen", seed=0, micro_batch_size=BATCH,
        max_train_steps=10**6, enable_progress_bar=False, log_every_n_steps=10,
        checkpoint=CheckpointConfig(save_dir=f"{workdir}/ckpt", no_save=True),
    )
    trainer = Trainer(train_args=args)
    trainer.setup()
    model, optimizer = trainer.model, trainer.optimizer
    factor = 1.0 / (args.update_freq * args.scaling_factor)

    hand_loader = torch.utils.data.DataLoader(
        trainer.train_dataset, batch_size=BATCH,
        sampler=torch.utils.data.DistributedSampler(trainer.train_dataset, world, rank))
    hand_it = iter(hand_loader)

    def hand() -> torch.Tensor:
        loss = model.train_step([next(hand_it)], scale_fn=lambda x: x * factor)[0]
        optimizer.step()
        return loss

    trainer.train_sampler.set_epoch(0)
    trainer_it = iter(trainer.train_loader)
    trainer.progress.open()

    def trainer_step() -> float:
        # the body of the Trainer's loop (StepLoop._train_epoch) for one step
        batches = [next(trainer_it) for _ in range(args.update_freq)]
        trainer.loop.train_step(batches)
        trainer.step_in_epoch += 1
        trainer.global_step += 1
        trainer.loop.after_step()
        return trainer.last_train_loss

    return time_modes({"hand": hand, "trainer": trainer_step}, steps, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--world", type=int, default=2)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        results = launch(_run, ns.world, workdir, ns.steps, ns.warmup)
    table = compare_modes(results, "hand", ns.steps, "step_over_hand")
    print(f"{'mode':8} {'median step':>12} {'x hand (median of ratios)':>26}")
    for mode, row in table.items():
        print(f"{mode:8} {row['median_ms']:>9.2f} ms {row['step_over_hand']:>26.3f}")
    print(json.dumps({"benchmark": "trainer_overhead", "world": ns.world, "steps": ns.steps,
                      "first_loss": results[0]["first_loss"], "modes": table}))


if __name__ == "__main__":
    main()
