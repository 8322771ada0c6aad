"""Hugging Face models with ``attn_implementation="nnscaler_fa"`` parallelized on 2 gloo
processes train exactly as one process does: losses and every weight after 2 SGD steps
(momentum), rtol 1e-5. Padded batches (Llama) and packed batches (Mistral, sliding
window) under ``tp`` (heads split), ``dp`` (one sample per scale unit) and ``data``
(the batch split inside a plan, the segment ids with it)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _hf_cases import BATCHES, WithLoss, build

from nnscaler.testing import run_distributed

pytest.importorskip("transformers")

SGD = {"lr": 1e-2, "momentum": 0.9}
STEPS = 2
#: (model, batch, policy, plan_ngpus) on 2 processes
CASES = [
    ("llama", "padded", "tp", 2),
    ("llama", "padded", "dp", 1),
    ("llama", "padded", "data", 2),
    ("mistral", "packed", "tp", 2),
    ("mistral", "packed", "dp", 1),
]


def _reference(kind: str, data: list[list[dict]]) -> tuple[list[list[float]], dict]:
    """One process: every unit's batch backpropagated, one step per step."""
    from nnscaler_ops_flash_attn import HF_ATTENTION

    model = WithLoss(build(kind, HF_ATTENTION))
    opt = torch.optim.SGD(model.parameters(), **SGD)
    losses = []
    for step in data:
        row = []
        for batch in step:
            loss = model(batch)
            loss.backward()
            row.append(loss.item())
        opt.step()
        opt.zero_grad()
        losses.append(row)
    return losses, {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def _worker(rank: int, world: int, cases: list[tuple], savedir: str) -> list[str]:
    from nnscaler_ops_flash_attn import HF_ATTENTION, register_hf_attention

    from nnscaler import ComputeConfig, build_optimizer, parallelize

    warnings.simplefilter("ignore")
    register_hf_attention()
    done = []
    for i, (kind, shape, policy, plan) in enumerate(cases):
        case = f"{kind}-{shape}-{policy}"
        units = world // plan
        data = [[BATCHES[shape](seed=10 * s + u) for u in range(units)] for s in range(STEPS)]
        ref_losses, ref_params = _reference(kind, data)
        cfg = ComputeConfig(plan_ngpus=plan, runtime_ngpus=world, use_end2end=True)
        pm = parallelize(WithLoss(build(kind, HF_ATTENTION)), {"batch": data[0][0]}, policy,
                         cfg, gen_savedir=savedir, instance_name=f"case{i}")
        opt = build_optimizer(pm, torch.optim.SGD, **SGD)
        unit = rank // plan
        losses = []
        for step in data:
            losses += [float(x) for x in pm.train_step([step[unit]])]
            opt.step()
        want = [row[unit] for row in ref_losses]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5,
                                   atol=1e-6, msg=lambda m, c=case: f"{c} losses: {m}")
        checked = 0
        for attr, meta in pm.fullmap.items():
            if meta.kind != "parameter" or meta.value != (0, 1):
                continue
            torch.testing.assert_close(
                getattr(pm, attr).detach(), meta.take(ref_params[meta.orig_name]),
                rtol=1e-5, atol=1e-6, msg=lambda m, c=case, n=meta.orig_name: f"{c} {n}: {m}")
            checked += 1
        if checked == 0:
            raise AssertionError(f"{case}: rank {rank} holds no parameter")
        ops = {op for op in _attention_ops(savedir, f"case{i}", rank)}
        if not ops:
            raise AssertionError(f"{case}: the generated code calls no plugin operator")
        done.append(case)
    return done


def _attention_ops(savedir: str, instance: str, rank: int) -> set[str]:
    """The plugin's operators that rank's generated code calls."""
    import glob
    import re

    found: set[str] = set()
    for path in glob.glob(f"{savedir}/**/{instance}/gencode{rank}.py", recursive=True):
        with open(path) as f:
            found |= set(re.findall(r"flash_attn_(?:segmented|varlen)?_?func", f.read()))
    return found


def test_parity_on_two_processes(tmp_path):
    done = run_distributed(_worker, 2, CASES, str(tmp_path), timeout=600)
    assert all(len(d) == len(CASES) for d in done)
