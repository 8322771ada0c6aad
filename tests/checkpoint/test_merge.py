"""merge_state_dicts with several optimizers: the merged optimizer state equals the
single-device optimizer's after the same steps (Adam, AdamW, SGD with momentum, several
parameter groups, ZeRO shards); what cannot be merged fails naming the optimizer."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed

import nnscaler
from nnscaler import checkpoint as ck

from .common import (
    ADAM,
    LR,
    assert_optimizer_close,
    assert_state_close,
    parallelize_net,
    reference,
    run_parallel,
    steps_data,
)

DATA = steps_data(0, 2, 1)
DATA2 = steps_data(0, 2, 2)


def _by_ndim(params, **kwargs):
    params = list(params)
    return torch.optim.AdamW([
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ], **kwargs)


OPTIMIZERS = {
    "adam": (torch.optim.Adam, ADAM),
    "adamw": (torch.optim.AdamW, {"lr": LR, "eps": 1e-4, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "groups": (_by_ndim, {"lr": LR, "eps": 1e-4, "weight_decay": 0.1}),
}


def _train(rank, world, directory):
    out = {}
    for name, (fn, kwargs) in OPTIMIZERS.items():
        pm = parallelize_net("tp", 2, 2, directory)
        opt = nnscaler.build_optimizer(pm, fn, **kwargs)
        if name == "groups":
            out["groups-untracked"] = None  # filled below, from the same run
            ck.track_optimizer(opt)
        run_parallel(pm, opt, DATA, rank)
        out[name] = (pm.state_dict(), opt.state_dict())
        if name == "groups":
            plain = dict(opt.state_dict())
            plain.pop("nnscaler")
            out["groups-untracked"] = (pm.state_dict(), plain)
    return out


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    return run_distributed(_train, 2, str(tmp_path_factory.mktemp("merge")))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_merged_optimizer_state_equals_single_device(tp_runs, name):
    fn, kwargs = OPTIMIZERS[name]
    _, model, opt = reference(DATA, lambda params: fn(params, **kwargs))
    sds = [r[name][0] for r in tp_runs]
    osds = [r[name][1] for r in tp_runs]
    merged, merged_opt = ck.merge_state_dicts(sds, osds)
    assert_state_close(merged, model.state_dict())
    assert_optimizer_close(merged_opt, opt.state_dict())
    # what the single-device optimizer loads, and it continues identically
    fresh = fn(model.parameters(), **kwargs)
    fresh.load_state_dict(merged_opt)
    assert_optimizer_close(fresh.state_dict(), opt.state_dict())


def test_groups_in_another_order_need_track_optimizer(tp_runs):
    sds = [r["groups-untracked"][0] for r in tp_runs]
    osds = [r["groups-untracked"][1] for r in tp_runs]
    with pytest.raises(ck.CheckpointError, match=r"track_optimizer\(optimizer\)") as info:
        ck.merge_state_dicts(sds, osds)
    assert "has shape" in str(info.value)


def test_merging_one_rank_of_a_split_plan_says_what_is_missing(tp_runs):
    sds = [r["adam"][0] for r in tp_runs]
    with pytest.raises(ck.CheckpointError,
                       match=r"hold 64 of the 128 elements of emb.weight \(16, 8\).*all 2 ranks"):
        ck.merge_state_dicts(sds[:1])


class Factored(torch.optim.Optimizer):
    """An optimizer with a non-elementwise state (row sums of a matrix's squared grads,
    as Adafactor keeps)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                g2 = p.grad.square()
                state["row"] = g2.sum(-1) if p.ndim > 1 else g2
                p.add_(p.grad, alpha=-group["lr"])


def _train_factored(rank, world, directory):
    pm = parallelize_net("tp", 2, 2, directory)
    opt = nnscaler.build_optimizer(pm, Factored)
    ck.track_optimizer(opt)
    run_parallel(pm, opt, DATA, rank)
    return pm.state_dict(), opt.state_dict()


def test_an_optimizer_whose_state_is_not_elementwise_is_named(tmp_path):
    results = run_distributed(_train_factored, 2, str(tmp_path))
    with pytest.raises(ck.OptimizerStateError, match=r"test_merge\.Factored keeps the state "
                       r"'row' of emb\.weight\[0:16, 0:4\] of \(16, 8\) as a tensor of shape "
                       r"\(16,\).*cannot be merged"):
        ck.merge_state_dicts([r[0] for r in results], [r[1] for r in results])


def _train_zero(rank, world, directory):
    pm = parallelize_net("tp", 2, 4, directory, use_zero=True)
    opt = nnscaler.build_optimizer(pm, torch.optim.Adam, **ADAM)
    losses = run_parallel(pm, opt, DATA2, rank)
    return losses, pm.state_dict(), opt.state_dict()


def test_zero_shards_of_a_tp_dp_plan_merge(tmp_path):
    results = run_distributed(_train_zero, 4, str(tmp_path))
    ref_losses, model, opt = reference(DATA2)
    for rank, (losses, _, _) in enumerate(results):
        want = [[row[rank // 2]] for row in ref_losses]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5,
                                   atol=1e-6)
    assert any(d["kind"] == "zero" for d in results[0][1]["_extra_state"]["optimizer"])
    merged, merged_opt = ck.merge_state_dicts([r[1] for r in results], [r[2] for r in results])
    assert_state_close(merged, model.state_dict())
    assert_optimizer_close(merged_opt, opt.state_dict())
    assert os.listdir(tmp_path)  # generated code lives there


def _train_zero2(rank, world, directory, stage=2):
    pm = parallelize_net("tp", 2, 4, directory, zero_stage=stage)
    opt = nnscaler.build_optimizer(pm, torch.optim.Adam, **ADAM)
    losses = run_parallel(pm, opt, DATA2, rank)
    return losses, pm.state_dict(), opt.state_dict()


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stage2_and_3_shards_of_a_tp_dp_plan_merge(tmp_path, stage):
    """Stages 2 and 3 save what stage 1 saves (the pieces, stage 3 gathering them for
    the save, and the optimizer's shards)."""
    results = run_distributed(_train_zero2, 4, str(tmp_path), stage)
    ref_losses, model, opt = reference(DATA2)
    for rank, (losses, _, _) in enumerate(results):
        want = [[row[rank // 2]] for row in ref_losses]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5,
                                   atol=1e-6)
    assert any(d["kind"] == "zero" for d in results[0][1]["_extra_state"]["optimizer"])
    merged, merged_opt = ck.merge_state_dicts([r[1] for r in results], [r[2] for r in results])
    assert_state_close(merged, model.state_dict())
    assert_optimizer_close(merged_opt, opt.state_dict())
