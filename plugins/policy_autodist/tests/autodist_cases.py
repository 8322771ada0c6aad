"""Models and the training loop shared by the autodist parity tests."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

# The optimizer of the parity runs. Its step must be a well-conditioned function of the
# gradient, so that comparing weights after it is no stricter than comparing gradients:
# the gradients themselves are compared at rtol 1e-5 / atol 1e-6 before every step. Adam
# is not: its step lr * m / (sqrt(v) + eps) moves by up to lr / eps per unit of gradient,
# so with lr 1e-2 and eps 1e-4 a rounding difference of 1.2e-8 in a near-zero gradient of
# the tied embedding (the order of a matmul's sums differs between a split and a whole op,
# and between CPUs) became 1.2e-6 in a weight after two steps on another machine. SGD with
# momentum moves by at most lr / (1 - momentum) per unit: rounding stays rounding.
SGD = {"lr": 0.1, "momentum": 0.9}


def _gpt_seq() -> Any:  # the config of kind "gpt_seq"
    from nnscaler.models import GPTConfig

    return GPTConfig(vocab_size=256, n_layer=2, n_head=1, d_model=64, seq_len=16)


class Quickstart(nn.Module):
    """The seed quickstart's model: Linear(100, 10) and cross-entropy on a dict batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(100, 10)

    def forward(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.linear(data["x"])
        return nn.functional.cross_entropy(x, data["y"])


def make(kind: str) -> nn.Module:
    from nnscaler.models import MLP, GPTConfig, GPTWithLoss, MLPConfig

    torch.manual_seed(0)
    if kind == "quickstart":
        return Quickstart()
    if kind == "mlp":
        return MLP(MLPConfig(d_in=16, d_hidden=64, n_classes=4, n_layers=3))
    if kind == "gpt_seq":  # one sequence, one head: test_autodist_sequence.py's model
        return GPTWithLoss(_gpt_seq())
    return GPTWithLoss(GPTConfig(vocab_size=32, n_layer=2, n_head=4, d_model=32, seq_len=8))


def batch(kind: str, seed: int) -> dict[str, torch.Tensor]:
    from nnscaler.models import GPTConfig, MLPConfig
    from nnscaler.models.gpt import make_batch as gpt_batch
    from nnscaler.models.mlp import make_batch as mlp_batch

    g = torch.Generator().manual_seed(seed)
    if kind == "quickstart":
        return {"x": torch.rand(4, 100, generator=g), "y": torch.randint(10, (4,), generator=g)}
    if kind == "mlp":
        return mlp_batch(MLPConfig(d_in=16, d_hidden=64, n_classes=4, n_layers=3), 8, seed=seed)
    if kind == "gpt_seq":
        return gpt_batch(_gpt_seq(), 1, seed=seed)
    return gpt_batch(GPTConfig(vocab_size=32, n_layer=2, n_head=4, d_model=32, seq_len=8), 4,
                     seed=seed)


def train(rank: int, world: int, kind: str, plan_ngpus: int | str, pas_config: dict[str, Any],
          outdir: str, steps: int = 2, micro: int = 1, use_zero: bool = False) -> dict:
    """Train ``steps`` optimizer steps with autodist; compare with one process seeing every
    unit's micro-batches: the losses, every gradient piece before each step and every
    parameter piece after the last (rtol 1e-5)."""
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    # parallelized first: with plan_ngpus='auto' the plan decides the units (the dummy
    # batch, seed 0, is the first micro-batch of the first unit either way)
    cfg = ComputeConfig(plan_ngpus, world, use_end2end=True, use_zero=use_zero,
                        pas_config=pas_config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(make(kind), {"data" if kind == "quickstart" else "batch": batch(kind, 0)},
                         "autodist", cfg, gen_savedir=outdir)
    plan_ngpus = pm.plan_ngpus
    units = world // plan_ngpus
    data = [[[batch(kind, 100 * s + 10 * u + m) for m in range(micro)] for u in range(units)]
            for s in range(steps)]
    ref = make(kind)
    opt = torch.optim.SGD(ref.parameters(), **SGD)
    ref_losses, ref_grads = [], []
    for step in data:
        opt.zero_grad()
        row = []
        for unit in step:
            for b in unit:
                loss = ref(b)
                loss.backward()
                row.append(loss.item())
        ref_grads.append({n: p.grad.detach().clone() for n, p in ref.named_parameters()
                          if p.grad is not None})
        opt.step()
        ref_losses.append(row)
    popt = build_optimizer(pm, torch.optim.SGD, **SGD)
    unit = rank // plan_ngpus
    pieces = [(attr, meta) for attr, meta in pm.fullmap.items()
              if meta.kind == "parameter" and meta.value == (0, 1)]
    for s, step in enumerate(data):
        losses = [float(x) for x in pm.train_step(step[unit])]
        popt.sync_shard_grad()  # what step() does first; gradients are unreduced before
        if not use_zero:  # under ZeRO the synced gradients live in the optimizer's shards
            for attr, meta in pieces:
                grad = getattr(pm, attr).grad
                want = ref_grads[s].get(meta.orig_name)
                if want is None:
                    continue
                torch.testing.assert_close(
                    grad if grad is not None else torch.zeros_like(meta.take(want)),
                    meta.take(want), rtol=1e-5, atol=1e-6,
                    msg=lambda m, n=meta.orig_name, s=s: f"step {s} gradient of {n}: {m}")
        popt.step()
        popt.zero_grad()
        want = ref_losses[s][unit * micro:(unit + 1) * micro]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5,
                                   atol=1e-6)
    state = {n: p.detach() for n, p in ref.named_parameters()}
    checked = 0
    for attr, meta in pieces:
        full = state[meta.orig_name]
        torch.testing.assert_close(getattr(pm, attr).detach(), meta.take(full), rtol=1e-5,
                                   atol=1e-6, msg=lambda m, n=meta.orig_name: f"{n}: {m}")
        checked += 1
    return {"checked": checked, "plan_ngpus": plan_ngpus}


class TinyExperts(nn.Module):
    """Four experts, top-2 routing, 16 features: the smallest layer whose expert split
    autodist prices (its dispatch and combine all-to-alls)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4, bias=False)
        self.gate_up = nn.Parameter(torch.randn(4, 48, 16))
        self.down = nn.Parameter(torch.randn(4, 16, 24))

    def forward(self, x):
        from nnscaler.ops.builtin.moe import moe_experts

        weights, index = self.router(x).softmax(-1).topk(2, dim=-1)
        return moe_experts(x, index, weights, self.gate_up, self.down).sum()
