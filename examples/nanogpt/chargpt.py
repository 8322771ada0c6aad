"""A character-level GPT and its dataset: the model and data of the nanoGPT examples.

Importable on its own (``from chargpt import CharGPT, CharDataset`` with this folder on
``sys.path``), so other trainers (the Lightning example) reuse it. The vocabulary is
fixed: newline and the 95 printable ASCII characters, so a model's size never depends on
the text it reads.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nnscaler.cli.ops import chunk_linear_cross_entropy
from nnscaler.models.gpt import Block, GPTConfig

TEXT = Path(__file__).with_name("text.txt")
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(VOCAB)  # 96
_INDEX = {ch: i for i, ch in enumerate(VOCAB)}


def encode(text: str) -> torch.Tensor:
    """Character ids of ``text`` (characters outside the vocabulary become spaces)."""
    space = _INDEX[" "]
    return torch.tensor([_INDEX.get(ch, space) for ch in text], dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


class CharDataset:
    """Windows of ``block_size + 1`` characters of ``text.txt``: ``input_ids`` and the
    ``labels`` one character later. The first ``1 - val_fraction`` of the text is
    ``split='train'``, the rest ``'val'``; windows start every ``stride`` characters."""

    def __init__(self, split: str = "train", block_size: int = 64, stride: int | None = None,
                 val_fraction: float = 0.1, path: str | None = None) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"CharDataset split must be 'train' or 'val', got {split!r}")
        ids = encode(Path(path or TEXT).read_text())
        cut = int(len(ids) * (1 - val_fraction))
        self.ids = ids[:cut] if split == "train" else ids[cut:]
        self.block_size = block_size
        self.stride = stride or block_size
        if len(self.ids) <= block_size:
            raise ValueError(f"the {split} text has {len(self.ids)} characters, fewer than "
                             f"block_size + 1 = {block_size + 1}")

    def __len__(self) -> int:
        return (len(self.ids) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = i * self.stride
        window = self.ids[start:start + self.block_size + 1]
        return {"input_ids": window[:-1], "labels": window[1:]}


class CharGPT(nn.Module):
    """A GPT over characters whose forward takes ``{'input_ids', 'labels'}`` ``[B, T]``
    and returns the mean next-character cross-entropy (the Trainer's contract).

    ``chunked_loss=True`` computes the LM head and the loss with
    :func:`~nnscaler.cli.ops.chunk_linear_cross_entropy` (no ``[B*T, vocab]`` logits).
    """

    def __init__(self, n_layer: int = 2, n_head: int = 4, d_model: int = 64,
                 seq_len: int = 64, dropout: float = 0.0, chunked_loss: bool = False) -> None:
        super().__init__()
        config = GPTConfig(vocab_size=VOCAB_SIZE, n_layer=n_layer, n_head=n_head,
                           d_model=d_model, seq_len=seq_len, dropout=dropout)
        self.chunked_loss = chunked_loss
        self.wte = nn.Embedding(VOCAB_SIZE, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.hidden(batch["input_ids"])
        if self.chunked_loss:
            return chunk_linear_cross_entropy(h, self.lm_head.weight, batch["labels"],
                                              chunk_size=256)
        logits = self.lm_head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), batch["labels"].view(-1))

    @torch.no_grad()
    def generate(self, prompt: str, n: int = 100) -> str:
        """Greedy continuation of ``prompt`` (for a trained model, merged from a checkpoint)."""
        ids = encode(prompt).unsqueeze(0)
        for _ in range(n):
            window = ids[:, -self.wpe.num_embeddings:]
            logits = self.lm_head(self.hidden(window))[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        return decode(ids[0])
