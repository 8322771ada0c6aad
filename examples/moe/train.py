"""Train a tiny Mixtral with expert parallelism on CPU processes.

    torchrun --nproc_per_node=4 examples/moe/train.py            # 8 experts, 2 per rank
    torchrun --nproc_per_node=4 examples/moe/train.py --dense    # every expert everywhere

Expert parallelism is the ``data`` policy with ``pas_config={'expert_parallel': True}``:
the batch is split over the ranks and each Mixtral layer's experts too (the tracer finds
them by structure, nothing in the model changes). Each step the Trainer records what
every MoE layer routed; this script prints the busiest rank's share (``imbalance``). The
memory and step time against the dense plan are measured by ``bench/moe/bench_moe.py``.
"""

from __future__ import annotations

import argparse
import os

import torch

from nnscaler.cli.trainer import Trainer
from nnscaler.cli.trainer_args import (
    CheckpointConfig,
    ComputeConfig,
    DatasetConfig,
    ModelConfig,
    OptimizerConfig,
    TrainerArgs,
)

VOCAB, SEQ = 128, 32


class TinyMixtral(torch.nn.Module):
    """A random 2-layer Mixtral (8 experts, top-2) returning its loss, with the router's
    load-balancing loss."""

    def __init__(self, experts: int = 8) -> None:
        super().__init__()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers

        config = transformers.MixtralConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
            num_local_experts=experts, num_experts_per_tok=2, output_router_logits=True)
        torch.manual_seed(0)
        self.model = transformers.MixtralForCausalLM(config)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids=batch["ids"], labels=batch["ids"]).loss


class Tokens:
    """Random token sequences (the same for every rank and run)."""

    def __init__(self, size: int = 256) -> None:
        self.ids = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"ids": self.ids[i]}


class PrintRouting:
    """A Trainer hook: rank 0 prints each MoE layer's imbalance after every step."""

    def on_train_step_end(self, trainer: Trainer, outputs: object) -> None:
        if trainer.rank == 0:
            worst = max((r.imbalance for r in trainer.last_routing), default=1.0)
            print(f"step {trainer.global_step}: loss {trainer.last_train_loss:.4f}, "
                  f"busiest rank / mean tokens {worst:.2f}", flush=True)


def trainer_args(world: int, *, dense: bool = False, steps: int = 10,
                 savedir: str = ".nnscaler_moe") -> TrainerArgs:
    if dense:
        compute = ComputeConfig(plan_ngpus=1, runtime_ngpus=world, use_end2end=True)
        policy = "dp"
    else:
        compute = ComputeConfig(plan_ngpus=world, runtime_ngpus=world, use_end2end=True,
                                pas_config={"expert_parallel": True})
        policy = "data"
    return TrainerArgs(
        compute_config=compute, pas_policy=policy,
        model=ModelConfig(type=TinyMixtral),
        optimizer=OptimizerConfig(type=torch.optim.AdamW, args={"lr": 1e-3}),
        dataset=DatasetConfig(type=Tokens),
        micro_batch_size=2 if dense else 2 * world, global_batch_size=2 * world,
        max_train_steps=steps, enable_progress_bar=False, gen_savedir=savedir,
        instance_name="dense" if dense else "ep",
        checkpoint=CheckpointConfig(no_save=True))


def main(argv: list[str] | None = None) -> Trainer:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dense", action="store_true", help="every expert on every rank")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    trainer = Trainer(train_args=trainer_args(world, dense=args.dense, steps=args.steps))
    trainer.setup()
    trainer.hooks.append(PrintRouting())
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
