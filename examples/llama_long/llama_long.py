"""A Llama for long sequences: the model, its loss and its data.

- `LongLlama`: ``transformers.LlamaForCausalLM`` built from a small ``LlamaConfig``
  (random weights, causal sdpa attention, nothing downloaded) whose forward takes
  ``{'input_ids', 'labels'}`` of one long sequence and returns the mean loss. The LM head
  and the loss are one op, `nnscaler.cli.ops.chunk_linear_cross_entropy`, with
  ``reduction='sum'``: the ``[tokens, vocabulary]`` logits never exist whole, and under
  the ``sequence`` policy each device computes the loss of its own tokens (the sums are
  value-partial and are added once).
- `CAUSAL_SDPA`: an attention implementation registered with ``transformers``: its
  ``scaled_dot_product_attention`` with ``is_causal=True`` and no mask. Hugging Face
  otherwise builds a ``[batch, 1, seq, seq]`` mask for every training batch (128K tokens:
  16 GiB of booleans on every device), and a mask tensor hides from the attention op that
  it is causal, so the ring could not balance it (zigzag). Each sequence here is one
  document, so the causal flag is the whole mask.
- `byte_windows`: windows of ``seq_len + 1`` bytes of a text file (vocabulary 256, no
  tokenizer to train), ``input_ids`` and ``labels`` one byte later.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from nnscaler.cli.ops import chunk_linear_cross_entropy

TEXT = Path(__file__).resolve().parent.parent / "nanogpt" / "text.txt"

CAUSAL_SDPA = "nnscaler_causal_sdpa"


def _register_causal_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    def no_mask(*args: object, **kwargs: object) -> None:
        return None  # sdpa_attention_forward then passes is_causal=True

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, no_mask)


#: the sizes of the model trained here on CPU processes
SMALL = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=128)
#: Llama-3 8B's sizes, for the 128K-token run on 8 GPUs (README.md)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                 num_kv_heads=8, intermediate_size=14336)


class LongLlama(nn.Module):
    """A causal Llama with the chunked LM head and loss (``chunk_size`` tokens at a time)."""

    def __init__(self, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 2,
                 num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                 max_positions: int = 131072, rope_theta: float = 500000.0,
                 chunk_size: int = 1024) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        _register_causal_sdpa()
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            intermediate_size=intermediate_size, max_position_embeddings=max_positions,
            rope_theta=rope_theta, tie_word_embeddings=False, attn_implementation=CAUSAL_SDPA)
        self.llama = LlamaForCausalLM(config)
        self.chunk_size = chunk_size

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.llama.model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
        labels = batch["labels"]
        total = chunk_linear_cross_entropy(hidden, self.llama.lm_head.weight, labels,
                                           reduction="sum", chunk_size=self.chunk_size)
        return total / labels.ne(-100).sum()


def byte_windows(seq_len: int, steps: int, *, text: Path = TEXT) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches of one window of ``seq_len`` bytes (consecutive windows of the
    text, wrapping around when it is shorter than ``steps * seq_len``)."""
    data = torch.frombuffer(bytearray(text.read_bytes()), dtype=torch.uint8).long()
    need = steps * seq_len + 1
    data = data.repeat(need // len(data) + 1)[:need]
    return [{"input_ids": data[i * seq_len:(i + 1) * seq_len].unsqueeze(0).clone(),
             "labels": data[i * seq_len + 1:(i + 1) * seq_len + 1].unsqueeze(0).clone()}
            for i in range(steps)]
