"""Shared helpers of the pipeline tests: plan a model with a pipeline policy, generate
every rank's file, run ``train_step`` over micro-batches on N gloo processes, and compare
with the single-process module.

Parity (docs/pipeline.md): each scale unit trains on its own ``nmicros`` micro-batches;
every rank of a unit reports the loss of each micro-batch; the gradients of the pieces,
summed over the ranks that hold them (tied weights: over the stages that hold a copy),
equal the module's gradient of the summed losses; after ``sync_grad`` every holder has
that gradient; SGD steps (with momentum) over ``parameters_for_optimizer()`` keep every
piece equal to the module's parameter (float32, rtol 1e-5). SGD rather than Adam: Adam
divides each element by its gradient's magnitude, which turns the float noise of a tiny
gradient (summed in another order) into a step of size ``lr``.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dist_utils import run_distributed  # noqa: E402
from parity_utils import ATOL, RTOL, check_parity, check_zero3_header  # noqa: E402, F401  (re-exported to tests)

from nnscaler.codegen import emit_files, load_generated_class  # noqa: E402
from nnscaler.graph import IRGraph  # noqa: E402
from nnscaler.ir import Graph  # noqa: E402
from nnscaler.models import MLP, GPTConfig, GPTWithLoss, MLPConfig  # noqa: E402
from nnscaler.models import gpt as gpt_module  # noqa: E402
from nnscaler.models import mlp as mlp_module  # noqa: E402
from nnscaler.runtime.zero3 import gathered  # noqa: E402
from nnscaler.trace import trace  # noqa: E402

LR, MOMENTUM = 0.1, 0.9
BATCH = 4


class TiedMLP(nn.Module):
    """An MLP whose first and last layers are one ``nn.Linear`` (a shared weight)."""

    def __init__(self, d: int = 16, n_layers: int = 4) -> None:
        super().__init__()
        self.first = nn.Linear(d, d)
        self.middle = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers - 2))
        self.last = self.first

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = torch.tanh(self.first(batch["x"]))
        for layer in self.middle:
            h = torch.tanh(layer(h))
        h = self.last(h)
        return torch.nn.functional.mse_loss(h, batch["y"])


class Skip(nn.Module):
    """Three linears; the first one's output is also added after the third (a tensor that
    skips a stage when each linear is a stage)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(3))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h0 = torch.tanh(self.layers[0](batch["x"]))
        h1 = torch.tanh(self.layers[1](h0))
        h2 = self.layers[2](h1) + h0
        return torch.nn.functional.mse_loss(h2, batch["y"])


class InPlace(nn.Module):
    """The second layer scales its input in place (a received tensor, when the two
    layers are different stages)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(2))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.layers[0](batch["x"])
        h = self.layers[1](torch.tanh(h.mul_(2.0)))
        return torch.nn.functional.mse_loss(h, batch["y"])


class WithLoss(nn.Module):
    """``forward(batch) -> loss`` for a Hugging Face model that computes its own loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss


@attrs.frozen(eq=False)
class Case:
    """A traced model and how to make its micro-batches."""

    name: str
    module: nn.Module
    graph: Graph
    make_batch: Callable[[int], Any]  # seed -> a batch of BATCH samples


def _hf_gpt2() -> tuple[nn.Module, Callable[[int], Any]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    vocab = 128
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=4, n_head=4, vocab_size=vocab, n_positions=64, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    def make(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (BATCH, 8), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

    return WithLoss(model).train(), make


@functools.cache
def case(name: str) -> Case:
    """``mlp8`` (8 linear layers), ``gpt`` (the project's GPT: 4 blocks, LM head tied to
    the embedding), ``hf_gpt2`` (Hugging Face GPT-2, 4 layers, tied), ``tied`` (the
    first and last layers share one weight), ``skip`` (an activation read two layers
    later), ``inplace`` (a layer that changes its input in place)."""
    torch.manual_seed(0)
    make: Callable[[int], Any]
    if name == "mlp8":
        cfg = MLPConfig(d_in=8, d_hidden=16, n_classes=4, n_layers=8)
        module: nn.Module = MLP(cfg)

        def make(seed: int, cfg: MLPConfig = cfg) -> Any:
            return mlp_module.make_batch(cfg, BATCH, seed=seed)
    elif name == "gpt":
        gcfg = GPTConfig(vocab_size=32, n_layer=4, n_head=4, d_model=16, seq_len=6)
        module = GPTWithLoss(gcfg)

        def make(seed: int, cfg: GPTConfig = gcfg) -> Any:
            return gpt_module.make_batch(cfg, BATCH, seed=seed)
    elif name == "hf_gpt2":
        module, make = _hf_gpt2()
    elif name in ("tied", "skip", "inplace"):
        module = {"tied": TiedMLP, "skip": Skip, "inplace": InPlace}[name]()

        def make(seed: int) -> Any:
            g = torch.Generator().manual_seed(seed)
            return {"x": torch.randn(BATCH, 16, generator=g),
                    "y": torch.randn(BATCH, 16, generator=g)}
    else:
        raise KeyError(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(module, {"batch": make(0)})
    return Case(name, module, graph, make)


def config(plan_ngpus: int, runtime_ngpus: int | None = None, **pas_config: Any) -> SimpleNamespace:
    """What the policies and code generation read of a ComputeConfig."""
    return SimpleNamespace(plan_ngpus=plan_ngpus, runtime_ngpus=runtime_ngpus or plan_ngpus,
                           pas_config=pas_config, use_end2end=True)


def plan(name: str, policy: Callable[..., IRGraph], cfg: SimpleNamespace) -> IRGraph:
    return policy(IRGraph.from_graph(case(name).graph), cfg)


def generate(tmp: Path, name: str, graph: IRGraph, cfg: SimpleNamespace) -> Path:
    out = tmp / "gen"
    emit_files(graph, out, plan_ngpus=cfg.plan_ngpus, runtime_ngpus=cfg.runtime_ngpus,
               state=case(name).module, end2end=True, compute_config=cfg)
    return out


def micro_batches(name: str, nunits: int, nmicros: int, step: int = 0) -> list[list[Any]]:
    """Per scale unit, its micro-batches of one step (all different)."""
    make = case(name).make_batch
    return [[make(1000 * step + 100 * u + m) for m in range(nmicros)] for u in range(nunits)]


def _grads(m: nn.Module) -> dict[str, torch.Tensor]:
    return {a: p.grad.detach().clone() for a, p in m.named_parameters() if p.grad is not None}


def _worker(rank: int, world: int, outdir: str, data: list, plan_ngpus: int,
            steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    cls = load_generated_class(outdir, rank)
    m = cls(init_params=True)
    if m.reducer_config.get("zero_stage", 0) >= 3:
        check_zero3_header(m)  # the file's list of shards is what the buckets hold
    unit = rank // plan_ngpus
    opt = torch.optim.SGD(m.parameters_for_optimizer(), lr=LR, momentum=MOMENTUM)
    losses, raw, synced, times = [], {}, {}, []
    for k in range(steps):
        start = time.perf_counter()
        outs = m.train_step(data[k][unit])
        times.append(time.perf_counter() - start)
        losses.append([o.item() for o in outs])
        if k == 0:
            raw = _grads(m)
        m.sync_grad()
        if k == 0:
            synced = _grads(m)
        opt.step()
        m.gather_params()
    with gathered(m):  # ZeRO stage 3: the parameters hold values only when gathered
        params = {a: p.detach().clone() for a, p in m.named_parameters()}
    return {"losses": losses, "fullmap": m.fullmap, "raw": raw, "synced": synced,
            "params": params, "times": times}


def reference(name: str, data: list, steps: int) -> dict[str, Any]:
    """The single-process run: each step, the summed loss of every micro-batch of every
    unit."""
    module = copy.deepcopy(case(name).module)
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    losses, grads = [], {}
    for k in range(steps):
        opt.zero_grad(set_to_none=True)
        per_unit = [[module(b) for b in unit] for unit in data[k]]
        losses.append([[x.item() for x in unit] for unit in per_unit])
        torch.stack([x for unit in per_unit for x in unit]).sum().backward()
        if k == 0:
            grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        opt.step()
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def run_parity(tmp: Path, name: str, graph: IRGraph, cfg: SimpleNamespace, *,
               steps: int = 2) -> list[dict[str, Any]]:
    """Generate, train ``steps`` steps on ``cfg.runtime_ngpus`` processes, compare."""
    outdir = generate(tmp, name, graph, cfg)
    nunits = cfg.runtime_ngpus // cfg.plan_ngpus
    nmicros = cfg.pas_config["pipeline_nmicros"]
    data = [micro_batches(name, nunits, nmicros, k) for k in range(steps)]
    results = run_distributed(_worker, cfg.runtime_ngpus, str(outdir), data, cfg.plan_ngpus,
                              steps)
    check_parity(results, reference(name, data, steps), cfg.plan_ngpus,
                 zero=bool(getattr(cfg, "use_zero", False)))
    return results
