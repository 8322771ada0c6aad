"""ZeRO stages 2 and 3 with bf16 parameters: bf16 compute copies gathered from the fp32
master shards, gradients reduce-scattered in ``reduce_dtype`` and summed into the fp32
shard gradients, Adam on the fp32 shards.

The reference is one process running the same recipe by hand: the model in bf16, an fp32
master copy of every parameter stepped by Adam and rounded back into the model; each
micro-batch's gradients of the two replicas (two backward passes, one per replica's
batch) summed in ``reduce_dtype`` (what the reduce-scatter computes for two ranks: one
correctly rounded addition, the same in either order) and added, in fp32, to the step's
gradient. Every operation then happens on the same values in the same order, so losses,
master weights and bf16 weights must be bitwise equal (rtol=atol=0).
"""

from __future__ import annotations

import warnings

import torch
from dist_utils import run_distributed

from .common import ADAM, make_model, samples

STEPS, UNITS, MICRO = 3, 2, 2


def reference(data: list, reduce_dtype: torch.dtype) -> tuple[list, dict, dict]:
    """``losses[step][unit][micro]``, the fp32 masters and the bf16 weights after the
    steps, by parameter name."""
    model = make_model("gpt").to(torch.bfloat16)
    params = dict(model.named_parameters())
    masters = {n: torch.nn.Parameter(p.detach().float()) for n, p in params.items()}
    opt = torch.optim.Adam(masters.values(), **ADAM)
    losses = []
    for step in data:
        total = {n: torch.zeros_like(m) for n, m in masters.items()}
        per_unit: list[list[float]] = [[] for _ in step]
        for m in range(MICRO):
            summed = {n: torch.zeros(p.shape, dtype=reduce_dtype) for n, p in params.items()}
            for u, unit in enumerate(step):
                model.zero_grad(set_to_none=True)
                loss = model(unit[m])
                loss.backward()
                per_unit[u].append(loss.item())
                for n, p in params.items():
                    summed[n] += p.grad.to(reduce_dtype)
            for n in total:
                total[n] += summed[n].float()
        for n, master in masters.items():
            master.grad = total[n]
        opt.step()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters[n])
        losses.append(per_unit)
    return losses, {n: m.detach() for n, m in masters.items()}, \
        {n: p.detach().clone() for n, p in params.items()}


def _worker(rank, world, cases: list, gen_savedir: str):
    data = samples("gpt", STEPS, UNITS, MICRO)
    return [_run(rank, data, stage, reduce_dtype, gen_savedir) for stage, reduce_dtype in cases]


def _run(rank: int, data: list, stage: int, reduce_dtype: str | None, gen_savedir: str) -> int:
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime.zero3 import gathered

    rd = getattr(torch, reduce_dtype) if reduce_dtype else torch.bfloat16
    ref_losses, ref_masters, ref_weights = reference(data, rd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(make_model("gpt").to(torch.bfloat16), {"batch": data[0][0][0]}, "dp",
                         ComputeConfig(1, 2, zero_stage=stage, reduce_dtype=reduce_dtype),
                         gen_savedir=gen_savedir, instance_name=f"bf16-{stage}-{reduce_dtype}")
    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    losses = []
    for step in data:
        row = []
        for batch in step[rank]:
            loss = pm(batch)
            loss.backward()
            row.append(loss.item())
        opt.step()
        opt.zero_grad()
        losses.append(row)
    assert losses == [step[rank] for step in ref_losses]
    checked = 0
    with gathered(pm):
        for reducer in pm.reducers:
            for bucket in reducer.buckets:
                assert bucket.param_buffer.dtype == torch.bfloat16
                assert bucket.shard_param.dtype == torch.float32
                names = [pm.fullmap[a].orig_name for p in bucket.params
                         for a in pm.fullmap if getattr(pm, a) is p]
                master = torch.cat([ref_masters[n].reshape(-1) for n in names])
                weights = torch.cat([ref_weights[n].reshape(-1) for n in names])
                mine = bucket.shard_slice(torch.nn.functional.pad(
                    master, (0, bucket.padded_numel - bucket.numel)))
                torch.testing.assert_close(bucket.shard_param.detach(), mine, rtol=0, atol=0)
                torch.testing.assert_close(bucket.param_buffer[:bucket.numel], weights,
                                           rtol=0, atol=0)
                checked += len(names)
    return checked


def test_bf16_parameters_fp32_master_shards(tmp_path):
    """Stage 3 reducing in fp32 and in bf16 (the parameters' dtype), stage 2 in fp32."""
    cases = [(3, "float32"), (3, None), (2, "float32")]
    for checked in run_distributed(_worker, 2, cases, str(tmp_path)):
        assert len(checked) == len(cases) and all(n > 0 for n in checked)
