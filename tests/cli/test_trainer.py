"""The Trainer trains exactly what a hand-written loop trains, on one process and on
several (data and tensor parallel), and its checkpoints rotate and never look complete
when they are not."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from nnscaler.cli import checkpointing as ckpt
from nnscaler.cli.trainer import Trainer, TrainerError
from nnscaler.cli.trainer_args import CheckpointConfig, LRSchedulerConfig, OptimizerConfig
from nnscaler.trainer.checkpointer import Checkpointer

from .common import (
    MLP,
    FixedDataset,
    TokenMLP,
    assert_same_weights,
    merged_weights,
    run_trainer,
    trainer_args,
)


def _reference(tmp: Path, steps: int, *, per_token: bool = False) -> dict[str, torch.Tensor]:
    """The same training written by hand on the original module: same initial weights
    (the generated fullmodel.pt), same sampler order, same micro-batches."""
    gen = next((tmp / "gen").rglob("fullmodel.pt"))
    model = TokenMLP() if per_token else MLP()
    model.load_state_dict(torch.load(gen, weights_only=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = FixedDataset(size=64)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        it = iter(loader)
        for _ in range(len(loader) // 2):
            if done == steps:
                break
            optimizer.zero_grad()
            batches = [next(it), next(it)]
            if per_token:
                outs = [model(b) for b in batches]
                tokens = sum(o[1] for o in outs)
                for o in outs:
                    o[0].backward()
                for p in model.parameters():
                    p.grad.mul_(1.0 / tokens)
            else:
                for b in batches:
                    (model(b) * 0.5).backward()
            optimizer.step()
            done += 1
        epoch += 1
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("per_token", [False, True])
def test_one_process_equals_handwritten_loop(tmp_path, per_token):
    # 10 steps of 8 samples cross the epoch boundary (64 samples, 8 steps an epoch)
    extra = {}
    if per_token:
        extra = dict(model=TokenMLP, optimizer=OptimizerConfig(
            type=torch.optim.AdamW, args={"lr": 1e-2}, grad_reduction="per-token-mean"))
    args = trainer_args(tmp_path, max_train_steps=10, **extra)
    result = run_trainer(args)
    assert result["step"] == 10 and len(result["losses"]) == 10
    assert_same_weights(merged_weights([result]), _reference(tmp_path, 10, per_token=per_token))


def _two_process_run(rank, world, tmp, policy, plan):
    return run_trainer(trainer_args(Path(tmp), world=world, plan=plan, policy=policy,
                                    max_train_steps=10))


@pytest.mark.parametrize("policy,plan", [("dp", 1), ("tp", 2), ("autodist", "auto")])
def test_two_processes_equal_one(tmp_path, policy, plan):
    one = run_trainer(trainer_args(tmp_path / "one", max_train_steps=10))
    results = run_distributed(_two_process_run, 2, str(tmp_path / policy), policy, plan)
    assert_same_weights(merged_weights(results), merged_weights([one]), exact=False)
    torch.testing.assert_close(results[0]["losses"], one["losses"], rtol=1e-5, atol=0)
    config = results[0]["compute_config"]  # 'auto' resolved to the plan's unit size
    assert config.plan_ngpus in (1, 2) and config.runtime_ngpus == 2
    assert config.scale_units * 4 * results[0]["update_freq"] == 8  # the global batch kept


def test_rotation_last_and_best(tmp_path):
    args = trainer_args(tmp_path, max_train_steps=5, checkpoint=CheckpointConfig(
        save_dir=str(tmp_path / "ckpt"), every_n_train_steps=1, keep_last_n_checkpoints=2))
    run_trainer(args)
    root = tmp_path / "ckpt"
    names = sorted(p.name for p in root.iterdir())
    best = os.readlink(root / "best")
    assert os.readlink(root / "last") == "0000-0005"
    # the two newest, plus the one `best` links to (never rotated away)
    assert set(names) == {"0000-0004", "0000-0005", "best", "last", best}
    assert not [n for n in names if n.startswith(".")]
    meta = ckpt.read_meta(root / "0000-0005")
    assert meta["train_status"]["step"] == 5 and meta["save_type"] == "sharded"


def test_failed_save_leaves_no_complete_checkpoint(tmp_path, monkeypatch):
    args = trainer_args(tmp_path, max_train_steps=4, checkpoint=CheckpointConfig(
        save_dir=str(tmp_path / "ckpt"), every_n_train_steps=1))
    real_write = Checkpointer.write_state

    def crash_at_step_3(self, folder):
        if self.trainer.global_step == 3:
            (folder / "0.ckpt").write_bytes(b"half a file")
            raise OSError("disk full")
        real_write(self, folder)

    monkeypatch.setattr(Checkpointer, "write_state", crash_at_step_3)
    with pytest.raises(TrainerError, match="saving checkpoint 0000-0003 failed.*disk full"):
        run_trainer(args)
    root = tmp_path / "ckpt"
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["0000-0001", "0000-0002"]
    assert (root / ".0000-0003.partial").is_dir()      # incomplete, never resumed from
    assert ckpt.resolve_resume("last", root).name == "0000-0002"
    monkeypatch.setattr(Checkpointer, "write_state", real_write)
    run_trainer(trainer_args(tmp_path, max_train_steps=4, checkpoint=CheckpointConfig(
        save_dir=str(root), every_n_train_steps=1, resume_from="last")))
    assert not (root / ".0000-0003.partial").exists()  # the next save of that name cleans it
    assert [p.name for p in ckpt.complete_checkpoints(root)][-1] == "0000-0004"


def test_lr_scheduler_steps_by_interval(tmp_path):
    sched = LRSchedulerConfig(type="torch.optim.lr_scheduler.StepLR",
                              args={"step_size": 1, "gamma": 0.5}, interval="step")
    result = run_trainer(trainer_args(tmp_path, max_train_steps=3, lr_scheduler=sched))
    assert result["lr"] == pytest.approx(1e-2 * 0.5**3)
    sched = LRSchedulerConfig(type="torch.optim.lr_scheduler.StepLR",
                              args={"step_size": 1, "gamma": 0.5}, interval="epoch")
    result = run_trainer(trainer_args(tmp_path / "e", max_train_steps=10, lr_scheduler=sched))
    assert result["lr"] == pytest.approx(1e-2 * 0.5)   # one epoch (8 steps) ended


@pytest.mark.parametrize("strategy", ["real", "meta"])
def test_pretrained_folder_is_where_training_starts(tmp_path, strategy):
    # model.pretrained: load_pretrained after building the module; with a meta trace the
    # model is built with its parameters on the meta device
    from nnscaler import ComputeConfig, merge_state_dicts
    from nnscaler.cli.trainer_args import ModelConfig

    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(7)
    start = MLP().state_dict()
    (tmp_path / "hub").mkdir()
    safetensors_torch.save_file(dict(start), tmp_path / "hub" / "model.safetensors",
                                metadata={"format": "pt"})
    config = ComputeConfig(plan_ngpus=1, runtime_ngpus=1, use_end2end=True,
                           trace_strategy=strategy)
    args = dataclasses.replace(trainer_args(tmp_path, compute_config=config),
                               model=ModelConfig(type=MLP, pretrained=str(tmp_path / "hub")))
    trainer = Trainer(train_args=args)
    trainer.setup()
    try:
        got, _ = merge_state_dicts([trainer.model.state_dict()])
    finally:
        trainer._finalize()
    assert_same_weights(got, dict(start))
    saved = torch.load(next((tmp_path / "gen").rglob("fullmodel.pt")), weights_only=True)
    assert saved["fc1.weight"].is_meta == (strategy == "meta")  # no weights written
