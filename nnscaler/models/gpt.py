"""A small, clean GPT: the project's reference model for tests, benchmarks and examples.

Token and position embeddings, ``n_layer`` pre-LN blocks (causal self-attention with
separate q/k/v/o projections, then a linear-gelu-linear MLP), a final LayerNorm and an LM
head tied to the token embedding. Attention runs through
``F.scaled_dot_product_attention(is_causal=True)`` (``attn='sdpa'``) or an explicit
softmax over a masked score matrix (``attn='manual'``); both compute the same function.

``GPTWithLoss`` takes a batch ``{'input_ids': [B, T], 'labels': [B, T]}`` and returns the
mean cross-entropy: the form [`nnscaler.parallelize`][nnscaler.parallelize] and the trainer expect.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

ATTN_IMPLEMENTATIONS = ("sdpa", "manual")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of a `GPT`. ``seq_len`` is the longest sequence (position table size)."""

    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    seq_len: int = 1024
    dropout: float = 0.0
    attn: str = "sdpa"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{field} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head "
                f"({self.n_head}); each head gets d_model // n_head dims"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.attn not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"GPTConfig.attn must be one of {ATTN_IMPLEMENTATIONS}, got {self.attn!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.attn = config.attn
        self.dropout = config.dropout
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d)
        self.resid_dropout = nn.Dropout(config.dropout)

    def _heads(self, x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        b, t, _ = x.shape
        return proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self._heads(x, self.q_proj), self._heads(x, self.k_proj), self._heads(x, self.v_proj)
        p = self.dropout if self.training else 0.0
        if self.attn == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            future = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
            scores = scores.masked_fill(future, float("-inf"))
            weights = F.dropout(F.softmax(scores, dim=-1), p=p, training=self.training)
            y = torch.matmul(weights, v)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``input_ids`` ``[B, T]`` -> logits ``[B, T, vocab_size]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, two names
        self.apply(self._init_weights)
        for block in self.blocks:  # residual projections, scaled as in GPT-2
            for proj in (block.attn.o_proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.config.seq_len:
            raise ValueError(
                f"input_ids has {t} positions but GPTConfig.seq_len is {self.config.seq_len}; "
                f"shorten the sequence or build the model with a larger seq_len"
            )
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPTWithLoss(nn.Module):
    """A `GPT` whose forward takes ``{'input_ids', 'labels'}`` and returns the loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(config)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.gpt(batch["input_ids"])
        return F.cross_entropy(logits.view(-1, logits.size(-1)), batch["labels"].view(-1))


def make_batch(
    config: GPTConfig, batch_size: int, seq_len: int | None = None, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A random batch for `GPTWithLoss`: labels are the inputs shifted by one."""
    t = config.seq_len if seq_len is None else seq_len
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, t + 1), generator=g)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
