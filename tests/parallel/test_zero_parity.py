"""ZeRO stages 2 and 3 under parallelize: parity with one process.

Each case trains 3 Adam steps and checks, on every rank, the per-micro-batch losses, the
last step's gradients (the shards every rank holds, gathered into the parameters' pieces)
the global gradient norm ``clip_gnorm`` computes over the shards, and the final parameter
pieces against the single-process reference (rtol 1e-5).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from parity_utils import check_zero3_header

from .common import ADAM, Case, check_pieces, make_model, reference_train, samples

CASES = [
    Case("gpt", "dp", 1, 2, zero_stage=2),
    Case("gpt", "dp", 1, 4, zero_stage=2, zero_ngroups=2, micro=2),
    Case("gpt", "tp", 2, 4, zero_stage=2, end2end=True, micro=2),
    Case("mlp", "tp", 2, 4, zero_stage=2),
    Case("mlp", "dp", 1, 4, zero_stage=2, zero_ngroups=2, use_async_reducer=True),
    Case("gpt", "dp", 1, 2, zero_stage=3, micro=2),
    Case("gpt", "dp", 1, 4, zero_stage=3, zero_ngroups=2),
    Case("gpt", "tp", 2, 4, zero_stage=3, end2end=True, micro=2),
    Case("gpt", "dp", 1, 4, zero_stage=3, end2end=True),
    Case("gpt", "dp", 1, 2, zero_stage=3, zero_units=("gpt.blocks", "gpt.wte")),
    # recomputed blocks gather their unit again in backward (docs/zero.md)
    Case("gpt", "dp", 1, 2, zero_stage=3, micro=2, recompute=True),
    pytest.param(Case("gpt", "tp", 2, 4, zero_stage=3, end2end=True, recompute=True),
                 marks=pytest.mark.slow),
]


def gathered_grads(pm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``attr -> gradient`` of this rank's parameter pieces, rebuilt from the stage-2
    shards of every rank (an all_gather_object over the job; tiny models only)."""
    mine = []
    for reducer in pm.reducers:
        for bi, bucket in enumerate(reducer.buckets):
            grad = bucket.shard_param.grad
            mine.append((tuple(reducer.ranks), bi, bucket.shard_index, grad.detach().clone()))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    shards: dict[tuple, dict[int, torch.Tensor]] = {}
    for rows in every:
        for ranks, bi, index, grad in rows:
            shards.setdefault((ranks, bi), {})[index] = grad
    attr_of = {id(getattr(pm, a)): a for a in pm.fullmap}
    out = {}
    for reducer in pm.reducers:
        for bi, bucket in enumerate(reducer.buckets):
            parts = shards[(tuple(reducer.ranks), bi)]
            flat = torch.cat([parts[i] for i in range(bucket.nshards)])
            for p, off in zip(bucket.params, bucket.offsets):
                out[attr_of[id(p)]] = flat[off: off + p.numel()].view(p.shape)
    return out


def _worker(rank, world, case: Case, gen_savedir: str):
    from nnscaler import build_optimizer, parallelize

    data = samples(case.kind, case.steps, case.units, case.micro)
    ref_grads: dict[str, torch.Tensor] = {}
    ref_losses, ref_state = reference_train(make_model(case.kind), data, grads=ref_grads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(make_model(case.kind), {"batch": data[0][0][0]}, case.plan(),
                         case.compute_config(), gen_savedir=gen_savedir,
                         instance_name=case.id())
    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    unit = rank // case.plan_ngpus
    losses, grads = [], {}
    for step in data:
        opt.zero_grad()
        if case.end2end:
            row = [float(x) for x in pm.train_step(step[unit])]
        else:
            row = []
            for i, batch in enumerate(step[unit]):
                with contextlib.nullcontext() if i == len(step[unit]) - 1 else pm.no_sync():
                    loss = pm(batch)
                    loss.backward()
                row.append(loss.item())
        opt.sync_shard_grad()
        norm = float(opt.clip_gnorm())  # the global norm, each element counted once
        grads = gathered_grads(pm)
        opt.step()
        losses.append(row)
    expected = [step[unit] for step in ref_losses]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    unique = [n for n, _ in make_model(case.kind).named_parameters()]
    ref_norm = torch.stack([ref_grads[n].double().pow(2).sum() for n in unique]).sum().sqrt()
    torch.testing.assert_close(norm, float(ref_norm), rtol=1e-5, atol=0)
    nchecked = 0
    for attr, meta in pm.fullmap.items():
        if meta.kind == "parameter" and meta.value == (0, 1):
            torch.testing.assert_close(grads[attr], meta.take(ref_grads[meta.orig_name]),
                                       rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=meta.orig_name: f"grad of {n}: {m}")
            assert getattr(pm, attr).grad is None  # no full gradient is kept
            nchecked += 1
    if case.recompute:  # the blocks ran through checkpoint, gathering in backward
        assert [n for n in vars(pm) if n.startswith("_recompute_")]
    if case.zero_stage == 3:  # the file lists the shards the buckets hold
        check_zero3_header(pm)
    if case.zero_stage == 3:  # outside forward and backward no unit holds its values
        for reducer in pm.reducers:
            for bucket in reducer.buckets:
                assert not bucket.gathered
                assert bucket.param_buffer.untyped_storage().nbytes() == 0
    return {"params": check_pieces(pm, ref_state), "grads": nchecked}


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_zero_parity(case, tmp_path):
    results = run_distributed(_worker, case.runtime_ngpus, case, str(tmp_path))
    assert all(r["params"] > 0 and r["grads"] > 0 for r in results)
