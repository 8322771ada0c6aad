"""Reshard: train 3 steps under ``tp`` on 2 processes, save per rank, merge, load the
merged state into (a) the plain single-device model, (b) a hybrid pipeline plan on 4
processes, (c) a ``dp`` plan with ZeRO on 2 processes; continue 3 steps in each. Losses,
weights and optimizer state equal an uninterrupted single-device run of 6 steps (rtol
1e-5).

Steps 0-2 see one batch each (one scale unit); steps 3-5 two batches each: (a) sums both,
(c) gives one to each of its two scale units, (b) runs both as the micro-batches of one
pipeline ``train_step``.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed

import nnscaler
from nnscaler import checkpoint as ck

from .common import (
    ADAM,
    assert_optimizer_close,
    assert_state_close,
    make_model,
    parallelize_net,
    rank_file,
    reference,
    run_parallel,
    run_plain,
    steps_data,
)

PHASE1 = steps_data(0, 3, 1)
PHASE2 = steps_data(3, 3, 2)


def _train_tp(rank, world, directory):
    pm = parallelize_net("tp", 2, 2, os.path.join(directory, "gen"))
    opt = nnscaler.build_optimizer(pm, torch.optim.Adam, **ADAM)
    losses = run_parallel(pm, opt, PHASE1, rank)
    ck.save(pm.state_dict(), rank_file(directory, "tp_model", rank))
    ck.save(opt.state_dict(), rank_file(directory, "tp_opt", rank))
    return losses


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory):
    """The per-rank checkpoint of the tp run and the merged one (files)."""
    directory = str(tmp_path_factory.mktemp("reshard"))
    losses = run_distributed(_train_tp, 2, directory)
    sds = [ck.load(rank_file(directory, "tp_model", r)) for r in range(2)]
    osds = [ck.load(rank_file(directory, "tp_opt", r)) for r in range(2)]
    merged, merged_opt = ck.merge_state_dicts(sds, osds)
    ck.save(merged, os.path.join(directory, "merged.pt"))
    ck.save(merged_opt, os.path.join(directory, "merged_opt.pt"))
    return directory, losses


@pytest.fixture(scope="module")
def uninterrupted():
    """The single-device run of all 6 steps."""
    return reference(PHASE1 + PHASE2)


def _losses_close(got, want):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_tp_phase_and_merge_match_the_reference(tp_checkpoint):
    directory, losses = tp_checkpoint
    ref_losses, model, opt = reference(PHASE1)
    for rank_losses in losses:
        _losses_close(rank_losses, ref_losses)
    merged = ck.load(os.path.join(directory, "merged.pt"))
    merged_opt = ck.load(os.path.join(directory, "merged_opt.pt"))
    assert_state_close(merged, model.state_dict())
    assert_optimizer_close(merged_opt, opt.state_dict())
    assert merged_opt["param_groups"][0]["param_names"][:2] == ["unused", "emb.weight"]


def test_a_single_device_model_continues(tp_checkpoint, uninterrupted):
    directory, _ = tp_checkpoint
    ref_losses, ref_model, ref_opt = uninterrupted
    model = make_model(seed=1)  # other weights: everything must come from the checkpoint
    model.load_state_dict(ck.load(os.path.join(directory, "merged.pt")))  # strict
    opt = torch.optim.Adam(model.parameters(), **ADAM)
    opt.load_state_dict(ck.load(os.path.join(directory, "merged_opt.pt")))
    losses = run_plain(model, opt, PHASE2)
    _losses_close(losses, ref_losses[3:])
    assert_state_close(model.state_dict(), ref_model.state_dict())
    assert_optimizer_close(opt.state_dict(), ref_opt.state_dict())


def _continue(rank, world, directory, policy, plan_ngpus, kwargs, micro):
    pm = parallelize_net(policy, plan_ngpus, world, os.path.join(directory, "gen"), **kwargs)
    opt = nnscaler.build_optimizer(pm, torch.optim.Adam, **ADAM)
    ck.load_merged_state_dicts(pm, ck.load(os.path.join(directory, "merged.pt")), opt,
                               ck.load(os.path.join(directory, "merged_opt.pt")))
    losses = run_parallel(pm, opt, PHASE2, rank, micro=micro)
    return losses, pm.state_dict(), opt.state_dict()


def _check_continuation(results, uninterrupted, per_unit):
    ref_losses, ref_model, ref_opt = uninterrupted
    for rank, (losses, _, _) in enumerate(results):
        want = [[row[rank // per_unit]] for row in ref_losses[3:]] if per_unit else ref_losses[3:]
        _losses_close(losses, want)
    merged, merged_opt = ck.merge_state_dicts([r[1] for r in results], [r[2] for r in results])
    assert_state_close(merged, ref_model.state_dict())
    assert_optimizer_close(merged_opt, ref_opt.state_dict())


def test_c_dp_zero_on_2_processes_continues(tp_checkpoint, uninterrupted):
    directory, _ = tp_checkpoint
    results = run_distributed(_continue, 2, directory, "dp", 1, {"use_zero": True}, False)
    _check_continuation(results, uninterrupted, per_unit=1)


HYBRID = {"pipeline_nstages": 2, "pipeline_nmicros": 2}


@pytest.mark.skipif("hybrid" not in nnscaler.get_plugin_manager().policies,
                    reason="the hybrid pipeline policy is not registered yet")
def test_b_hybrid_pipeline_on_4_processes_continues(tp_checkpoint, uninterrupted):
    directory, _ = tp_checkpoint
    kwargs = {"pas_config": HYBRID, "end2end": True}
    results = run_distributed(_continue, 4, directory, "hybrid", 4, kwargs, True)
    _check_continuation(results, uninterrupted, per_unit=0)
