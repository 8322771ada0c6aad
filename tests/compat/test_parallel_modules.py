"""``model.parallel_modules``: the Trainer parallelizes chosen submodule types (two
instances of one block here, after a trainable layer) and trains the model around them;
on 2 processes, data parallel and tensor parallel, it matches the whole model trained by
one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cli.common import CLASSES, DIM, assert_same_weights, merged_weights, run_trainer, trainer_args
from dist_utils import run_distributed
from torch import nn

from nnscaler import merge_state_dicts
from nnscaler.checkpoint.merge import parallel_prefixes
from nnscaler.cli.trainer_args import ConfigError, ModelConfig, ModuleParallelizeConfig


class Block(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 16)
        self.fc2 = nn.Linear(16, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Outer(nn.Module):
    """A trainable layer, a residual block, a block and a head: the blocks' input
    requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.block1 = Block()
        self.block2 = Block()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.embed(data["x"])
        h = self.block1(h) + h
        h = self.block2(h)
        return F.cross_entropy(self.head(h), data["y"])


def block_args(trainer_args) -> dict:
    return {"x": torch.randn(trainer_args.micro_batch_size, DIM, requires_grad=True)}


def _submodule_args(tmp: Path, world: int, plan: int, policy: str):
    args = trainer_args(tmp, world=world, plan=plan, policy=policy, model=Outer,
                        max_train_steps=10)
    args.model = ModelConfig(type=Outer, parallel_modules=[
        ModuleParallelizeConfig(type=Block, forward_args_gen_fn=block_args)])
    return args


def _worker(rank, world, tmp, policy, plan):
    return run_trainer(_submodule_args(Path(tmp), world, plan, policy))


@pytest.mark.parametrize("policy,plan", [("dp", 1), ("tp", 2)])
def test_parallel_submodules_equal_one_process(tmp_path, policy, plan):
    one = run_trainer(trainer_args(tmp_path / "one", model=Outer, max_train_steps=10))
    results = run_distributed(_worker, 2, str(tmp_path / policy), policy, plan)
    # the module state only: merging optimizer state that covers parameters outside the
    # parallel modules (embed, head) is refused (docs/migrating.md)
    assert parallel_prefixes(results[0]["model"]) == ["block1.", "block2."]
    merged, _ = merge_state_dicts([r["model"] for r in results])
    expected = merged_weights([one])
    assert set(merged) == set(expected)
    assert_same_weights(merged, expected, exact=False)
    torch.testing.assert_close(results[0]["losses"], one["losses"], rtol=1e-5, atol=0)


def test_parallel_modules_config_errors():
    with pytest.raises(ConfigError, match="names a type twice"):
        ModelConfig(type=Outer, parallel_modules=[
            {"type": Block, "forward_args_gen_fn": block_args},
            {"type": Block, "forward_args_gen_fn": block_args}])
    with pytest.raises(ConfigError, match="precision is not supported per parallel module"):
        ModelConfig(type=Outer, parallel_modules=[
            {"type": Block, "forward_args_gen_fn": block_args, "precision": "bf16"}])
    with pytest.raises(ConfigError, match="cannot be set per parallel module"):
        ModelConfig(type=Outer, parallel_modules=[
            {"type": Block, "forward_args_gen_fn": block_args,
             "compute_config": {"plan_ngpus": 2}}])


def test_parallel_modules_to_dict(tmp_path):
    args = _submodule_args(tmp_path, 1, 1, "dp")
    args.model.parallel_modules[0].compute_config = {"use_zero": False}
    args.model.parallel_modules[0]._validate("model.parallel_modules.0.")
    plain = args.to_dict()["model"]["parallel_modules"][0]
    assert plain["compute_config"]["use_zero"] is False
    assert plain["type"].endswith(".Block")
