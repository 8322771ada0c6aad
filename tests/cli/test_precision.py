"""Mixed precision: fp32 master weights and state under bf16/fp16 modules, fp16 dynamic
loss scaling with skipped steps, and the Trainer equal to a hand-written loop of the same
recipe (and, across processes, within the precision's rounding)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from nnscaler.cli.precision import (
    DynamicLossScaler,
    MixedPrecisionAdamW,
    MixedPrecisionError,
    mixed_precision,
)
from nnscaler.cli.trainer_args import HookMapConfig

from .common import MLP, FixedDataset, merged_weights, run_trainer, trainer_args


@pytest.mark.parametrize("opt_cls,kwargs", [(torch.optim.AdamW, {"lr": 1e-2}),
                                            (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})])
def test_master_weights_follow_the_fp32_optimizer(opt_cls, kwargs):
    torch.manual_seed(0)
    low = torch.nn.Linear(6, 3).to(torch.bfloat16)
    ref = torch.nn.Linear(6, 3)
    ref.load_state_dict({k: v.float() for k, v in low.state_dict().items()})
    opt = mixed_precision(opt_cls)(low.parameters(), **kwargs)
    ref_opt = opt_cls(ref.parameters(), **kwargs)
    for _ in range(4):
        low(torch.randn(2, 6).bfloat16()).sum().backward()
        for p, q in zip(low.parameters(), ref.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, q in zip(low.parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        assert torch.equal(opt.state[p]["master_param"], q.detach())   # fp32, exact
        assert torch.equal(p.detach(), q.detach().bfloat16())           # rounded copy
    # state survives a round trip in fp32 (torch would cast it to the param's bf16)
    again = mixed_precision(opt_cls)(low.parameters(), **kwargs)
    again.load_state_dict(opt.state_dict())
    for p in low.parameters():
        for k, v in again.state[p].items():
            if torch.is_tensor(v) and k != "step":
                assert v.dtype == torch.float32 and torch.equal(v, opt.state[p][k])


def test_wrapper_refuses_factories_and_is_cached():
    assert mixed_precision(torch.optim.AdamW) is MixedPrecisionAdamW
    assert mixed_precision(MixedPrecisionAdamW) is MixedPrecisionAdamW
    with pytest.raises(MixedPrecisionError, match="not a factory"):
        mixed_precision(lambda params: torch.optim.SGD(params, lr=1))


def test_loss_scaler_backs_off_and_grows():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    s.update(True)
    assert (s.scale, s.skipped_steps) == (4.0, 1)
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


def _reference(tmp: Path, steps: int, dtype: torch.dtype) -> tuple[dict, int]:
    """The recipe by hand: module in `dtype`, inputs cast, fp32 masters, and for fp16 a
    loss scale starting at 2**16, halved on overflow (step skipped)."""
    model = MLP()
    model.load_state_dict(torch.load(next((tmp / "gen").rglob("fullmodel.pt")),
                                     weights_only=True))
    model.to(dtype)
    opt = MixedPrecisionAdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=BIG) if dtype == torch.float16 else None
    data = FixedDataset(size=64)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0)
    sampler.set_epoch(0)
    it = iter(torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler))
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        factor = 0.5 * (scaler.scale if scaler else 1.0)
        for _ in range(2):
            b = next(it)
            (model({"x": b["x"].to(dtype), "y": b["y"]}) * factor).backward()
        if scaler is not None:
            if not all(torch.isfinite(p.grad).all() for p in model.parameters()):
                scaler.update(True)
                continue
            scaler.update(False)
            for p in model.parameters():
                p.grad.mul_(1.0 / scaler.scale)
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, (
        scaler.skipped_steps if scaler else 0)


BIG = 2.0**20  # x the loss (~1.4) overflows fp16 (max 65504): the first steps are skipped


def big_loss_scale(trainer) -> None:
    if trainer.loss_scaler is not None:
        trainer.loss_scaler.scale = BIG


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_trainer_equals_the_recipe_by_hand(tmp_path, precision):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    result = run_trainer(trainer_args(tmp_path, max_train_steps=5, precision=precision,
                                      hook=HookMapConfig(after_setup=big_loss_scale)))
    weights = merged_weights([result])
    ref, skipped = _reference(tmp_path, 5, dtype)
    for k in ref:
        assert weights[k].dtype == dtype
        assert torch.equal(weights[k], ref[k]), k
    if precision == "fp16":
        assert skipped >= 1


def _run(rank, world, tmp, policy, plan):
    return run_trainer(trainer_args(Path(tmp), world=world, plan=plan, policy=policy,
                                    precision="bf16", max_train_steps=5))


def test_two_processes_bf16_close_to_one(tmp_path):
    one = merged_weights([run_trainer(trainer_args(tmp_path / "one", max_train_steps=5,
                                                   precision="bf16"))])
    two = merged_weights(run_distributed(_run, 2, str(tmp_path / "dp"), "dp", 1))
    for k in one:
        # gradients summed in another order, in bf16 (8 bits of mantissa)
        torch.testing.assert_close(two[k].float(), one[k].float(), rtol=2e-2, atol=2e-2)
