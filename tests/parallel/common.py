"""Shared pieces of the parallelize tests: tiny models, data, the single-process reference
and the comparison of a rank's parameter pieces with the reference's full tensors."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from nnscaler.models.gpt import GPTConfig, GPTWithLoss
from nnscaler.models.gpt import make_batch as gpt_batch
from nnscaler.models.mlp import MLP, MLPConfig
from nnscaler.models.mlp import make_batch as mlp_batch

MLP_CONFIG = MLPConfig(d_in=8, d_hidden=16, n_classes=4, n_layers=3)
GPT_CONFIG = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, seq_len=8)
LR = 1e-3  # with eps=1e-4 a step moves <= lr / eps = 10x a gradient's rounding (parity_utils)
# Adam's eps: the attention's k-projection bias has a gradient that is zero in exact
# arithmetic (softmax is shift invariant), so it is rounding noise (~1e-9); with the default
# eps=1e-8 Adam turns noise into steps of size ~lr with a random sign, and no two summation
# orders agree. eps=1e-4 keeps noise-driven steps below 1e-7 and real ones Adam-sized.
ADAM = {"lr": LR, "eps": 1e-4}


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP(MLP_CONFIG)
    if kind == "gpt":
        return GPTWithLoss(GPT_CONFIG)
    raise ValueError(kind)


def make_batch(kind: str, seed: int, batch_size: int = 4) -> dict[str, torch.Tensor]:
    if kind == "mlp":
        return mlp_batch(MLP_CONFIG, batch_size, seed=seed)
    return gpt_batch(GPT_CONFIG, batch_size, seed=seed)


def samples(kind: str, steps: int, units: int, micro: int) -> list[list[list[dict]]]:
    """``[step][unit][micro-batch]`` batches, all different."""
    return [[[make_batch(kind, seed=1000 * s + 10 * u + m) for m in range(micro)]
             for u in range(units)] for s in range(steps)]


def reference_train(model: nn.Module, data: list[list[list[dict]]],
                    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                    grads: dict[str, torch.Tensor] | None = None,
                    ) -> tuple[list[list[list[float]]], dict[str, torch.Tensor]]:
    """One process sees every unit's micro-batches: gradients summed over all of them, one
    Adam step per step. Returns ``losses[step][unit][micro]`` and the final state; fills
    ``grads`` (when given) with the last step's gradients by parameter name."""
    loss_fn = loss_fn or (lambda m, b: m(b))
    opt = torch.optim.Adam(model.parameters(), **ADAM)
    losses = []
    for step in data:
        opt.zero_grad()
        per_unit = []
        for unit in step:
            row = []
            for batch in unit:
                loss = loss_fn(model, batch)
                loss.backward()
                row.append(loss.item())
            per_unit.append(row)
        if grads is not None:
            grads.update({n: p.grad.detach().clone() for n, p in
                          model.named_parameters(remove_duplicate=False) if p.grad is not None})
        opt.step()
        losses.append(per_unit)
    state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=False).items()}
    state.update({n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)})
    return losses, state


def check_pieces(pm: nn.Module, reference: dict[str, torch.Tensor], prefix: str = "",
                 rtol: float = 1e-5, atol: float = 1e-6) -> int:
    """Every parameter piece of the parallel module ``pm`` equals its slice of the
    reference's full tensor (``prefix``: the module's path in the reference)."""
    from nnscaler.runtime.zero3 import gathered

    with gathered(pm):  # ZeRO stage 3: the parameters hold values only when gathered
        return _check_pieces(pm, reference, prefix, rtol, atol)


def _check_pieces(pm: nn.Module, reference: dict[str, torch.Tensor], prefix: str,
                  rtol: float, atol: float) -> int:
    checked = 0
    for attr, meta in pm.fullmap.items():
        if meta.kind != "parameter":
            continue
        full = reference[prefix + meta.orig_name]
        mine = getattr(pm, attr).detach()
        if meta.value == (0, 1):
            torch.testing.assert_close(mine, meta.take(full), rtol=rtol, atol=atol,
                                       msg=lambda m, n=meta.orig_name: f"{n}: {m}")
            checked += 1
    return checked


@attrs.frozen
class Case:
    """One parity run: a model trained with a policy on ``runtime_ngpus`` processes."""

    kind: str
    policy: str
    plan_ngpus: int
    runtime_ngpus: int
    use_zero: bool = False
    use_async_reducer: bool = False
    end2end: bool = False
    micro: int = 1
    steps: int = 3
    zero_stage: int | None = None
    zero_ngroups: int = 1
    zero_units: tuple[str, ...] = ()
    recompute: bool = False  # every GPT block recomputed (graph.recompute after the policy)

    @property
    def units(self) -> int:
        return self.runtime_ngpus // self.plan_ngpus

    def id(self) -> str:
        flags = [f for f, on in (("zero", self.use_zero), ("async", self.use_async_reducer),
                                 ("e2e", self.end2end)) if on]
        if self.zero_stage is not None:
            flags.append(f"zero{self.zero_stage}")
        if self.zero_ngroups != 1:
            flags.append(f"ng{self.zero_ngroups}")
        if self.zero_units:
            flags.append(f"units{len(self.zero_units)}")
        if self.recompute:
            flags.append("recompute")
        return (f"{self.kind}-{self.policy}-p{self.plan_ngpus}r{self.runtime_ngpus}"
                + ("-" + "-".join(flags) if flags else "") + f"-mb{self.micro}")

    def plan(self) -> Any:
        """The policy to parallelize with: ``policy``, with every block recomputed when
        ``recompute``."""
        if not self.recompute:
            return self.policy
        from nnscaler.policies import data, tp

        base = {"dp": data, "tp": tp}[self.policy]

        def recompute_blocks(graph: Any, config: Any) -> Any:
            graph = base(graph, config)
            blocks = {".".join(op.module_path.split(".")[:3]) for op in graph.ops
                      if op.module_path.startswith("gpt.blocks.")}
            for block in sorted(blocks):
                graph.recompute(block)
            return graph

        return recompute_blocks

    def compute_config(self) -> Any:
        from nnscaler import ComputeConfig

        return ComputeConfig(plan_ngpus=self.plan_ngpus, runtime_ngpus=self.runtime_ngpus,
                             use_zero=self.use_zero if self.zero_stage is None else None,
                             use_async_reducer=self.use_async_reducer,
                             use_end2end=self.end2end, zero_stage=self.zero_stage,
                             zero_ngroups=self.zero_ngroups, zero_units=self.zero_units)


def train_parallel(case: Case, rank: int, gen_savedir: str) -> dict[str, Any]:
    """Run ``case`` on this rank; compare with the reference computed here too."""
    from nnscaler import build_optimizer, parallelize

    data = samples(case.kind, case.steps, case.units, case.micro)
    ref_losses, ref_state = reference_train(make_model(case.kind), data)
    cfg = case.compute_config()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(make_model(case.kind), {"batch": data[0][0][0]}, case.policy, cfg,
                         gen_savedir=gen_savedir, instance_name=case.id())
    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    unit = rank // case.plan_ngpus
    losses = []
    for step in data:
        mbs = step[unit]
        if case.end2end:
            row = [float(x) for x in pm.train_step(mbs)]
        else:
            row = []
            for i, batch in enumerate(mbs):
                last = i == len(mbs) - 1
                with contextlib.nullcontext() if last else pm.no_sync():
                    loss = pm(batch)
                    loss.backward()
                row.append(loss.item())
        opt.step()
        opt.zero_grad()
        losses.append(row)
    expected = [step[unit] for step in ref_losses]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    checked = check_pieces(pm, ref_state)
    return {"losses": losses, "checked": checked}
