"""nnScaler's distributed calls on 2 gloo processes: ``sync_grad_when`` for gradient
accumulation with the async reducer, ``load_sharded_state_dict`` and ``nnscaler.init``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from dist_utils import run_distributed
from parallel.common import ADAM, make_batch, make_model


def _reference_grads(batches):
    model = make_model("mlp")
    for batch in batches:
        model(batch).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _accumulate_worker(rank, world, gen_savedir, use_when):
    import nnscaler
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    warnings.simplefilter("ignore")
    nnscaler.init()  # the group is up already: nothing to do, as in nnScaler
    micro = [make_batch("mlp", seed=10 * rank + m) for m in range(2)]
    cfg = ComputeConfig(1, world, use_async_reducer=True)
    pm = parallelize(make_model("mlp"), {"batch": micro[0]}, "dp", cfg,
                     gen_savedir=gen_savedir, instance_name=f"when{int(use_when)}")
    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    opt.zero_grad()
    try:
        for i, batch in enumerate(micro):
            if use_when:
                with nnscaler.sync_grad_when(i == len(micro) - 1):
                    pm(batch).backward()
            else:
                pm(batch).backward()
    except RuntimeError as e:
        return {"error": str(e)}
    opt.sync_shard_grad()
    return {"grads": {n.replace("_", "."): p.grad.clone() for n, p in pm.named_parameters()}}


def test_sync_grad_when_accumulates(tmp_path):
    batches = [make_batch("mlp", seed=10 * r + m) for r in range(2) for m in range(2)]
    expected = _reference_grads(batches)
    for out in run_distributed(_accumulate_worker, 2, str(tmp_path), True):
        assert set(out["grads"]) == set(expected)
        for name, grad in out["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6)
    # without it, the first micro-batch's backward launched the reduction already
    for out in run_distributed(_accumulate_worker, 2, str(tmp_path), False):
        assert "already launched" in out["error"]


def _sharded_worker(rank, world, gen_savedir):
    from nnscaler import ComputeConfig, build_optimizer, load_sharded_state_dict, parallelize

    warnings.simplefilter("ignore")
    batch = make_batch("mlp", seed=rank)
    cfg = ComputeConfig(1, world, use_zero=True)

    def build():
        pm = parallelize(make_model("mlp", seed=rank), {"batch": batch}, "dp", cfg,
                         gen_savedir=gen_savedir)
        return pm, build_optimizer(pm, torch.optim.Adam, **ADAM)

    pm, opt = build()
    pm(batch).backward()
    opt.step()
    # copies, as if read back from files: torch's load_state_dict keeps the tensors it is
    # given, and the first optimizer's next step would update them in place
    model_sd, opt_sd = copy.deepcopy(pm.state_dict()), copy.deepcopy(opt.state_dict())
    fresh, fresh_opt = build()
    load_sharded_state_dict(fresh, model_sd, fresh_opt, opt_sd)
    for m, o in ((pm, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m(batch).backward()
        o.step()
    return [torch.equal(a, b) for a, b in zip(pm.parameters(), fresh.parameters())]


def test_load_sharded_state_dict_restores_model_and_optimizer(tmp_path):
    for same in run_distributed(_sharded_worker, 2, str(tmp_path)):
        assert same and all(same)


def test_load_sharded_state_dict_refuses_a_lone_optimizer_state():
    from nnscaler import CheckpointError, load_sharded_state_dict

    with pytest.raises(CheckpointError, match="no optimizer"):
        load_sharded_state_dict(torch.nn.Linear(2, 2), None, None, {"state": {}})
