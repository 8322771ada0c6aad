"""The Trainer with ZeRO: stage 3 under ``precision='bf16'`` (bitwise the one-process
recipe, as tests/parallel/test_zero_mixed_precision.py proves for parallelize), and
``zero_stage='auto'`` (autodist chooses the stage; the losses and weights are the
one-process run's)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from dist_utils import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cli.common import (  # noqa: E402  (the Trainer tests' models and helpers)
    MLP,
    FixedDataset,
    assert_same_weights,
    merged_weights,
    trainer_args,
)

STEPS = 4


def _run(args: Any) -> dict[str, Any]:
    """A Trainer run: this rank's state dicts, the losses, the ZeRO stage of its reducers."""
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
        model, opt = trainer.model.state_dict(), trainer.optimizer.state_dict()
        stages = sorted({r.stage for r in trainer.model.reducers})
    finally:
        trainer._finalize()
    return {"model": model, "optimizer": opt, "losses": losses, "stages": stages}


def _worker(rank: int, world: int, tmp: str, overrides: dict[str, Any]) -> dict[str, Any]:
    from nnscaler import ComputeConfig

    overrides = dict(overrides)
    zero_stage = overrides.pop("zero_stage")
    cfg = ComputeConfig(1, world, use_end2end=True, zero_stage=zero_stage)
    return _run(trainer_args(Path(tmp), world=world, compute_config=cfg,
                             max_train_steps=STEPS, **overrides))


def _bf16_recipe(tmp: Path) -> dict[str, torch.Tensor]:
    """The recipe of 2 ranks by hand, on one process: the bf16 MLP; per step each rank's
    batch (its DistributedSampler shard) scaled by 1/2 before backward, the two bf16
    gradients summed in bf16 (the reduce-scatter of two ranks: one rounding) and taken to
    fp32; AdamW on fp32 master weights, rounded back into the bf16 weights."""
    from nnscaler.cli.precision import MixedPrecisionAdamW

    model = MLP()
    model.load_state_dict(torch.load(next((tmp / "gen").rglob("fullmodel.pt")),
                                     weights_only=True))
    model.to(torch.bfloat16)
    opt = MixedPrecisionAdamW(model.parameters(), lr=1e-2)
    data = FixedDataset(size=64)
    iters = []
    for rank in range(2):
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=rank)
        sampler.set_epoch(0)
        iters.append(iter(torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)))
    for _ in range(STEPS):
        summed = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for it in iters:
            model.zero_grad(set_to_none=True)
            b = next(it)
            (model({"x": b["x"].to(torch.bfloat16), "y": b["y"]}) * 0.5).backward()
            for n, p in model.named_parameters():
                summed[n] += p.grad
        for n, p in model.named_parameters():
            p.grad = summed[n]  # the optimizer takes it to fp32 (exact), as the shards do
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_bf16_with_stage3_is_the_recipe_bitwise(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path), {
        "zero_stage": 3, "precision": "bf16", "instance_name": "bf16_zero3"})
    assert all(r["stages"] == [3] for r in results)
    weights = merged_weights(results)
    ref = _bf16_recipe(tmp_path)
    for k in ref:
        assert weights[k].dtype == torch.bfloat16
        assert torch.equal(weights[k], ref[k]), k


def test_zero_stage_auto_trains_as_one_process(tmp_path):
    """autodist (the Trainer's default policy under 'auto') chooses the stage; parity
    with the one-process run of the same global batch (rtol 1e-5)."""
    results = run_distributed(_worker, 2, str(tmp_path / "two"), {
        "zero_stage": "auto", "policy": "autodist", "instance_name": "zero_auto"})
    stages = results[0]["stages"]
    assert len(stages) == 1 and stages[0] in (0, 1, 2, 3) and results[1]["stages"] == stages
    one = _run(trainer_args(tmp_path / "one", max_train_steps=STEPS))
    torch.testing.assert_close(torch.tensor(results[0]["losses"]),
                               torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert_same_weights(merged_weights(results), merged_weights([one]), exact=False)
