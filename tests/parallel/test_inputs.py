"""Run-time inputs against the traced ones: another batch size, dtype, or Python value is a
clear error naming the argument, the traced and the seen value, on every rank and before
any collective (before, a CollectiveError about internal layouts)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

from nnscaler import ComputeConfig, parallelize
from nnscaler.runtime.module import ParallelModuleError

from .common import make_batch, make_model

pytestmark = pytest.mark.filterwarnings("ignore::nnscaler.trace.OpaqueOpWarning")

ONE = ComputeConfig(plan_ngpus=1, runtime_ngpus=1)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale: float = 2.0, mask=None):
        return (self.fc(x) * scale).sum()


def test_shape_dtype_and_values_are_checked(tmp_path):
    pm = parallelize(Scaled(), {"x": torch.randn(3, 4), "scale": 0.5}, "dp", ONE,
                     gen_savedir=tmp_path)
    pm(torch.randn(3, 4), scale=0.5)  # as traced
    with pytest.raises(ParallelModuleError, match=r"'x' is a tensor of shape \[5, 4\] and dtype "
                       r"torch.float32, but the module was parallelized with a tensor of shape "
                       r"\[3, 4\] and dtype torch.float32.*not shape-generic.*drop_last=True"):
        pm(torch.randn(5, 4), scale=0.5)
    with pytest.raises(ParallelModuleError, match=r"dtype torch.float64, .*dtype torch.float32.*"
                       r"cast it with .to\(torch.float32\)"):
        pm(torch.randn(3, 4, dtype=torch.float64), scale=0.5)
    with pytest.raises(ParallelModuleError, match=r"'scale' is 3.0 \(float\), but the module was "
                       r"parallelized with 0.5, which it holds as a constant.*Pass 0.5"):
        pm(torch.randn(3, 4), scale=3.0)
    # an argument left out of dummy_forward_args was traced with its default
    with pytest.raises(ParallelModuleError, match=r"'mask' is a tensor of shape \[3\].* "
                       r"parallelized with None"):
        pm(torch.randn(3, 4), scale=0.5, mask=torch.ones(3))


def test_nested_inputs_are_named_by_their_path(tmp_path):
    batch = make_batch("mlp", seed=0)
    pm = parallelize(make_model("mlp"), {"batch": batch}, "dp", ONE, gen_savedir=tmp_path)
    smaller = {k: v[:2] for k, v in batch.items()}
    with pytest.raises(ParallelModuleError, match=r"\"batch\['x'\]\" is a tensor of shape \[2, 8\]"):
        pm(smaller)
    ints = {**batch, "y": batch["y"].to(torch.int32)}
    with pytest.raises(ParallelModuleError, match=r"\"batch\['y'\]\" is a tensor of shape \[4\] "
                       r"and dtype torch.int32"):
        pm(ints)


def _worker(rank, world, gen_savedir):
    batch = make_batch("gpt", seed=0)
    pm = parallelize(make_model("gpt"), {"batch": batch}, "tp",
                     ComputeConfig(plan_ngpus=2, runtime_ngpus=2), gen_savedir=gen_savedir)
    pm(batch).backward()  # as traced: fine
    bigger = make_batch("gpt", seed=1, batch_size=6)
    try:
        pm(bigger)
    except ParallelModuleError as e:
        return str(e)
    return None


def test_every_rank_names_the_argument_before_any_collective(tmp_path):
    for message in run_distributed(_worker, 2, str(tmp_path), timeout=120):
        assert message is not None
        assert "\"batch['input_ids']\" is a tensor of shape [6, 8]" in message
        assert "parallelized with a tensor of shape [4, 8]" in message


def _pipeline_worker(rank, world, gen_savedir):
    from nnscaler import ComputeConfig, parallelize

    batch = make_batch("mlp", seed=0)
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_end2end=True,
                        pas_config={"pipeline_nmicros": 2})
    pm = parallelize(make_model("mlp"), {"batch": batch}, "pp", cfg, gen_savedir=gen_savedir)
    pm.train_step([batch, make_batch("mlp", seed=1)])  # as traced: fine
    smaller = {k: v[:3] for k, v in make_batch("mlp", seed=2).items()}
    try:  # the second micro-batch is off: refused before stage 0 sends anything
        pm.train_step([batch, smaller])
    except ParallelModuleError as e:
        return str(e)
    return None


def test_a_pipeline_checks_every_micro_batch_on_every_rank(tmp_path):
    for message in run_distributed(_pipeline_worker, 2, str(tmp_path), timeout=120):
        assert message is not None and "\"batch['x']\" is a tensor of shape [3, 8]" in message
