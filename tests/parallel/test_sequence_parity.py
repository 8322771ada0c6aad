"""Context parallelism end to end: the project's GPT trained 3 Adam steps with the
``sequence`` policy on 2 and 4 gloo processes (ring attention, zigzag balanced, and
Ulysses; with data parallelism over two scale units; with a batch of one, whose mean
loss splits over the tokens) equals one process: per-step
losses and every parameter after the steps, rtol 1e-5. The generated code calls the
part op with the group of its sequence chunks. With a tensor degree (tp 2 x cp 2 on 4
processes) under ``NNSCALER_SLOW_TESTS=1``."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from nnscaler.models.gpt import make_batch as gpt_batch

from .common import ADAM, GPT_CONFIG, check_pieces, make_model, reference_train, samples

CASES = [  # (plan_ngpus, runtime_ngpus, attention, batch size)
    (2, 2, "ring", 4),
    (4, 4, "ring", 1),  # a batch of one: the loss splits over the tokens too
    (2, 4, "ring", 4),  # two scale units: data x context parallelism
    (2, 2, "ulysses", 1),
]


def _samples(units: int, batch: int) -> list:
    if batch == 4:
        return samples("gpt", 3, units, 1)
    return [[[gpt_batch(GPT_CONFIG, batch, seed=100 * s + u)] for u in range(units)]
            for s in range(3)]


def _worker(rank, world, plan, attention, batch, gen_savedir, tp=1):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    units = world // plan
    data = _samples(units, batch)
    ref_losses, ref_state = reference_train(make_model("gpt"), data)
    cfg = ComputeConfig(plan_ngpus=plan, runtime_ngpus=world,
                        pas_config={"attention": attention,
                                    **({"tensor_parallel": tp} if tp > 1 else {})})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(make_model("gpt"), {"batch": data[0][0][0]}, "sequence", cfg,
                         gen_savedir=gen_savedir, instance_name=f"cp{plan}{world}{attention}")
    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    unit = rank // plan
    losses = []
    for step in data:
        loss = pm(step[unit][0])
        loss.backward()
        losses.append([loss.item()])
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([s[unit] for s in ref_losses]),
                               rtol=1e-5, atol=1e-6)
    return check_pieces(pm, ref_state)


@pytest.mark.parametrize(("plan", "world", "attention", "batch"), CASES,
                         ids=[f"p{p}r{w}-{a}-b{b}" for p, w, a, b in CASES])
def test_sequence_policy_trains_like_one_process(plan, world, attention, batch, tmp_path):
    checked = run_distributed(_worker, world, plan, attention, batch, str(tmp_path))
    assert all(c > 0 for c in checked)
    code = next(Path(tmp_path).rglob("gencode0.py")).read_text()
    assert "context_parallel_attention" in code and "self.part_group(" in code
    want = "'zigzag'" if attention == "ring" else "'ulysses'"
    assert f"strategy={want}" in code
    assert ("token_parallel_cross_entropy" in code) == (batch == 1)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("NNSCALER_SLOW_TESTS") != "1",
                    reason="slow: set NNSCALER_SLOW_TESTS=1")
def test_a_tensor_degree_trains_like_one_process(tmp_path):
    """tp 2 x cp 2 in one unit of 4 (``pas_config['tensor_parallel']``): the megatron
    policy's plan, handed the sizes by ``sequence``."""
    checked = run_distributed(_worker, 4, 4, "ring", 4, str(tmp_path), 2)
    assert all(c > 0 for c in checked)
    code = next(Path(tmp_path).rglob("gencode0.py")).read_text()
    assert "strategy='zigzag'" in code and "self.part_group(" in code
