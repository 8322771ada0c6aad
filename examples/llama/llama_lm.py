"""A small Hugging Face Llama trained with the Trainer: model, tokenizer and data.

- :class:`LlamaLM`: ``transformers.LlamaForCausalLM`` built from a small
  ``LlamaConfig`` with random weights (nothing downloaded), whose forward takes
  ``{'input_ids', 'labels'}`` and returns the loss first; the LM head and the loss are
  :func:`~nnscaler.cli.ops.chunk_linear_cross_entropy` (no ``[tokens, vocabulary]``
  logits).
- :func:`train_tokenizer`: a byte-level BPE tokenizer trained locally with the
  ``tokenizers`` library on a text file (saved as ``tokenizer.json``).
- :class:`TokenDataset`: fixed-length windows of the tokenized text.

Loading real weights works the same way: build ``LlamaLM`` with ``pretrained=<local
path>`` (``LlamaForCausalLM.from_pretrained`` on a folder you have).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nnscaler.cli.ops import chunk_linear_cross_entropy

HERE = Path(__file__).resolve().parent
TEXT = HERE.parent / "nanogpt" / "text.txt"


def train_tokenizer(text: str | Path = TEXT, vocab_size: int = 512,
                    out: str | Path | None = None) -> Any:
    """A byte-level BPE tokenizer trained on ``text`` (a file); saved to ``out`` if given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(text)], trainer)
    if out is not None:  # atomically: other ranks may be reading it
        tmp = Path(f"{out}.{os.getpid()}.tmp")
        tok.save(str(tmp))
        os.replace(tmp, out)
    return tok


class TokenDataset:
    """Windows of ``seq_len + 1`` tokens: ``input_ids`` and ``labels`` one token later.

    The tokenizer is read from ``tokenizer`` (a ``tokenizer.json``) or trained on the
    text when the file does not exist yet. ``split='val'`` is the last ``val_fraction``.
    """

    def __init__(self, split: str = "train", seq_len: int = 32, tokenizer: str | None = None,
                 text: str | None = None, vocab_size: int = 512, val_fraction: float = 0.1,
                 stride: int | None = None) -> None:
        from tokenizers import Tokenizer

        text_path = Path(text) if text else TEXT
        tok_path = Path(tokenizer) if tokenizer else None
        if tok_path is not None and tok_path.exists():
            tok = Tokenizer.from_file(str(tok_path))
        else:
            tok = train_tokenizer(text_path, vocab_size, tok_path)
        ids = torch.tensor(tok.encode(text_path.read_text()).ids, dtype=torch.long)
        cut = int(len(ids) * (1 - val_fraction))
        self.ids = ids[:cut] if split == "train" else ids[cut:]
        self.seq_len = seq_len
        self.stride = stride or seq_len
        self.vocab_size = tok.get_vocab_size()

    def __len__(self) -> int:
        return (len(self.ids) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[i * self.stride:i * self.stride + self.seq_len + 1]
        return {"input_ids": window[:-1], "labels": window[1:]}


class LlamaLM(nn.Module):
    """``LlamaForCausalLM`` (small, random) with the chunked LM head and loss."""

    def __init__(self, vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2,
                 num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                 max_position_embeddings: int = 128, pretrained: str | None = None,
                 chunk_size: int = 256) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        if pretrained is not None:
            self.llama = LlamaForCausalLM.from_pretrained(pretrained)
        else:
            config = LlamaConfig(
                vocab_size=vocab_size, hidden_size=hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads,
                num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
                max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                attn_implementation="eager",
            )
            self.llama = LlamaForCausalLM(config)
        self.chunk_size = chunk_size

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.llama.model(input_ids=batch["input_ids"]).last_hidden_state
        return chunk_linear_cross_entropy(hidden, self.llama.lm_head.weight, batch["labels"],
                                          chunk_size=self.chunk_size)
