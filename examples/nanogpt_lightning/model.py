"""A character-level nanoGPT for the Lightning example: token and position embeddings,
pre-LN blocks (causal self-attention, GELU MLP), a final LayerNorm and an LM head.

Plain PyTorch written for one device: nnscaler parallelizes it as it is.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class CharGPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class Attention(nn.Module):
    def __init__(self, c: CharGPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.query = nn.Linear(c.n_embd, c.n_embd)
        self.key = nn.Linear(c.n_embd, c.n_embd)
        self.value = nn.Linear(c.n_embd, c.n_embd)
        self.out = nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.n_head

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(b, t, h, c // h).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.query), heads(self.key),
                                           heads(self.value), is_causal=True)
        return self.out(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, c: CharGPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.n_embd)
        self.attn = Attention(c)
        self.norm2 = nn.LayerNorm(c.n_embd)
        self.up = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.down = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class CharGPT(nn.Module):
    """``forward(x, y)``: the mean next-character cross-entropy of ``x`` ``[B, T]``."""

    def __init__(self, c: CharGPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab_size, c.n_embd)
        self.pos = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
