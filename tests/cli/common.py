"""Models, datasets and helpers of the Trainer tests (importable by path as
``tests.cli.common.<Name>`` from YAML configs when the repository root is on sys.path)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nnscaler.cli.trainer_args import (
    CheckpointConfig,
    ComputeConfig,
    DatasetConfig,
    ModelConfig,
    OptimizerConfig,
    TrainerArgs,
)
from nnscaler.ops.builtin.moe import moe_experts

REPO = Path(__file__).resolve().parents[2]
DIM = 8
CLASSES = 4


class MLP(nn.Module):
    """Two linears and a GELU, loss first: the Trainer's end2end contract."""

    def __init__(self, dim: int = DIM, hidden: int = 16, classes: int = CLASSES) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self.fc2(F.gelu(self.fc1(data["x"]))), data["y"])


class TokenMLP(MLP):
    """Returns ``(loss_sum, num_tokens)``: for grad_reduction='per-token-mean'."""

    def forward(self, data: dict[str, torch.Tensor]) -> Any:
        logits = self.fc2(F.gelu(self.fc1(data["x"])))
        loss = F.cross_entropy(logits, data["y"], reduction="sum")
        return loss, data["y"].numel()


class MoEMLP(nn.Module):
    """An MoE layer (4 experts, top-2, through moe_experts) before the classifier."""

    def __init__(self, dim: int = DIM, ffn: int = 6, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * ffn, dim) / 3)
        self.down = nn.Parameter(torch.randn(experts, dim, ffn) / 3)
        self.fc = nn.Linear(dim, CLASSES)

    def forward(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        x = data["x"]
        weights, index = self.router(x).softmax(-1).topk(2, dim=-1)
        x = x + moe_experts(x, index, weights, self.gate_up, self.down, layer="moe")
        return F.cross_entropy(self.fc(x), data["y"])


class FixedDataset:
    """Samples that depend on their index only (no RNG)."""

    def __init__(self, size: int = 64, dim: int = DIM, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, dim, generator=g)
        self.y = torch.randint(0, CLASSES, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class NoisyDataset(FixedDataset):
    """Adds noise from torch's, Python's and numpy's global RNGs at every read, so a
    resumed run matches only when every RNG is restored."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        import numpy as np

        sample = super().__getitem__(i)
        noise = torch.rand(DIM) * 0.1 + random.random() * 0.01 + float(np.random.rand()) * 0.01
        return {"x": sample["x"] + noise, "y": sample["y"]}


def trainer_args(tmp: Path, *, world: int = 1, plan: int = 1, policy: str = "dp",
                 dataset: type = FixedDataset, model: type = MLP, **overrides: Any) -> TrainerArgs:
    """A small TrainerArgs writing under ``tmp``; keyword arguments replace fields."""
    fields: dict[str, Any] = dict(
        compute_config=ComputeConfig(plan_ngpus=plan, runtime_ngpus=world, use_end2end=True),
        model=ModelConfig(type=model),
        optimizer=OptimizerConfig(type=torch.optim.AdamW, args={"lr": 1e-2}),
        dataset=DatasetConfig(type=dataset, train_args={"size": 64}),
        pas_policy=policy,
        gen_savedir=str(tmp / "gen"),
        instance_name=f"{policy}_p{plan}_w{world}",
        micro_batch_size=4,
        global_batch_size=8,
        max_train_steps=6,
        enable_progress_bar=False,
        seed=0,
        checkpoint=CheckpointConfig(save_dir=str(tmp / "ckpt")),
    )
    fields.update(overrides)
    return TrainerArgs(**fields)


def run_trainer(args: TrainerArgs) -> dict[str, Any]:
    """Run a Trainer; return its merged-able state: this rank's model and optimizer state
    dicts, the losses it logged, the global step."""
    from nnscaler.cli.trainer import Trainer

    losses: list[float] = []

    class Record:
        def on_train_step_end(self, trainer: Any, outputs: Any) -> None:
            losses.append(trainer.last_train_loss)

    trainer = Trainer(train_args=args)
    trainer.setup()
    trainer.hooks.append(Record())
    try:
        trainer.train()
    finally:
        trainer._finalize()
    return {
        "model": _cpu(trainer.model.state_dict()),
        "optimizer": _cpu(trainer.optimizer.state_dict()),
        "losses": losses,
        "step": trainer.global_step,
        "compute_config": trainer.args.compute_config,
        "update_freq": trainer.args.update_freq,
        "lr": trainer.optimizer.param_groups[0]["lr"],
    }


def _cpu(tree: Any) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda x: x.detach().cpu().clone() if torch.is_tensor(x) else x, tree)


def merged_weights(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The full model state of a run's ranks."""
    from nnscaler import merge_state_dicts

    merged, _ = merge_state_dicts([r["model"] for r in results],
                                  [r["optimizer"] for r in results])
    return merged


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *,
                        exact: bool = True) -> None:
    assert set(a) == set(b)
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
