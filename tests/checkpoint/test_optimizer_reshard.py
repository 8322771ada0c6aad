"""Optimizer state resharded without a merge: ``load_resharded(module, files, optimizer,
optimizer_files)``.

Two saved plans on 2 processes, each trained 2 steps with Adam (2 batches a step): ``tp``
(one scale unit, the batches as micro-batches) and ``dp`` with ZeRO (one batch per scale
unit), and ``dp`` with ZeRO stage 2. Each is loaded into other plans on 2 processes
(``tp`` into ``pp``, into ``dp`` + ZeRO and into stage 2, ZeRO's into ``tp``, ZeRO's
deduped files into ``pp``, stage 2's into ``tp`` and its deduped files into stage 1, stage
3's into ``tp`` and its deduped files into stage 2, ``tp`` into stage 3):
module and optimizer state
equal, exactly, what ``merge_state_dicts`` + ``load_merged_state_dicts`` give, and one
more step gives the losses, weights and optimizer state of one more step on the saved
plan (rtol 1e-5). Bad files are refused on every rank, nothing loaded.
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
    parallelize_net,
    rank_file,
    run_parallel,
    steps_data,
)

PHASE1 = steps_data(0, 2, 2)  # saved after these
PHASE2 = steps_data(2, 1, 2)  # one more step
PLANS = {  # name -> (policy, plan_ngpus, parallelize_net's options, micro-batches)
    "tp": ("tp", 2, {"end2end": True, "pas_config": {"pipeline_nmicros": 2}}, True),
    "pp": ("pp", 2, {"end2end": True, "pas_config": {"pipeline_nmicros": 2}}, True),
    "zero": ("dp", 1, {"use_zero": True}, False),
    "zero2": ("dp", 1, {"zero_stage": 2}, False),  # gradients sharded too: same files
    "zero3": ("dp", 1, {"zero_stage": 3}, False),  # parameters too: gathered to save
}


def _build(name: str, directory: str):
    policy, plan_ngpus, kwargs, micro = PLANS[name]
    pm = parallelize_net(policy, plan_ngpus, 2, os.path.join(directory, "gen"), **kwargs,
                         instance=name)
    return pm, nnscaler.build_optimizer(pm, torch.optim.Adam, **ADAM), micro


def _files(directory: str, saved: str) -> tuple[list[str], list[str]]:
    return ([rank_file(directory, f"{saved}_model", r) for r in range(2)],
            [rank_file(directory, f"{saved}_opt", r) for r in range(2)])


def _train_and_save(rank, world, directory, name):
    pm, opt, micro = _build(name, directory)
    run_parallel(pm, opt, PHASE1, rank, micro=micro)
    ck.save(pm.state_dict(), rank_file(directory, f"{name}_model", rank))
    ck.save(opt.state_dict(), rank_file(directory, f"{name}_opt", rank))
    sd, osd = ck.deduped_state_dict(pm, opt)  # each piece and its state on one rank
    ck.save(sd, rank_file(directory, f"{name}-dedup_model", rank))
    ck.save(osd, rank_file(directory, f"{name}-dedup_opt", rank))
    losses = run_parallel(pm, opt, PHASE2, rank, micro=micro)
    return losses, pm.state_dict(), opt.state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Both saved plans' files, and one more step on each (losses, merged state)."""
    directory = str(tmp_path_factory.mktemp("optreshard"))
    out = {}
    for name in ("tp", "zero", "zero2", "zero3"):
        results = run_distributed(_train_and_save, 2, directory, name)
        merged, merged_opt = ck.merge_state_dicts([r[1] for r in results],
                                                  [r[2] for r in results])
        out[name] = {"losses": [r[0] for r in results], "state": merged, "opt": merged_opt}
    return directory, out


def _equal_state(got, want, what):
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), f"{what}: {k}"


def _equal_optimizer(got, want):
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        assert list(got["state"][i]) == list(state), i
        for key, value in state.items():
            assert got["state"][i][key].dtype == value.dtype, (i, key)
            assert torch.equal(got["state"][i][key], value), (i, key)


def _reshard(rank, world, directory, saved, target):
    files, opt_files = _files(directory, saved)
    pm, opt, micro = _build(target, directory)
    nnscaler.load_resharded(pm, files, opt, opt_files)
    # the merge path, into a second module of the same plan
    other, other_opt, _ = _build(target, directory)
    merged, merged_opt = ck.merge_state_dicts([ck.load(f) for f in files],
                                              [ck.load(f) for f in opt_files])
    ck.load_merged_state_dicts(other, merged, other_opt, merged_opt)
    _equal_state(pm.state_dict(), other.state_dict(), "module")
    _equal_optimizer(opt.state_dict(), other_opt.state_dict())
    assert opt.state, "the optimizer got state"
    losses = run_parallel(pm, opt, PHASE2, rank, micro=micro)
    return losses, pm.state_dict(), opt.state_dict()


@pytest.mark.parametrize("saved_plan,target", [("tp", "pp"), ("tp", "zero"), ("zero", "tp"),
                                               ("zero-dedup", "pp"), ("zero2", "tp"),
                                               ("tp", "zero2"), ("zero2-dedup", "zero"),
                                               ("zero3", "tp"), ("tp", "zero3"),
                                               ("zero3-dedup", "zero2")])
def test_resharded_optimizer_equals_the_merge_path_and_continues(saved, saved_plan, target):
    directory, runs = saved
    results = run_distributed(_reshard, 2, directory, saved_plan, target)
    saved_plan = saved_plan.split("-")[0]
    want = runs[saved_plan]
    micro = PLANS[target][3]
    flat_want = [x for row in want["losses"][0] for x in row] if PLANS[saved_plan][3] else \
        [want["losses"][0][0][0], want["losses"][1][0][0]]  # one batch per scale unit
    for rank, (losses, _, _) in enumerate(results):
        got = [x for row in losses for x in row]
        expect = flat_want if micro else [flat_want[rank]]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expect), rtol=1e-5, atol=1e-6)
    merged, merged_opt = ck.merge_state_dicts([r[1] for r in results], [r[2] for r in results])
    assert_state_close(merged, want["state"])
    assert_optimizer_close(merged_opt, want["opt"])


# -- refused on every rank, nothing loaded ------------------------------------------------
def _snapshot(pm, opt):
    return ({k: v.clone() for k, v in pm.state_dict().items() if isinstance(v, torch.Tensor)},
            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()})


def _refuse(rank, world, directory):
    files, opt_files = _files(directory, "tp")
    osds = [ck.load(f) for f in opt_files]
    pm, opt, micro = _build("zero", directory)
    run_parallel(pm, opt, PHASE1[:1], rank, micro=micro)  # some state of its own
    before = _snapshot(pm, opt)
    messages = {}

    def refused(key, optimizer, optimizer_files):
        with pytest.raises(nnscaler.CheckpointError) as info:
            nnscaler.load_resharded(pm, files, optimizer, optimizer_files)
        messages[key] = str(info.value)

    refused("missing_rank", opt, [opt_files[0], os.path.join(directory, "nope.pt")])
    refused("short", opt, opt_files[:1])
    refused("empty_rank", opt, [osds[0], dict(osds[1], state={})])
    bad = [dict(o, state={i: dict(s) for i, s in o["state"].items()}) for o in osds]
    for o in bad:  # not elementwise: one value per row, as Adafactor keeps
        for s in o["state"].values():
            s["exp_avg_sq"] = s["exp_avg_sq"].reshape(s["exp_avg_sq"].shape[0], -1).sum(-1)[:1]
    refused("not_elementwise", opt, bad)
    sgd = torch.optim.SGD(pm.parameters_for_optimizer(), lr=0.1, momentum=0.9)
    refused("other_class", sgd, opt_files)
    untracked = [{k: v for k, v in o.items() if k != ck.optimizer.OPTIMIZER_KEY} for o in osds]
    refused("other_class_untracked", sgd, untracked)
    refused("no_files", opt, None)
    after = _snapshot(pm, opt)
    for k, v in before[0].items():
        assert torch.equal(after[0][k], v), k
    for i, s in before[1].items():
        for k, v in s.items():
            assert torch.equal(after[1][i][k], v), (i, k)
    return messages


def test_bad_optimizer_files_are_refused_with_nothing_loaded(saved):
    directory, _ = saved
    for messages in run_distributed(_refuse, 2, directory):
        assert "nope.pt' does not exist" in messages["missing_rank"], messages["missing_rank"]
        assert "2 module files but 1 optimizer" in messages["short"], messages["short"]
        message = messages["empty_rank"]
        assert "hold" in message and "elements of the state" in message, message
        assert "optimizer file of every rank" in message
        message = messages["not_elementwise"]
        assert "'exp_avg_sq'" in message and "elementwise" in message, message
        message = messages["other_class"]
        assert "saved by torch.optim.adam.Adam" in message and "optim.sgd.SGD" in message, message
        message = messages["other_class_untracked"]  # told by the hyperparameters
        assert "another optimizer class" in message and "'momentum'" in message, message
        assert "pass both optimizer and optimizer_files" in messages["no_files"]
