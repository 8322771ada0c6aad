"""Packed documents read from an attention mask, for the ring on block kernels.

A batch of packed sequences reaches ``scaled_dot_product_attention`` as a mask (Hugging
Face builds one): each query row sees one contiguous range of keys, the tokens of its
document (``[start, stop)``), and under causal masking only those up to itself
(``stop`` = its position + 1). `documents_of` reads that structure from a part's rows of
the mask and verifies it exactly (else None: the ring then applies the mask itself);
`block_pack` turns it into the `Packed` description of one key block, so a block kernel
(flash-attention's varlen kernels) runs each document of each batch row as a sequence.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from nnscaler.ops.builtin.attention_kernels import Packed

__all__ = ["BlockPack", "Documents", "block_pack", "documents_of", "flat", "unflat"]


@attrs.frozen
class Documents:
    """The runs of a part's query rows that see one key range: ``(row, start, stop,
    key_start, key_stop)`` over the batch rows flattened (row ``b * c + r``), keys in
    global positions; ``causal``: each row sees its document up to itself."""

    runs: tuple[tuple[int, int, int, int], ...]  # (first row, row stop, key start, key stop)
    chunk: int
    causal: bool


@attrs.frozen
class BlockPack:
    """One key block's `Packed` and the flattened key rows it gathers."""

    packed: Packed
    keys: torch.Tensor  # int64 indices into the flattened block


def flat(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, c, E)`` -> ``(1, H, B * c, E)``: batch rows one after another."""
    b, h, c = x.shape[:3]
    return x.transpose(0, 1).reshape(1, h, b * c, *x.shape[3:])


def unflat(x: torch.Tensor, batch: int) -> torch.Tensor:
    """The inverse of `flat` (``lse``-shaped tensors too)."""
    h, t = x.shape[1], x.shape[2]
    return x[0].reshape(h, batch, t // batch, *x.shape[3:]).transpose(0, 1)


def _allowed(mask: Any, batch: int, c: int) -> torch.Tensor | None:
    """The mask as ``(B, c, L)`` booleans (True: attend), or None where it is not one
    pattern for all heads of this part's rows (``(c, L)``, ``(1, c, L)`` or ``(B or 1,
    1, c, L)``; boolean, or 0 / -inf)."""
    if not isinstance(mask, torch.Tensor) or not 2 <= mask.dim() <= 4 or mask.shape[-2] != c:
        return None
    lead = [1] * (4 - mask.dim()) + list(mask.shape[:-2])
    if lead[1] != 1 or lead[0] not in (1, batch):
        return None
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == float("-inf"))).all()):
            return None
        mask = mask == 0
    return mask.reshape(lead[0], c, mask.shape[-1]).expand(batch, c, mask.shape[-1])


def documents_of(mask: Any, batch: int, c: int, row0: int) -> Documents | None:
    """The documents of this part's mask rows (global positions ``row0 ..``), verified;
    None where the mask is anything else (padding rows that see no key included)."""
    allowed = _allowed(mask, batch, c)
    if allowed is None or not bool(allowed.any(-1).all()):
        return None
    length = allowed.shape[-1]
    cols = torch.arange(length, device=allowed.device)
    start = allowed.to(torch.int8).argmax(-1)
    stop = length - allowed.flip(-1).to(torch.int8).argmax(-1)
    if not torch.equal(allowed, (cols >= start[..., None]) & (cols < stop[..., None])):
        return None
    pos = row0 + torch.arange(c, device=allowed.device)
    causal = bool((stop == pos + 1).all())
    runs = []
    for b, (starts, stops) in enumerate(zip(start.tolist(), stop.tolist(), strict=True)):
        first = 0
        for r in range(1, c + 1):
            if r == c or starts[r] != starts[first] or (not causal and stops[r] != stops[first]):
                key_stop = row0 + r if causal else stops[first]
                if causal and row0 + first != max(starts[first], row0):
                    return None  # a run that is not its document's diagonal
                runs.append((b * c + first, b * c + r, starts[first], key_stop))
                first = r
    return Documents(runs=tuple(runs), chunk=c, causal=causal)


def block_pack(docs: Documents, src: int, device: torch.device) -> BlockPack | None:
    """The `BlockPack` of the key block of part ``src`` (global keys ``src * c ..``):
    each run sees the part of its key range inside the block; None when none does."""
    c = docs.chunk
    a, b = src * c, (src + 1) * c
    cu_q, cu_k, keys = [0], [0], []
    for first, stop, k0, k1 in docs.runs:
        ka, kb = max(k0, a), min(k1, b)
        batch_row = first // c
        if ka < kb:
            keys.append(torch.arange(batch_row * c + ka - a, batch_row * c + kb - a,
                                     device=device))
        cu_q.append(cu_q[-1] + stop - first)
        cu_k.append(cu_k[-1] + max(kb - ka, 0))
    if not keys:
        return None
    q_lens = [y - x for x, y in zip(cu_q, cu_q[1:])]
    k_lens = [y - x for x, y in zip(cu_k, cu_k[1:])]
    packed = Packed(cu_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
                    cu_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
                    max_q=max(q_lens), max_k=max(k_lens))
    return BlockPack(packed=packed, keys=torch.cat(keys))
