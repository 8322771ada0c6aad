"""Shared pieces of the checkpoint tests: a model with every kind of state, data, the
single-device reference and a training loop for parallel modules."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

V, D, H = 16, 8, 12  # vocabulary, model width, hidden width
LR = 1e-3  # with eps=1e-4 a step moves <= lr / eps = 10x a gradient's rounding (parity_utils)
# Adam's eps as in tests/parallel/common.py: gradients that are rounding noise must not
# turn into lr-sized steps whose sign depends on the summation order
ADAM = {"lr": LR, "eps": 1e-4}


class Net(nn.Module):
    """Tied weights (the head shares the embedding), a persistent and a non-persistent
    buffer that forward reads, and a parameter and a buffer it never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D), persistent=False)
        self.register_buffer("shift", torch.randn(D) * 0.1)
        self.unused = nn.Parameter(torch.randn(3, 4))
        self.register_buffer("unused_buf", torch.randn(2))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.emb(batch["x"]) * self.scale + self.shift
        h = h + self.fc2(F.gelu(self.fc1(h)))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, V), batch["y"].view(-1))


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_batch(seed: int, batch_size: int = 4, seq: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randint(0, V, (batch_size, seq), generator=g),
            "y": torch.randint(0, V, (batch_size, seq), generator=g)}


def steps_data(first: int, count: int, per_step: int) -> list[list[dict[str, torch.Tensor]]]:
    """``count`` steps of ``per_step`` batches each (all different), from step ``first``."""
    return [[make_batch(1000 * s + b) for b in range(per_step)]
            for s in range(first, first + count)]


def reference(data: list[list[dict[str, torch.Tensor]]],
              optimizer_fn: Callable[..., torch.optim.Optimizer] | None = None,
              ) -> tuple[list[list[float]], nn.Module, torch.optim.Optimizer]:
    """One process sees every batch of a step: gradients summed, one optimizer step per
    step. Returns the losses ``[step][batch]``, the model and the optimizer."""
    model = make_model()
    optimizer_fn = optimizer_fn or (lambda params: torch.optim.Adam(params, **ADAM))
    opt = optimizer_fn(model.parameters())
    losses = run_plain(model, opt, data)
    return losses, model, opt


def run_plain(model: nn.Module, opt: torch.optim.Optimizer,
              data: list[list[dict[str, torch.Tensor]]]) -> list[list[float]]:
    losses = []
    for step in data:
        opt.zero_grad()
        row = []
        for batch in step:
            loss = model(batch)
            loss.backward()
            row.append(loss.item())
        opt.step()
        losses.append(row)
    return losses


def run_parallel(pm: Any, opt: torch.optim.Optimizer, data: list[list[dict[str, torch.Tensor]]],
                 rank: int, micro: bool = False) -> list[list[float]]:
    """Train ``pm``: scale unit ``u`` takes batch ``u`` of each step (``micro``: the unit
    takes every batch of the step as micro-batches of one ``train_step``)."""
    unit = rank // pm.plan_ngpus
    losses = []
    for step in data:
        if micro:
            row = [float(x) for x in pm.train_step(step)]
        else:
            loss = pm(step[unit])
            loss.backward()
            row = [loss.item()]
        opt.step()
        opt.zero_grad()
        losses.append(row)
    return losses


def parallelize_net(policy: str, plan_ngpus: int, runtime_ngpus: int, gen_savedir: str,
                    *, use_zero: bool | None = None, init_params: bool = True,
                    pas_config: dict[str, Any] | None = None, end2end: bool = False,
                    instance: str | None = None, model: nn.Module | None = None,
                    zero_stage: int | None = None) -> Any:
    from nnscaler import ComputeConfig, parallelize

    cfg = ComputeConfig(plan_ngpus=plan_ngpus, runtime_ngpus=runtime_ngpus, use_zero=use_zero,
                        pas_config=pas_config or {}, use_end2end=end2end,
                        zero_stage=zero_stage)
    name = instance or (f"{policy}-p{plan_ngpus}r{runtime_ngpus}" + ("-zero" if use_zero and not zero_stage else "")
                        + (f"-zero{zero_stage}" if zero_stage else ""))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parallelize(model if model is not None else make_model(),
                           {"batch": make_batch(0)}, policy, cfg, gen_savedir=gen_savedir,
                           instance_name=name, init_module_params=init_params)


def rank_file(directory: str, kind: str, rank: int) -> str:
    return os.path.join(directory, f"{kind}{rank}.pt")


def tensor_bytes(*objs: Any) -> int:
    """Bytes of the distinct tensor storages in nested dicts/lists (what saving writes)."""
    seen: set[int] = set()
    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            key = x.untyped_storage().data_ptr()
            if key not in seen or x.untyped_storage().nbytes() == 0:
                seen.add(key)
                total += x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    for obj in objs:
        walk(obj)
    return total


def assert_state_close(got: dict[str, Any], want: dict[str, Any], rtol: float = 1e-5,
                       atol: float = 1e-6) -> None:
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k].cpu(), rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"{k}: {m}")


def assert_optimizer_close(got: dict[str, Any], want: dict[str, Any], rtol: float = 1e-5,
                           atol: float = 1e-6) -> None:
    """Optimizer state dicts equal: the same groups (hyperparameters and sizes) and state."""
    assert len(got["param_groups"]) == len(want["param_groups"])
    for g, w in zip(got["param_groups"], want["param_groups"]):
        assert len(g["params"]) == len(w["params"])
        for key in w:
            if key not in ("params", "param_names"):
                assert g[key] == w[key], (key, g[key], w[key])
    assert set(got["state"]) == set(want["state"]), (set(got["state"]), set(want["state"]))
    for i, state in want["state"].items():
        assert set(got["state"][i]) == set(state)
        for key, value in state.items():
            torch.testing.assert_close(torch.as_tensor(got["state"][i][key]).cpu().float(),
                                       torch.as_tensor(value).cpu().float(), rtol=rtol,
                                       atol=atol, msg=lambda m, i=i, k=key: f"{i}.{k}: {m}")
