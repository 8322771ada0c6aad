"""A resumed run equals the uninterrupted one: bitwise on the same world size and plan
(sharded, deduped and merged checkpoints, stopped mid-epoch, data drawing from every
RNG), and at rtol 1e-5 on another world size or plan (through merging)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from nnscaler.cli.trainer_args import CheckpointConfig, LRSchedulerConfig

from .common import (
    FixedDataset,
    NoisyDataset,
    assert_same_weights,
    merged_weights,
    run_trainer,
    trainer_args,
)

SCHED = LRSchedulerConfig(type="torch.optim.lr_scheduler.StepLR",
                          args={"step_size": 2, "gamma": 0.7}, interval="step")


def _args(tmp: Path, name: str, steps: int, save_type: str, resume: str | None = None,
          **kw):
    return trainer_args(
        tmp, max_train_steps=steps, dataset=kw.pop("dataset", NoisyDataset),
        lr_scheduler=SCHED,
        checkpoint=CheckpointConfig(save_dir=str(tmp / name), save_type=save_type,
                                    every_n_train_steps=3, resume_from=resume),
        **kw)


def _bitwise(rank, world, tmp):
    tmp = Path(tmp)
    out = {"full": run_trainer(_args(tmp, "full", 11, "sharded", world=world))}
    for save_type in ("sharded", "deduped", "merged"):
        # stops after step 5 (mid-epoch: 4 steps an epoch at 2 units) and saves it
        run_trainer(_args(tmp, save_type, 5, save_type, world=world))
        out[save_type] = run_trainer(_args(tmp, save_type, 11, save_type, "last", world=world))
    return out


def test_resume_is_bitwise_on_the_same_world_size_and_plan(tmp_path):
    results = run_distributed(_bitwise, 2, str(tmp_path))
    full = merged_weights([r["full"] for r in results])
    for save_type in ("sharded", "deduped", "merged"):
        resumed = [r[save_type] for r in results]
        assert resumed[0]["step"] == 11
        # the resumed run logged steps 6..11: the same losses as the full run's
        assert resumed[0]["losses"] == results[0]["full"]["losses"][5:], save_type
        assert_same_weights(merged_weights(resumed), full)
        assert resumed[0]["lr"] == results[0]["full"]["lr"]
        for r in results:  # optimizer state too, rank by rank
            a, b = r["full"]["optimizer"]["state"], r[save_type]["optimizer"]["state"]
            for k in a:
                for name in a[k]:
                    assert torch.equal(torch.as_tensor(a[k][name]), torch.as_tensor(b[k][name]))


def _stop_at_5(rank, world, tmp, policy, plan):
    run_trainer(_args(Path(tmp), "ck", 5, "sharded", dataset=FixedDataset, world=world,
                      plan=plan, policy=policy))


def _resume(rank, world, tmp, policy, plan):
    return run_trainer(_args(Path(tmp), "ck", 11, "sharded", "last", dataset=FixedDataset,
                             world=world, plan=plan, policy=policy))


@pytest.mark.parametrize("target", ["one-process", "tp"])
def test_resume_on_another_world_size_or_plan(tmp_path, target):
    full = run_trainer(_args(tmp_path, "full", 11, "sharded", dataset=FixedDataset))
    run_distributed(_stop_at_5, 2, str(tmp_path), "dp", 1)
    if target == "one-process":
        resumed = [run_trainer(_args(tmp_path, "ck", 11, "sharded", "last",
                                     dataset=FixedDataset))]
    else:
        resumed = run_distributed(_resume, 2, str(tmp_path), "tp", 2)
    assert resumed[0]["step"] == 11
    assert_same_weights(merged_weights(resumed), merged_weights([full]), exact=False)
    torch.testing.assert_close(resumed[0]["losses"], full["losses"][5:], rtol=1e-5, atol=0)


def _zero2(rank, world, tmp, stage):
    from nnscaler import ComputeConfig

    tmp = Path(tmp) / f"stage{stage}"
    cfg = ComputeConfig(1, world, use_end2end=True, zero_stage=stage)
    kw = {"world": world, "compute_config": cfg, "instance_name": f"zero{stage}"}
    full = run_trainer(_args(tmp, "full", 8, "sharded", **kw))
    run_trainer(_args(tmp, "ck", 5, "sharded", **kw))
    resumed = run_trainer(_args(tmp, "ck", 8, "sharded", "last", **kw))
    return full, resumed


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stage2_and_3_resume_is_bitwise(tmp_path, stage):
    """ZeRO stages 2 and 3 under the Trainer: a resumed run equals the uninterrupted one,
    and the merged weights equal a plain data-parallel run's (rtol 1e-5)."""
    results = run_distributed(_zero2, 2, str(tmp_path), stage)
    full = merged_weights([r[0] for r in results])
    resumed = [r[1] for r in results]
    assert resumed[0]["step"] == 8
    assert resumed[0]["losses"] == results[0][0]["losses"][5:]
    assert_same_weights(merged_weights(resumed), full)
    plain = run_distributed(_plain_dp, 2, str(tmp_path))
    assert_same_weights(merged_weights(plain), full, exact=False)


def _plain_dp(rank, world, tmp):
    return run_trainer(_args(Path(tmp), "plain", 8, "sharded", world=world))


def _zero3_stop_at_5(rank, world, tmp):
    from nnscaler import ComputeConfig

    cfg = ComputeConfig(1, world, use_end2end=True, zero_stage=3)
    run_trainer(_args(Path(tmp), "z3", 5, "sharded", dataset=FixedDataset, world=world,
                      compute_config=cfg, instance_name="zero3_w2"))


def test_zero_stage3_resume_on_another_number_of_processes(tmp_path):
    """A stage-3 run on 2 processes saves shards; one process (stage 3 too) resumes from
    them (load_resharded) and ends where the uninterrupted one-process run does."""
    from nnscaler import ComputeConfig

    full = run_trainer(_args(tmp_path, "full", 11, "sharded", dataset=FixedDataset))
    run_distributed(_zero3_stop_at_5, 2, str(tmp_path))
    from nnscaler.trainer import ckpt_layout

    last = ckpt_layout.complete_checkpoints(tmp_path / "z3")[-1]
    saved = torch.load(ckpt_layout.rank_file(last, 0), weights_only=True)
    extras = [v for k, v in saved["model"].items() if k.endswith("_extra_state")]
    assert extras and all(e["zero3"] for e in extras)  # the shards, not gathered parameters
    cfg = ComputeConfig(1, 1, use_end2end=True, zero_stage=3)
    resumed = run_trainer(_args(tmp_path, "z3", 11, "sharded", "last", dataset=FixedDataset,
                                compute_config=cfg, instance_name="zero3_w1"))
    assert resumed["step"] == 11
    assert_same_weights(merged_weights([resumed]), merged_weights([full]), exact=False)
    torch.testing.assert_close(resumed["losses"], full["losses"][5:], rtol=1e-5, atol=0)
