"""Tiny random Hugging Face models and batches for the tests of the ``"nnscaler_fa"``
attention (offline, float32): Llama (GQA), Mistral (sliding window of 3), Gemma 2
(softcap, sliding and full layers); plain, padded and packed batches."""

from __future__ import annotations

import os

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, SEQ = 64, 10
#: packed rows: restarting position_ids, one list of sequence lengths per sample
PACKED = ([4, 3, 3], [2, 5, 3], [6, 4], [3, 3, 4])


def config(kind: str, use_cache: bool = False):
    import transformers

    common = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        use_cache=use_cache,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=3)
    if kind == "gemma2":
        return transformers.Gemma2Config(
            **common, head_dim=8, sliding_window=3, attn_logit_softcapping=5.0,
            query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"],
        )
    raise ValueError(kind)


def build(kind: str, impl: str, use_cache: bool = False) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config(kind, use_cache), attn_implementation=impl
    )
    return model.train()


class WithLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss


def _ids(seed: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def plain_batch(seed: int) -> dict[str, torch.Tensor]:
    ids = _ids(seed, 2)
    return {"input_ids": ids, "labels": ids.clone()}


def padded_batch(seed: int) -> dict[str, torch.Tensor]:
    """Row 0 padded on the right, row 1 on the left, by amounts that vary with the seed.

    No label is predicted from a padding position: its output is not the same under every
    attention (flash attention gives zeros, eager a mean over the padding), so the first
    real token of a left-padded row has no label either.
    """
    ids = _ids(seed, 2)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, SEQ - 1 - seed % 4 :] = 0
    mask[1, : 1 + seed % 3] = 0
    after_padding = torch.cat([torch.ones(2, 1, dtype=torch.long), mask[:, :-1]], 1) == 0
    labels = ids.masked_fill((mask == 0) | after_padding, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_positions(seed: int) -> torch.Tensor:
    lengths = PACKED[seed % len(PACKED)]
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def packed_batch(seed: int) -> dict[str, torch.Tensor]:
    """One row of sequences packed back to back, told apart by restarting position_ids."""
    ids = _ids(seed, 1)
    return {"input_ids": ids, "position_ids": packed_positions(seed), "labels": ids.clone()}


BATCHES = {"plain": plain_batch, "padded": padded_batch, "packed": packed_batch}
