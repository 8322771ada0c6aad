"""nnScaler 0.8's names, imported and called as its users write them (one process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import nnscaler
from nnscaler import ComputeConfig, ComputeConfigError


def test_compute_config_as_nnscaler_users_write_it(monkeypatch):
    cfg = ComputeConfig(1, 2, use_zero=True)
    assert (cfg.plan_ngpus, cfg.runtime_ngpus, cfg.use_zero) == (1, 2, True)
    changed = dataclasses.replace(cfg, use_async_reducer=True)
    assert changed.use_async_reducer and changed.use_zero
    # 0 means the default bucket, and equals None
    assert ComputeConfig(1, 2, reducer_bucket_cap_mb=0) == ComputeConfig(1, 2)
    assert ComputeConfig(1, 2, reducer_bucket_cap_mb=0).bucket_cap_mb == 25.0
    assert ComputeConfig(1, 2, use_zero=True, zero_use_reduce_scatter=True).to_dict()[
        "zero_use_reduce_scatter"] is True
    with pytest.raises(ComputeConfigError, match="zero_use_reduce_scatter only applies"):
        ComputeConfig(1, 4, use_zero=True, zero_ngroups=2, zero_use_reduce_scatter=True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert ComputeConfig(plan_ngpus=2).runtime_ngpus == 4
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ComputeConfigError, match=r"\$WORLD_SIZE"):
        ComputeConfig(plan_ngpus=2)


def test_module_paths():
    from nnscaler import parallel
    from nnscaler.checkpoint import load_merged_state_dicts
    from nnscaler.runtime.f16_optimizer import MixedPrecisionAdam, MixedPrecisionAdamW
    from nnscaler.trainer.precision import mixed_precision

    assert nnscaler.load_merged_state_dict is load_merged_state_dicts
    for name in ("merge_state_dicts", "deduped_state_dict", "load_deduped_state_dict",
                 "load_merged_state_dict", "load_sharded_state_dict", "sync_grad_when"):
        assert getattr(parallel, name) is getattr(nnscaler, name), name
    assert MixedPrecisionAdam is mixed_precision(torch.optim.Adam)
    assert issubclass(MixedPrecisionAdamW, torch.optim.AdamW)


def test_init_needs_a_launcher(monkeypatch):
    from nnscaler.runtime.device import DeviceError

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(DeviceError, match="torchrun"):
        nnscaler.init()


class Folding(torch.nn.Module):
    def __init__(self, off: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.off = off

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = nnscaler.no_constant_folding() if self.off else nnscaler.constant_folding()
        with block:
            nnscaler.anchor("before the linear")
            n = nnscaler.fold_constant(x.shape[0])
            return self.linear(x).sum() / n


def test_constant_folding_blocks(tmp_path):
    from nnscaler.trace.markers import ConstantFoldingError

    x = torch.randn(3, 4)
    torch.manual_seed(0)
    model = Folding()
    expected = model(x)
    torch.manual_seed(0)
    pm = nnscaler.parallelize(Folding(), {"x": x}, "dp", ComputeConfig(1, 1),
                              gen_savedir=tmp_path)
    torch.testing.assert_close(pm(x), expected, rtol=1e-5, atol=0)
    assert Folding(off=True)(x).shape == ()  # outside a trace it does nothing
    with pytest.raises(ConstantFoldingError, match="always folds"):
        nnscaler.parallelize(Folding(off=True), {"x": x}, "dp", ComputeConfig(1, 1),
                             gen_savedir=tmp_path / "off")


def test_autodist_reads_update_freq_and_task_name():
    config = pytest.importorskip("nnscaler_policy_autodist.config")
    cfg = config.parse_config({"update_freq": 4, "task_name": "llama"})
    assert (cfg.update_freq, cfg.task_name) == (4, "llama")
    with pytest.raises(config.AutoDistError, match="update_freq"):
        config.parse_config({"update_freq": 0})


@nnscaler.register_op("* ->")  # nnScaler's op without outputs (called for its effect)
def record_sum(x: torch.Tensor) -> None:
    SEEN.append(float(x.sum()))


SEEN: list[float] = []


class Records(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        record_sum(y)
        return y.sum()


def test_op_without_outputs_and_eval_mode(tmp_path):
    x = torch.randn(2, 4)
    model = Records().eval()
    pm = nnscaler.parallelize(model, {"x": x}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    assert not pm.training  # an eval() module gives an eval() parallel module
    SEEN.clear()
    torch.testing.assert_close(pm(x), model(x), rtol=1e-5, atol=0)
    assert len(SEEN) == 2 and SEEN[0] == pytest.approx(SEEN[1], rel=1e-5)
