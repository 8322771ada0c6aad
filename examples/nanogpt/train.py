"""Train the character GPT with the Trainer, configured from Python.

    torchrun --nproc_per_node=2 train.py                 # data parallel on 2 processes
    torchrun --nproc_per_node=2 train.py --tp            # tensor parallel inside 2 devices
    torchrun --nproc_per_node=2 train.py --steps 20      # a short run

``nnscaler-train -f config.yaml`` runs the same training from YAML.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # chargpt

from chargpt import CharDataset, CharGPT  # noqa: E402

from nnscaler.cli.trainer import Trainer  # noqa: E402
from nnscaler.cli.trainer_args import (  # noqa: E402
    CheckpointConfig,
    ComputeConfig,
    DataloaderConfig,
    DatasetConfig,
    LRSchedulerConfig,
    ModelConfig,
    OptimizerConfig,
    TrainerArgs,
)
from nnscaler.utils import set_default_logger_level  # noqa: E402


def trainer_args(steps: int = 300, tp: bool = False, workdir: str = ".",
                 chunked_loss: bool = False) -> TrainerArgs:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = 2 if tp else 1
    return TrainerArgs(
        compute_config=ComputeConfig(plan_ngpus=plan, runtime_ngpus=world, use_end2end=True),
        pas_policy="tp" if tp else "dp",
        instance_name=f"chargpt_{'tp' if tp else 'dp'}{'_chunked' if chunked_loss else ''}",
        gen_savedir=f"{workdir}/.nnscaler",
        seed=0,
        micro_batch_size=16,
        global_batch_size=32,
        max_train_steps=steps,
        val_every_n_train_steps=100,
        max_val_steps=20,
        log_every_n_steps=50,
        enable_progress_bar=False,
        model=ModelConfig(type=CharGPT, args={"n_layer": 2, "n_head": 4, "d_model": 64,
                                              "seq_len": 64, "chunked_loss": chunked_loss}),
        optimizer=OptimizerConfig(type=torch.optim.AdamW,
                                  args={"lr": 3e-3, "weight_decay": 0.0, "betas": (0.9, 0.99)},
                                  clip_gnorm=1.0),
        lr_scheduler=LRSchedulerConfig(type=torch.optim.lr_scheduler.CosineAnnealingLR,
                                       args={"T_max": steps, "eta_min": 3e-4}, interval="step"),
        dataset=DatasetConfig(type=CharDataset,
                              train_args={"split": "train", "block_size": 64, "stride": 16},
                              val_args={"split": "val", "block_size": 64}),
        dataloader=DataloaderConfig(train_args={"drop_last": True}),
        checkpoint=CheckpointConfig(save_dir=f"{workdir}/checkpoints",
                                    every_n_train_steps=100, keep_last_n_checkpoints=2),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tp", action="store_true", help="tensor parallel on 2 devices")
    parser.add_argument("--chunked-loss", action="store_true",
                        help="LM head + loss with chunk_linear_cross_entropy")
    parser.add_argument("--workdir", default=".")
    ns = parser.parse_args()
    set_default_logger_level("INFO")
    trainer = Trainer(train_args=trainer_args(ns.steps, ns.tp, ns.workdir, ns.chunked_loss))
    trainer.run()


if __name__ == "__main__":
    main()
