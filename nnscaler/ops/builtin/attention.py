"""Attention: ``torch.nn.functional.scaled_dot_product_attention``.

``query (..., L, E)``, ``key (..., S, E)``, ``value (..., S, Ev)`` -> ``(..., L, Ev)``:

- batch and head dims split (with the mask, which broadcasts to ``(..., L, S)``);
- ``S`` (softmax) and ``E`` (inside the softmax) are ``^``;
- ``L`` splits: each query row attends independently. With ``is_causal`` the mask is
  aligned to the top-left corner of the whole ``L x S`` matrix, so ``L`` is ``^``;
- ``Ev`` splits: the output is ``P @ V``, column by column;
- grouped-query attention (``enable_gqa=True``, ``Hq = Hk * r``): query head ``i`` reads
  key head ``i // r``, so the query heads are the hidden group ``(h r)`` and splitting
  ``h`` splits the key/value heads and the matching blocks of query heads together;
- self-attention (``L == S``) also splits along the sequence, by the rules of
  `nnscaler.ops.builtin.context_parallel`: the key's sequence dim (``idx=1``) for ring
  attention (zigzag when causal), the value's (``idx=2``) for Ulysses.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F

from nnscaler.ops.builtin._common import is_tensor, randint, tensor_str
from nnscaler.ops.builtin.context_parallel import sequence_rules
from nnscaler.ops.builtin.nn import f64
from nnscaler.ops.registry import OpRegistry


def sdpa_anno(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
    enable_gqa=False,
) -> str:
    lq, lk, lv = (tuple(int(n) for n in t.shape[:-2]) for t in (query, key, value))
    grouped = (
        enable_gqa and len(lq) > 0 and len(lk) > 0 and lk[-1] not in (lq[-1], 1)
    )

    def as_query(lead: tuple[int, ...]) -> tuple[int, ...]:
        return (*lead[:-1], lq[-1]) if grouped and lead else lead

    lead = list(torch.broadcast_shapes(lq, as_query(lk), as_query(lv)))
    L, S = int(query.shape[-2]), int(key.shape[-2])
    if is_tensor(attn_mask):
        lead = list(torch.broadcast_shapes(tuple(lead), tuple(attn_mask.shape[:-2])))
    names = [f"b{i}" for i in range(len(lead))]
    head = len(lead) - 1 if grouped else None
    l_ = "l^" if is_causal else "l"

    def dims(shape: tuple[int, ...], full_names: list[str], full_shape: list[int], kv: bool) -> list[str]:
        off = len(full_names) - len(shape)
        out = []
        for i, n in enumerate(shape):
            j = off + i
            if n == 1 and full_shape[j] != 1:
                out.append("1")
            elif head is not None and j == head:
                out.append("h" if kv else "(h r)")
            else:
                out.append(full_names[j])
        return out

    q = dims(lq, names, lead, False) + [l_, "e^"]
    k = dims(lk, names, lead, True) + ["s^", "e^"]
    v = dims(lv, names, lead, True) + ["s^", "f"]
    if is_tensor(attn_mask):
        mask = tensor_str(dims(tuple(attn_mask.shape), [*names, l_, "s^"], [*lead, L, S], False))
    else:
        mask = "?"
    out = dims(tuple(lead), names, lead, False) + [l_, "f"]
    return f"{tensor_str(q)}, {tensor_str(k)}, {tensor_str(v)}, {mask} -> {tensor_str(out)}"


def gen_sdpa(rng: random.Random) -> tuple[tuple, dict]:
    b = rng.choice((1, 2))
    hk = rng.choice((1, 2))
    gqa = rng.random() < 0.4
    hq = hk * rng.choice((2, 3)) if gqa else hk
    L, S = rng.choice((1, 2, 4, 6)), rng.choice((2, 3, 4))
    e, ev = rng.choice((2, 4)), rng.choice((2, 4, 6))
    heads = rng.random() < 0.85 or gqa
    lq = (b, hq) if heads else (b,)
    lk = (b, hk) if heads else (b,)
    if rng.random() < 0.15 and not gqa:
        lk = (1, *lk[1:])  # the keys broadcast over the batch
    q, k, v = f64(rng, *lq, L, e), f64(rng, *lk, S, e), f64(rng, *lk, S, ev)
    kw: dict[str, Any] = {}
    if gqa:
        kw["enable_gqa"] = True
    r = rng.random()
    if r < 0.3:
        kw["is_causal"] = True
    elif r < 0.7:
        shape = rng.choice([(L, S), (1, L, S), (b, 1, L, S), (b, hq, L, S), (1, hq, 1, S)])
        shape = shape[len(shape) - min(len(shape), len(lq) + 2) :]
        if rng.random() < 0.5:
            mask = randint(rng, 0, 5, *shape) > 0
            mask[..., 0] = True  # no row fully masked
        else:
            mask = f64(rng, *shape)
        kw["attn_mask"] = mask
    if rng.random() < 0.3:
        kw["scale"] = 0.5
    if rng.random() < 0.2:
        kw["dropout_p"] = 0.0
    if rng.random() < 0.3:
        return (q, k, v, kw.pop("attn_mask", None)), kw
    return (q, k, v), kw


def register(registry: OpRegistry) -> None:
    registry.register(
        F.scaled_dot_product_attention, sdpa_anno,
        name="torch.nn.functional.scaled_dot_product_attention", input_gen_fn=gen_sdpa,
        transform_rules=sequence_rules,
    )
