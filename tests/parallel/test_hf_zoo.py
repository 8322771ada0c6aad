"""The Hugging Face zoo under every plan: each architecture of ``hf_zoo`` with eager and
sdpa attention, traced on an unpadded batch and trained on padded ones (so a trace that
kept the dummy batch's "no padding" shortcut would be caught), under ``dp``, ``tp`` and
``pp`` on 2 processes, against one process: every loss, and every weight after 2 SGD
steps with momentum, at rtol 1e-5. No case uses ``allow_data_dependent``.

One launch of 2 processes per architecture runs all of its cases; each rank returns a
row of the parity table (``{"eager-tp": "exact", ...}``) or the first difference.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from dist_utils import run_distributed

from . import hf_zoo
from .common import check_pieces

pytest.importorskip("transformers")

SGD = {"lr": 1e-2, "momentum": 0.9}
STEPS = 2
# policy -> (plan_ngpus, scale units of 2 processes, micro-batches, pas_config)
PLANS = {
    "dp": (1, 2, 1, {}),
    "tp": (2, 1, 1, {}),
    "pp": (2, 1, 2, {"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"}),
}
ATTENTION = ("eager", "sdpa")


def cases(name: str) -> list[tuple[str, str]]:
    arch = hf_zoo.ARCHS[name]
    return [(attn, policy) for attn in ATTENTION for policy in PLANS
            if policy != "pp" or arch.layered]


def data(batch, units: int, micro: int) -> list[list[list[dict]]]:
    """``[step][unit][micro]``: padded (or packed) batches, all different."""
    return [[[batch(100 * s + 10 * u + m + 1, True) for m in range(micro)]
             for u in range(units)] for s in range(STEPS)]


def reference(name: str, attn: str, steps: list) -> tuple[list, dict[str, torch.Tensor]]:
    model = hf_zoo.build(name, attn)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    losses = []
    for step in steps:
        opt.zero_grad()
        per_unit = []
        for unit in step:
            row = []
            for batch in unit:
                loss = model(batch)
                loss.backward()
                row.append(loss.item())
            per_unit.append(row)
        opt.step()
        losses.append(per_unit)
    return losses, {n: p.detach().clone()
                    for n, p in model.named_parameters(remove_duplicate=False)}


def run_case(rank: int, name: str, attn: str, policy: str, gen_savedir: str,
             packed: bool = False) -> int:
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    plan, units, micro, pas = PLANS[policy]
    batch = hf_zoo.packed_batch if packed else hf_zoo.ARCHS[name].batch
    steps = data(batch, units, micro)
    ref_losses, ref_state = reference(name, attn, steps)
    cfg = ComputeConfig(plan_ngpus=plan, runtime_ngpus=2, use_end2end=True, pas_config=pas)
    dummy = batch(0, False)  # traced unpadded (unpacked), trained padded (packed)
    pm = parallelize(hf_zoo.build(name, attn), {"batch": dummy}, policy, cfg,
                     gen_savedir=gen_savedir)
    opt = build_optimizer(pm, torch.optim.SGD, **SGD)
    unit = rank // plan
    for s, step in enumerate(steps):
        got = [float(x) for x in pm.train_step(step[unit])]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses[s][unit]),
                                   rtol=1e-5, atol=1e-6, msg=lambda m, s=s: f"step {s} losses: {m}")
        opt.step()
    return check_pieces(pm, ref_state, rtol=1e-5, atol=1e-6)


def _worker(rank: int, world: int, name: str, root: str, todo: list | None = None,
            packed: bool = False) -> dict[str, str]:
    warnings.simplefilter("ignore")
    row = {}
    for attn, policy in todo or cases(name):
        key = f"{attn}-{policy}"
        try:
            checked = run_case(rank, name, attn, policy, os.path.join(root, key), packed)
            row[key] = "exact" if checked else "no parameter checked"
        except Exception as e:  # one case's failure must not hide the others'
            row[key] = f"{type(e).__name__}: {e}"[:2000]
    return row


@pytest.mark.parametrize("name", list(hf_zoo.ARCHS))
def test_hf_zoo_parity(tmp_path, name):
    rows = run_distributed(_worker, 2, name, str(tmp_path), timeout=600)
    failed = {f"rank {r} {k}": v for r, row in enumerate(rows) for k, v in row.items()
              if v != "exact"}
    assert not failed, "\n".join(f"{name} {k}: {v}" for k, v in failed.items())
    assert set(rows[0]) == {f"{a}-{p}" for a, p in cases(name)}


PACKED = [("llama", "tp"), ("mistral", "dp")]  # mistral: a sliding window as well


@pytest.mark.parametrize("name, policy", PACKED)
def test_hf_packed_sequences_parity(tmp_path, name, policy):
    """Packed rows (no attention mask, ``position_ids`` restarting per sequence): traced
    on one sequence per row, trained on several; transformers' block-diagonal mask must
    come from tensor ops for the program to hold."""
    todo = [(attn, policy) for attn in ATTENTION]
    rows = run_distributed(_worker, 2, name, str(tmp_path), todo, True, timeout=600)
    failed = {f"rank {r} {k}": v for r, row in enumerate(rows) for k, v in row.items()
              if v != "exact"}
    assert not failed, "\n".join(f"{name} packed {k}: {v}" for k, v in failed.items())
