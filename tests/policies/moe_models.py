"""Tiny MoE models for the expert-parallel tests and the bench: a DeepSeek-style block
written here (a router with a bias, routed experts through `moe_experts`, a shared expert,
the load-balancing loss), and Hugging Face Mixtral and Qwen2-MoE with their auxiliary
loss on."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from nnscaler.ops.builtin.moe import moe_experts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB, SEQ = 64, 8


class DeepSeekStyleMoE(nn.Module):
    """Routed experts (top-k of a softmax router) plus an always-on shared expert."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, skew: float = 0.0):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        # a fixed bias on the router's logits: skew > 0 sends every token to expert 0 first
        self.register_buffer("router_bias", torch.zeros(experts).index_fill(0, torch.tensor(0), skew))
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) / hidden**0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, ffn) / ffn**0.5)
        self.shared_up = nn.Linear(hidden, ffn, bias=False)
        self.shared_down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        probs = (self.router(flat) + self.router_bias).softmax(-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = moe_experts(flat, index, weights, self.gate_up, self.down, activation="silu")
        shared = self.shared_down(F.silu(self.shared_up(flat)))
        # Switch-style load balancing: fraction of tokens per expert x mean probability
        chosen = F.one_hot(index, probs.size(-1)).float().sum(1).mean(0)
        aux = (chosen * probs.mean(0)).sum() * probs.size(-1)
        return (routed + shared).reshape(b, s, h), aux


class DeepSeekStyleLM(nn.Module):
    def __init__(self, experts: int = 4, top_k: int = 2, skew: float = 0.0, layers: int = 2,
                 hidden: int = 16, ffn: int = 24):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.moes = nn.ModuleList(DeepSeekStyleMoE(hidden, ffn, experts, top_k, skew)
                                  for _ in range(layers))
        self.head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.embed(batch["input_ids"])
        aux = x.new_zeros(())
        for norm, moe in zip(self.norms, self.moes):
            y, a = moe(norm(x))
            x, aux = x + y, aux + a
        logits = self.head(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))
        return loss + 0.01 * aux


class WithLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss


def hf_moe(kind: str, experts: int = 4, top_k: int = 2, layers: int = 2, hidden: int = 32,
           ffn: int = 32) -> nn.Module:
    """Tiny random Mixtral or Qwen2-MoE, computing its load-balancing loss."""
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                  num_experts_per_tok=top_k, output_router_logits=True,
                  router_aux_loss_coef=0.01, attn_implementation="eager")
    if kind == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=experts, intermediate_size=ffn,
                                            **common)
        return WithLoss(transformers.MixtralForCausalLM(config))
    config = transformers.Qwen2MoeConfig(num_experts=experts, moe_intermediate_size=ffn,
                                         intermediate_size=ffn,
                                         shared_expert_intermediate_size=ffn, **common)
    return WithLoss(transformers.Qwen2MoeForCausalLM(config))


def build(kind: str, **kw) -> nn.Module:
    if kind == "deepseek":
        return DeepSeekStyleLM(**kw)
    return hf_moe(kind, **kw)


def batches(steps: int, units: int, batch: int = 4, seed: int = 0) -> list[list[dict]]:
    """``batches[step][unit]``: every scale unit sees its own samples."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(units):
            ids = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
            step.append({"input_ids": ids, "labels": ids.clone()})
        out.append(step)
    return out
