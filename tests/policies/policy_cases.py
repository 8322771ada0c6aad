"""Models the built-in policies are tested on, traced once per session, and the check
that a plan reproduces its module (loss and every parameter's gradient, rtol 1e-5)."""

from __future__ import annotations

import functools
import os
import warnings
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch
from torch import nn

from nnscaler.graph import IRGraph, check_plan, run_plan
from nnscaler.ir import Graph
from nnscaler.models import MLP, GPTConfig, GPTWithLoss, MLPConfig
from nnscaler.models import gpt as gpt_module
from nnscaler.models import mlp as mlp_module
from nnscaler.trace import trace

BATCH = 4
MODELS = ("mlp", "gpt", "gpt_manual", "gpt_nobias", "hf_gpt2", "hf_llama")


@attrs.frozen(eq=False)
class Case:
    name: str
    module: nn.Module
    args: dict[str, Any]
    graph: Graph
    expected: torch.Tensor
    grads: dict[str, torch.Tensor]


def config(plan_ngpus: int, **pas_config: Any) -> SimpleNamespace:
    """What the policies read of a ComputeConfig."""
    return SimpleNamespace(plan_ngpus=plan_ngpus, runtime_ngpus=plan_ngpus,
                           pas_config=pas_config, use_end2end=True)


class WithLoss(nn.Module):
    """``forward(batch) -> loss`` for a Hugging Face model that computes its own loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss


def _hf(name: str) -> tuple[nn.Module, dict[str, Any]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    vocab = 128
    if name == "hf_llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, n_positions=64, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, vocab, (BATCH, 8), generator=torch.Generator().manual_seed(0))
    return WithLoss(model).train(), {"batch": {"input_ids": ids, "labels": ids.clone()}}


@functools.cache
def case(name: str) -> Case:
    """``mlp``; ``gpt`` (SDPA attention, 4 heads so that 4 devices can split them),
    ``gpt_manual`` (explicit softmax), ``gpt_nobias`` (MLP output projections without
    bias); ``hf_gpt2`` and ``hf_llama`` (Hugging Face, tiny random configs, dropout 0)."""
    torch.manual_seed(0)
    if name == "mlp":
        cfg = MLPConfig(d_in=8, d_hidden=16, n_classes=4, n_layers=3)
        module: nn.Module = MLP(cfg)
        args: dict[str, Any] = {"batch": mlp_module.make_batch(cfg, BATCH)}
    elif name.startswith("gpt"):
        attn = "manual" if name == "gpt_manual" else "sdpa"
        cfg = GPTConfig(vocab_size=32, n_layer=2, n_head=4, d_model=16, seq_len=6, attn=attn)
        module = GPTWithLoss(cfg)
        if name == "gpt_nobias":
            for block in module.gpt.blocks:
                block.mlp.proj.bias = None
        args = {"batch": gpt_module.make_batch(cfg, BATCH)}
    elif name.startswith("hf_"):
        module, args = _hf(name)
    else:
        raise ValueError(f"unknown test model {name!r}; known: {MODELS}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(module, args)
    module.zero_grad(set_to_none=True)
    out = module(**args)
    out.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return Case(name, module, args, graph, out.detach(), grads)


def fresh(name: str) -> IRGraph:
    return IRGraph.from_graph(case(name).graph)


def assert_reproduces(graph: IRGraph, name: str, ndevices: int) -> None:
    """``graph`` passes check_plan on ``ndevices`` and run_plan gives the module's loss and
    parameter gradients (float32, rtol 1e-5)."""
    c = case(name)
    check_plan(graph, ndevices)
    c.module.zero_grad(set_to_none=True)
    try:
        out = run_plan(graph, c.module, c.args)
        torch.testing.assert_close(out.detach(), c.expected, rtol=1e-5, atol=1e-6)
        out.backward()
        got = {n: p.grad for n, p in c.module.named_parameters() if p.grad is not None}
        assert got.keys() == c.grads.keys()
        for n, g in c.grads.items():
            torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=n: f"gradient of {n}: {m}")
    finally:
        c.module.zero_grad(set_to_none=True)
