"""A DeepSeek-V3-shaped MoE language model for planning at scale (built on the meta device).

The shapes of DeepSeek-V3 (arXiv 2412.19437, Table and section 4.2; its Hugging Face
``config.json``): 61 layers, the first 3 dense (a gated MLP of 18432), the other 58 MoE
layers of 256 routed experts (a gated MLP of 2048 each), top-8, and 1 shared expert of
2048; hidden 7168, 128 attention heads, vocabulary 129280; about 671B parameters.

**Approximated**: multi-head latent attention (MLA: low-rank query and key-value
projections, decoupled rotary keys) is written as standard multi-head attention with the
same parameter count: MLA's projections hold 187.1M parameters per layer
(``q_a 7168x1536 + q_b 1536x(128x192) + kv_a 7168x576 + kv_b 512x(128x256) + o
(128x128)x7168``), and four projections of 7168 x (128 heads x 51) hold 187.2M. The
router is DeepSeek-V3's sigmoid router with its selected weights normalised (no
node-limited routing: every token may reach any expert); the experts run through
`nnscaler.ops.builtin.moe.moe_experts`. No rotary embedding (it has no parameters and
costs little next to the matmuls).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn


@attrs.frozen
class DeepSeekV3Shape:
    layers: int = 61
    dense_layers: int = 3
    hidden: int = 7168
    heads: int = 128
    head_dim: int = 51  # standard attention with MLA's parameter count (module docstring)
    dense_ffn: int = 18432
    moe_ffn: int = 2048
    experts: int = 256
    top_k: int = 8
    shared_experts: int = 1
    vocab: int = 129280


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    def __init__(self, shape: DeepSeekV3Shape) -> None:
        super().__init__()
        inner = shape.heads * shape.head_dim
        self.heads = shape.heads
        self.q = nn.Linear(shape.hidden, inner, bias=False)
        self.k = nn.Linear(shape.hidden, inner, bias=False)
        self.v = nn.Linear(shape.hidden, inner, bias=False)
        self.o = nn.Linear(inner, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MoE(nn.Module):
    """Sigmoid router, top-k normalised, routed experts and a shared expert."""

    def __init__(self, shape: DeepSeekV3Shape) -> None:
        super().__init__()
        self.top_k = shape.top_k
        self.router = nn.Linear(shape.hidden, shape.experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(shape.experts, 2 * shape.moe_ffn, shape.hidden))
        self.down = nn.Parameter(torch.empty(shape.experts, shape.hidden, shape.moe_ffn))
        self.shared = GatedMLP(shape.hidden, shape.moe_ffn * shape.shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from nnscaler.ops.builtin.moe import moe_experts

        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        scores = self.router(flat).sigmoid()
        weights, index = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = moe_experts(flat, index, weights, self.gate_up, self.down, layer="moe")
        return (routed + self.shared(flat)).reshape(b, s, h)


class Layer(nn.Module):
    def __init__(self, shape: DeepSeekV3Shape, dense: bool) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(shape.hidden)
        self.attn = Attention(shape)
        self.mlp_norm = nn.RMSNorm(shape.hidden)
        self.mlp = GatedMLP(shape.hidden, shape.dense_ffn) if dense else MoE(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class DeepSeekV3LM(nn.Module):
    """``forward({"input_ids", "labels"})`` -> the next-token loss."""

    def __init__(self, shape: DeepSeekV3Shape | None = None) -> None:
        super().__init__()
        shape = shape or DeepSeekV3Shape()
        self.embed = nn.Embedding(shape.vocab, shape.hidden)
        self.dense = nn.ModuleList(Layer(shape, True) for _ in range(shape.dense_layers))
        self.layers = nn.ModuleList(Layer(shape, False)
                                    for _ in range(shape.layers - shape.dense_layers))
        self.norm = nn.RMSNorm(shape.hidden)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.embed(batch["input_ids"])
        for layer in [*self.dense, *self.layers]:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
