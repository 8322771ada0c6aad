"""Train a small Hugging Face Llama with the Trainer on 2 processes, offline.

    torchrun --nproc_per_node=2 train.py --plan data       # data parallel (dp)
    torchrun --nproc_per_node=2 train.py --plan tensor     # tensor parallel (tp), 2 devices
    torchrun --nproc_per_node=2 train.py --plan pipeline   # 2 pipeline stages (pp, 1f1b)

The tokenizer is trained on ../nanogpt/text.txt at the first run (tokenizer.json).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama_lm

from llama_lm import LlamaLM, TokenDataset  # noqa: E402

from nnscaler.cli.trainer import Trainer  # noqa: E402
from nnscaler.cli.trainer_args import (  # noqa: E402
    CheckpointConfig,
    ComputeConfig,
    DataloaderConfig,
    DatasetConfig,
    ModelConfig,
    OptimizerConfig,
    TrainerArgs,
)
from nnscaler.utils import set_default_logger_level  # noqa: E402

#: plan -> (policy, plan_ngpus, pas_config)
PLANS = {
    "data": ("dp", 1, {}),
    "tensor": ("tp", 2, {}),
    "pipeline": ("pp", 2, {"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"}),
}


def trainer_args(plan: str = "data", steps: int = 50, workdir: str = ".") -> TrainerArgs:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    policy, plan_ngpus, pas_config = PLANS[plan]
    tokenizer = str(Path(workdir) / "tokenizer.json")
    data = {"seq_len": 32, "tokenizer": tokenizer}
    return TrainerArgs(
        compute_config=ComputeConfig(plan_ngpus=plan_ngpus, runtime_ngpus=world,
                                     use_end2end=True, pas_config=pas_config),
        pas_policy=policy,
        instance_name=f"llama_{plan}",
        gen_savedir=f"{workdir}/.nnscaler",
        seed=0,
        micro_batch_size=4,
        grad_accumulation_steps=2,          # = pipeline_nmicros for the pipeline plan
        max_train_steps=steps,
        val_every_n_train_steps=max(steps // 2, 1),
        max_val_steps=4,
        log_every_n_steps=10,
        enable_progress_bar=False,
        model=ModelConfig(type=LlamaLM, args={"vocab_size": 512}),
        optimizer=OptimizerConfig(type=torch.optim.AdamW, args={"lr": 2e-3}, clip_gnorm=1.0),
        dataset=DatasetConfig(type=TokenDataset, train_args={"split": "train", **data},
                              val_args={"split": "val", **data}),
        dataloader=DataloaderConfig(train_args={"drop_last": True}),
        checkpoint=CheckpointConfig(save_dir=f"{workdir}/checkpoints/{plan}",
                                    every_n_train_steps=steps),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", choices=sorted(PLANS), default="data")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workdir", default=".")
    ns = parser.parse_args()
    set_default_logger_level("INFO")
    Trainer(train_args=trainer_args(ns.plan, ns.steps, ns.workdir)).run()


if __name__ == "__main__":
    main()
