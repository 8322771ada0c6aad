"""Pipelines through the user's API: parallelize with ComputeConfig(pas_config=...) and the
'pp' / 'hybrid' policies by name, build_optimizer, train_step and infer_step."""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_utils import run_distributed
from pipeline_helpers import ATOL, LR, MOMENTUM, RTOL, case, micro_batches, reference

from nnscaler.policies import PolicyError


def _train(rank, world, gen_savedir, policy, plan_ngpus, pas_config, data):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    warnings.simplefilter("ignore")
    c = case("gpt")
    cfg = ComputeConfig(plan_ngpus=plan_ngpus, runtime_ngpus=world, use_end2end=True,
                        pas_config=pas_config)
    module = parallelize(c.module, {"batch": c.make_batch(0)}, policy, cfg,
                         gen_savedir=gen_savedir)
    opt = build_optimizer(module, torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    unit = rank // plan_ngpus
    losses, norms = [], []
    for step in data:
        losses.append([x.item() for x in module.train_step(step[unit])])
        norms.append(opt.clip_gnorm().item())  # every element once: tied copies too
        opt.step()
    evaluated = [x.item() for x in module.infer_step(data[0][unit])]
    return losses, evaluated, norms


@pytest.mark.parametrize("policy,plan_ngpus,world,pas", [
    ("pp", 2, 4, {"pipeline_nmicros": 4, "pipeline_scheduler": "1f1b"}),
    ("hybrid", 4, 4, {"pipeline_nstages": 2, "pipeline_nmicros": 2,
                      "pipeline_scheduler": "gpipe"}),
])
def test_parallelize_with_a_pipeline_policy(tmp_path, policy, plan_ngpus, world, pas):
    nunits = world // plan_ngpus
    data = [micro_batches("gpt", nunits, pas["pipeline_nmicros"], k) for k in range(2)]
    results = run_distributed(_train, world, str(tmp_path), policy, plan_ngpus, pas, data)
    ref = reference("gpt", data, 2)
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in ref["grads"].values())).float()
    for rank, (losses, _, norms) in enumerate(results):
        want = [per_step[rank // plan_ngpus] for per_step in ref["losses"]]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=RTOL,
                                   atol=ATOL)
        torch.testing.assert_close(torch.tensor(norms[0]), norm, rtol=RTOL, atol=ATOL)
    # after two steps, evaluation on every rank of a unit agrees
    for rank, (_, evaluated, _) in enumerate(results):
        first = results[(rank // plan_ngpus) * plan_ngpus][1]
        assert evaluated == first


def _non_end2end(rank, world, gen_savedir):
    from nnscaler import ComputeConfig, parallelize

    warnings.simplefilter("ignore")
    c = case("mlp8")
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, pas_config={"pipeline_nmicros": 2})
    try:
        parallelize(c.module, {"batch": c.make_batch(0)}, "pp", cfg, gen_savedir=gen_savedir)
    except PolicyError as e:
        return str(e)
    return None


def test_parallelize_refuses_a_non_end2end_module(tmp_path):
    for text in run_distributed(_non_end2end, 2, str(tmp_path)):
        assert text is not None and "compute_config.use_end2end is False" in text
