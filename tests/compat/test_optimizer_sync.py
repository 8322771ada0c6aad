"""nnScaler's optimizer calls in nnScaler's order: ``clip_gnorm()`` after ``step()`` (as its
own tests write it) reads the gradients that the step used, summed across data-parallel
ranks once, not twice."""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_utils import run_distributed
from parallel.common import ADAM, make_batch, make_model


def _reference_norm(batches):
    model = make_model("mlp")
    for batch in batches:
        model(batch).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))


def _worker(rank, world, gen_savedir):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    warnings.simplefilter("ignore")
    batches = [make_batch("mlp", seed=r) for r in range(world)]
    pm = parallelize(make_model("mlp"), {"batch": batches[0]}, "dp",
                     ComputeConfig(1, world), gen_savedir=gen_savedir)
    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    norms = []
    for _ in range(2):  # a second iteration: its forward clears the synced flag
        opt.zero_grad()
        pm(batches[rank]).backward()
        opt.step()
        norms.append(float(opt.clip_gnorm()))
    return norms


def test_clip_gnorm_after_step_sums_once(tmp_path):
    expected = _reference_norm([make_batch("mlp", seed=r) for r in range(2)])
    for norms in run_distributed(_worker, 2, str(tmp_path)):
        # first step: the gradients at the reference weights; summed twice they would double
        assert norms[0] == pytest.approx(expected, rel=1e-5)
        assert 0 < norms[1] < 1.5 * expected
