"""The examples run offline: a few steps of each, on 2 processes."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from dist_utils import run_distributed

from .common import REPO

NANOGPT = REPO / "examples" / "nanogpt"


def _nanogpt_yaml(rank, world, tmp):
    os.chdir(tmp)
    sys.path.insert(0, str(NANOGPT))
    from nnscaler.cli.train import parse_args
    from nnscaler.cli.trainer import Trainer

    losses = []
    args = parse_args(["-f", str(NANOGPT / "config.yaml"), "--max_train_steps", "40",
                       "--val_every_n_train_steps", "40", "--max_val_steps", "4",
                       "--lr_scheduler.args.T_max", "40", "--checkpoint.no_save", "true"])
    trainer = Trainer(train_args=args)
    trainer.setup()
    trainer.hooks.append(type("H", (), {"on_val_end": lambda self, t, loss: losses.append(loss)})())
    trainer.train()
    return losses


@pytest.mark.slow
def test_nanogpt_yaml_config_learns(tmp_path):
    losses = run_distributed(_nanogpt_yaml, 2, str(tmp_path))
    # from ln(96) = 4.56 at the start; README: 0.95 after the full 300 steps
    assert losses[0][-1] < 2.9 and losses[0] == losses[1]


def _nanogpt_python(rank, world, tmp, tp, chunked):
    sys.path.insert(0, str(NANOGPT))
    os.environ["WORLD_SIZE"] = str(world)
    from train import trainer_args

    from cli.common import run_trainer

    args = trainer_args(steps=3, tp=tp, workdir=tmp, chunked_loss=chunked)
    args.checkpoint.no_save = True
    return run_trainer(args)["losses"]


@pytest.mark.slow
def test_nanogpt_tensor_parallel_with_chunked_loss(tmp_path):
    dp = run_distributed(_nanogpt_python, 2, str(tmp_path), False, False)[0]
    tp = run_distributed(_nanogpt_python, 2, str(tmp_path), True, True)[0]
    assert all(math.isfinite(x) for x in tp)
    torch.testing.assert_close(tp, dp, rtol=1e-4, atol=0)


LLAMA = REPO / "examples" / "llama"


def _llama_plans(rank, world, tmp):
    sys.path.insert(0, str(LLAMA))
    os.environ["WORLD_SIZE"] = str(world)
    from train import trainer_args

    from cli.common import run_trainer

    out = {}
    for plan in ("data", "tensor", "pipeline"):
        args = trainer_args(plan, steps=2, workdir=tmp)
        args.checkpoint.no_save = True
        out[plan] = run_trainer(args)["losses"]
    return out


@pytest.mark.slow
def test_llama_data_tensor_and_pipeline_plans(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    losses = run_distributed(_llama_plans, 2, str(tmp_path), timeout=400)[0]
    assert (tmp_path / "tokenizer.json").is_file()        # trained locally
    assert all(math.isfinite(x) for plan in losses.values() for x in plan)
    # tensor and pipeline parallel train one unit on the same batches: the same losses
    torch.testing.assert_close(losses["tensor"], losses["pipeline"], rtol=1e-5, atol=0)
