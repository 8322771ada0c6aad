"""A parallel submodule inside an ordinary model: the model's state dicts merge into the
single-device model's and load back into the parallel model; optimizer state of
parameters outside every parallel module cannot be merged, and says so."""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_utils import run_distributed
from submodule_models import Heavy, Parent

import nnscaler
from nnscaler import checkpoint as ck

from .common import ADAM, assert_state_close


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
            for _ in range(steps)]


def _reference(data):
    torch.manual_seed(0)
    model = Parent(Heavy())
    opt = torch.optim.Adam(model.parameters(), **ADAM)
    for x, y in data:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _worker(rank, world, gen_savedir):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    data = _data(2)
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=2)

    def model_of(init: bool) -> Parent:
        torch.manual_seed(0)
        heavy = Heavy()
        dummy = torch.randn(4, 8, generator=torch.Generator()).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pheavy = parallelize(heavy, {"x": dummy}, "tp", cfg, gen_savedir=gen_savedir,
                                 init_module_params=init)
        return Parent(pheavy)

    model = model_of(True)
    opt = build_optimizer(model, torch.optim.Adam, cfg, **ADAM)
    for x, y in data:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    sd, osd = model.state_dict(), opt.state_dict()
    assert "heavy._extra_state" in sd and "pre.weight" in sd
    # every rank loads the merged state into a fresh parallel model
    states = [None, None]
    torch.distributed.all_gather_object(states, sd)
    merged, _ = ck.merge_state_dicts(states)
    fresh = model_of(False)
    ck.load_merged_state_dicts(fresh, merged)
    x, y = data[0]
    torch.testing.assert_close(fresh(x, y), model(x, y))
    return sd, osd


def test_a_parallel_submodule_merges_and_loads_back(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path))
    reference = _reference(_data(2))
    merged, _ = ck.merge_state_dicts([r[0] for r in results])
    assert_state_close(merged, reference)
    with pytest.raises(ck.CheckpointError, match="parallelize the whole model|parallel "
                       "modules' parameters_for_optimizer"):
        ck.merge_state_dicts([r[0] for r in results], [r[1] for r in results])
    assert nnscaler.merge_state_dicts is ck.merge_state_dicts
