"""Deduped checkpoints: each distinct piece saved once across the ranks (smaller than the
per-rank checkpoints by the replication factor), and every rank restored from them into
modules built without weights continues bitwise-identically."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed

import nnscaler
from nnscaler import checkpoint as ck

from .common import ADAM, parallelize_net, rank_file, run_parallel, steps_data, tensor_bytes

FIRST = steps_data(0, 2, 2)
SECOND = steps_data(2, 2, 2)


def _snapshot(pm, opt):
    """Every tensor of the module (non-persistent buffers included) and the optimizer
    state, copied."""
    module = {k: v.detach().clone() for k, v in pm.state_dict().items()
              if isinstance(v, torch.Tensor)}
    module.update({f"buffer:{k}": b.detach().clone() for k, b in pm.named_buffers()})
    state = opt.state_dict()["state"]
    optim = {f"{i}.{k}": torch.as_tensor(v).clone() for i, s in state.items() for k, v in s.items()}
    return module, optim


def _run(rank, world, directory, policy, plan_ngpus, use_zero):
    gen = os.path.join(directory, "gen")
    kwargs = PIPELINE if policy == "hybrid" else {}
    micro = bool(kwargs)  # a pipeline's unit runs both batches of a step as micro-batches
    pm = parallelize_net(policy, plan_ngpus, world, gen, use_zero=use_zero, **kwargs)
    opt = nnscaler.build_optimizer(pm, torch.optim.Adam, **ADAM)
    run_parallel(pm, opt, FIRST, rank, micro=micro)
    ck.save(pm.state_dict(), rank_file(directory, "model", rank))
    ck.save(opt.state_dict(), rank_file(directory, "opt", rank))
    module_sd, opt_sd = ck.deduped_state_dict(pm, opt)
    ck.save(module_sd, rank_file(directory, "dedup_model", rank))
    ck.save(opt_sd, rank_file(directory, "dedup_opt", rank))
    losses = run_parallel(pm, opt, SECOND, rank, micro=micro)
    want_module, want_opt = _snapshot(pm, opt)

    # restore into a module built without weights (garbage) and a fresh optimizer
    fresh = parallelize_net(policy, plan_ngpus, world, gen, use_zero=use_zero,
                            init_params=False, **kwargs)
    with torch.no_grad():
        for t in [*fresh.parameters(), *fresh.buffers()]:
            t.fill_(7.0)
    fresh_opt = nnscaler.build_optimizer(fresh, torch.optim.Adam, **ADAM)
    ck.load_deduped_state_dict(fresh, ck.load(rank_file(directory, "dedup_model", rank)),
                               fresh_opt, ck.load(rank_file(directory, "dedup_opt", rank)))
    fresh_losses = run_parallel(fresh, fresh_opt, SECOND, rank, micro=micro)
    got_module, got_opt = _snapshot(fresh, fresh_opt)
    assert fresh_losses == losses, (fresh_losses, losses)
    for want, got in ((want_module, got_module), (want_opt, got_opt)):
        assert set(want) == set(got)
        for k in want:
            assert torch.equal(want[k], got[k]), k
    return losses


PIPELINE = {"pas_config": {"pipeline_nstages": 2, "pipeline_nmicros": 2}, "end2end": True}
CASES = [
    pytest.param("dp", 1, 2, False, id="dp-p1r2"),
    pytest.param("tp", 2, 4, True, id="tp-p2r4-zero"),
    pytest.param("hybrid", 2, 4, True, id="pipeline-p2r4-zero",
                 marks=pytest.mark.skipif("hybrid" not in nnscaler.get_plugin_manager().policies,
                                          reason="the hybrid pipeline policy is not registered")),
]


@pytest.mark.parametrize("policy, plan_ngpus, world, use_zero", CASES)
def test_deduped_is_smaller_by_the_replication_factor_and_restores_bitwise(
        tmp_path, policy, plan_ngpus, world, use_zero):
    directory = str(tmp_path)
    run_distributed(_run, world, directory, policy, plan_ngpus, use_zero)
    per_rank = [(ck.load(rank_file(directory, "model", r)), ck.load(rank_file(directory, "opt", r)))
                for r in range(world)]
    deduped = [(ck.load(rank_file(directory, "dedup_model", r)),
                ck.load(rank_file(directory, "dedup_opt", r))) for r in range(world)]

    # every distinct piece once: the deduped module tensors are the full model (each
    # parameter and buffer once, tied ones once, the non-persistent buffer included)
    merged, merged_opt = ck.merge_state_dicts(*zip(*per_rank))
    full_model = tensor_bytes(merged) + merged["shift"].nbytes  # + 'scale' (same size)
    assert sum(tensor_bytes(m) for m, _ in deduped) == full_model
    units = world // plan_ngpus
    module_ratio = sum(tensor_bytes(m) for m, _ in per_rank) / full_model
    assert module_ratio >= units  # replicated at least across the scale units
    if policy == "dp":  # everything replicated on both ranks: exactly half
        assert sum(tensor_bytes(*d) for d in per_rank) == 2 * sum(tensor_bytes(*d) for d in deduped)
    sizes = {kind: sum(os.path.getsize(rank_file(directory, kind, r)) for r in range(world))
             for kind in ("model", "opt", "dedup_model", "dedup_opt")}
    assert sizes["dedup_model"] + sizes["dedup_opt"] < sizes["model"] + sizes["opt"]
    # ZeRO shards are held once already; other optimizer state is deduped like the weights
    assert sum(tensor_bytes(o) for _, o in deduped) <= sum(tensor_bytes(o) for _, o in per_rank)

    # deduped state dicts merge like the per-rank ones
    merged2, merged_opt2 = ck.merge_state_dicts(*zip(*deduped))
    assert merged2.keys() == merged.keys()
    for k in merged:
        assert torch.equal(merged2[k], merged[k]), k
    for i, state in merged_opt["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(merged_opt2["state"][i][key]),
                               torch.as_tensor(value))


def _load_deduped_into_another_plan(rank, world, directory):
    gen = os.path.join(directory, "gen")
    pm = parallelize_net("tp", 2, 2, gen)
    opt = nnscaler.build_optimizer(pm, torch.optim.Adam, **ADAM)
    sd, osd = ck.deduped_state_dict(pm, opt)
    other = parallelize_net("dp", 1, 2, gen)
    try:
        ck.load_deduped_state_dict(other, sd)
    except ck.StateDictMismatchError as e:
        return str(e)
    return None


def test_deduped_state_dict_of_another_plan_fails_on_every_rank(tmp_path):
    errors = run_distributed(_load_deduped_into_another_plan, 2, str(tmp_path))
    for error in errors:
        assert error is not None
        assert "the first mismatching key is 'emb_weight'" in error
        assert "shape (16, 4)" in error and "shape (16, 8)" in error
