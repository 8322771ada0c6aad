"""Shared helpers of the codegen tests: generate a plan's files, run them on N gloo
processes, and compare with the single-process module.

The parity rule (docs/internals/parallel-runtime.md): every scale unit runs its own
batch; the loss of each unit equals the module's loss on that batch; the gradients of
the pieces, summed over the ranks that hold them, equal the module's gradient of the
summed losses; after ``sync_grad`` every holder has that gradient; Adam steps over
``parameters_for_optimizer()`` keep the pieces equal to the module's parameters.

Adam runs with ``eps=ADAM_EPS`` (see tests/parity_utils.py: with the default eps the
parameters after Adam depend on the summation order of gradients that are zero in exact
arithmetic), and every run is compared with two references that sum in different orders:
a comparison that passed against one order only would depend on the machine.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "graph"))

from dist_utils import run_distributed  # noqa: E402
from parity_utils import ADAM_EPS, ATOL, RTOL, check_parity  # noqa: E402, F401  (re-exported)
from plan_helpers import case  # noqa: E402

from nnscaler.codegen import emit_files, load_generated_class  # noqa: E402
from nnscaler.models import gpt as gpt_module  # noqa: E402
from nnscaler.models import mlp as mlp_module  # noqa: E402

LR = 1e-3  # with eps=1e-4 a step moves <= lr / eps = 10x a gradient's rounding (parity_utils)
ADAM = {"lr": LR, "eps": ADAM_EPS}


def batches(name: str, nunits: int) -> list[dict[str, torch.Tensor]]:
    """One batch per scale unit (the traced batch size), different in each unit."""
    c = case(name)
    if name == "mlp":
        return [mlp_module.make_batch(c.module.config, 4, seed=u) for u in range(nunits)]
    return [gpt_module.make_batch(c.module.gpt.config, 4, seed=u) for u in range(nunits)]


def generate(tmp: Path, name: str, graph: Any, *, plan_ngpus: int, runtime_ngpus: int,
             end2end: bool = True, compute_config: Any = None) -> Path:
    out = tmp / "gen"
    emit_files(graph, out, plan_ngpus=plan_ngpus, runtime_ngpus=runtime_ngpus,
               state=case(name).module, end2end=end2end, compute_config=compute_config)
    return out


def _grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {a: p.grad.detach().clone() for a, p in m.named_parameters() if p.grad is not None}


def _worker(rank: int, world: int, outdir: str, data: list, plan_ngpus: int, mode: str,
            steps: int) -> dict[str, Any]:
    cls = load_generated_class(outdir, rank)
    m = cls(init_params=True)
    batch = data[rank // plan_ngpus]

    def step() -> torch.Tensor:
        if mode == "train_step":
            return m.train_step([batch])[0]
        m.zero_grad()
        loss = m(batch)
        loss.backward()
        return loss.detach()

    loss = step()
    raw = _grads(m)
    m.sync_grad()
    synced = _grads(m)
    opt = torch.optim.Adam(m.parameters_for_optimizer(), **ADAM)
    losses = [loss.item()]
    for k in range(steps):
        if k:
            losses.append(step().item())
            m.sync_grad()
        opt.step()
        m.gather_params()
    params = {a: p.detach().clone() for a, p in m.named_parameters()}
    return {"losses": losses, "fullmap": m.fullmap, "raw": raw, "synced": synced,
            "params": params}


def reference(name: str, data: list, steps: int, *, reverse: bool = False) -> dict[str, Any]:
    """The single-process run: the summed loss of all units' batches (one backward of
    the sum; with ``reverse``, one backward per unit in reverse order, which sums every
    gradient in another order)."""
    module = copy.deepcopy(case(name).module)
    opt = torch.optim.Adam(module.parameters(), **ADAM)
    losses, grads = [], {}
    for k in range(max(steps, 1)):
        opt.zero_grad(set_to_none=True)
        per_unit = [module(b) for b in data]
        losses.append([x.item() for x in per_unit])
        if reverse:
            for x in reversed(per_unit):
                x.backward()
        else:
            torch.stack(per_unit).sum().backward()
        if k == 0:
            grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        if steps:
            opt.step()
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def run_parity(tmp: Path, name: str, graph: Any, *, plan_ngpus: int, runtime_ngpus: int,
               mode: str = "train_step", steps: int = 3, compute_config: Any = None) -> list:
    outdir = generate(tmp, name, graph, plan_ngpus=plan_ngpus, runtime_ngpus=runtime_ngpus,
                      compute_config=compute_config)
    data = batches(name, runtime_ngpus // plan_ngpus)
    results = run_distributed(_worker, runtime_ngpus, str(outdir), data, plan_ngpus, mode,
                              steps)
    zero = bool((compute_config or {}).get("use_zero"))
    for reverse in (False, True):
        check_parity(results, reference(name, data, steps, reverse=reverse), plan_ngpus,
                     steps=bool(steps), zero=zero)
    return results


def mlp_tp(graph: Any, ndevices: int) -> Any:
    """Tensor parallelism for the MLP: every linear split on its output features, every
    gelu on the same dim (the next linear all-gathers its input); the loss replicated."""
    from plan_helpers import replicate_rest

    for lin in graph.select(name="linear"):
        for device, part in enumerate(graph.partition(lin, idx=1, dim=0, num=ndevices)):
            graph.assign(part, device)
    for act in graph.select(name="gelu"):
        for device, part in enumerate(graph.partition(act, idx=0, dim=-1, num=ndevices)):
            graph.assign(part, device)
    replicate_rest(graph, ndevices)
    return graph
