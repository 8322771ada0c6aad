"""Train a character-level nanoGPT through PyTorch Lightning with nnscaler's strategy.

    python examples/nanogpt_lightning/train.py                 # 2 processes, data parallel
    python examples/nanogpt_lightning/train.py --config tp     # 2 processes, tensor parallel
    python examples/nanogpt_lightning/train.py --config megatron  # tp=2 + sequence parallel

Lightning starts the second process itself (as with its ``ddp`` strategy); under
``torchrun --nproc-per-node 2`` it joins the processes torchrun started. The text is
``input.txt`` beside this file (offline). ``--accelerator gpu`` runs on 2 GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import CharGPT, CharGPTConfig  # noqa: E402

from nnscaler import ComputeConfig  # noqa: E402
from nnscaler.integration.lightning import NnScalerStrategy  # noqa: E402

HERE = Path(__file__).resolve().parent

#: name -> (plan_ngpus per 2 processes, policy, pas_config)
CONFIGS = {
    "dp": (1, "dp", {}),
    "tp": (2, "tp", {}),
    "megatron": (2, "megatron", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
}


class CharDataset(Dataset):
    """Every window of ``block_size + 1`` characters: input and the next characters."""

    def __init__(self, text: str, block_size: int) -> None:
        self.chars = sorted(set(text))
        index = {ch: i for i, ch in enumerate(self.chars)}
        self.data = torch.tensor([index[ch] for ch in text], dtype=torch.long)
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = self.data[i: i + self.block_size + 1]
        return {"x": chunk[:-1], "y": chunk[1:]}


class LitCharGPT(pl.LightningModule):
    def __init__(self, config: CharGPTConfig, batch_size: int, lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = CharGPT(config)
        self.lr = lr
        ids = torch.zeros(batch_size, config.block_size, dtype=torch.long)
        # what nnscaler traces; two distinct tensors (see the README: one tensor passed
        # as two arguments is traced as one input)
        self.example_input_array = {"x": ids, "y": ids.clone()}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, y)  # example_input_array is the input of both forwards

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch["x"], batch["y"])
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="dp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--out", default="runs/nanogpt_lightning")
    args = parser.parse_args(argv)

    devices = 2
    plan, policy, pas_config = CONFIGS[args.config]
    text = (HERE / "input.txt").read_text()
    dataset = CharDataset(text, block_size=64)
    config = CharGPTConfig(vocab_size=len(dataset.chars), block_size=64)
    strategy = NnScalerStrategy(
        compute_config=ComputeConfig(plan_ngpus=plan, runtime_ngpus=devices),
        pas_policy=policy, pas_config=pas_config,
        gen_savedir=os.path.join(args.out, f".nnscaler-{args.config}"),
    )
    trainer = pl.Trainer(accelerator=args.accelerator, devices=devices, strategy=strategy,
                         precision="32-true", max_steps=args.steps, log_every_n_steps=10,
                         default_root_dir=os.path.join(args.out, args.config), logger=False)
    module = LitCharGPT(config, args.batch_size, args.lr)
    trainer.fit(module, DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                   drop_last=True))
    if trainer.is_global_zero:
        print(f"final loss {float(trainer.callback_metrics['loss']):.4f} "
              f"({args.config}, {args.steps} steps)")


if __name__ == "__main__":
    main()
