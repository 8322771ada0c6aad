"""Hugging Face attention backed by this plugin's operators.

`register_hf_attention` registers the attention ``"nnscaler_fa"`` with transformers'
``AttentionInterface`` and its mask function with ``AttentionMaskInterface``; a model
built with ``attn_implementation="nnscaler_fa"`` then runs every attention layer as one
operator of this plugin, which nnscaler's tracer records whole and whose batch and heads
``tp``/``dp`` can split. The name has no "flash" in it on purpose: transformers treats
every name that contains "flash" as one of its own flash-attention kernels (it imports
``flash_attn`` or looks the name up on the Hub).

What a layer runs, by what the model's mask builder says (the same decisions that
``attn_implementation="sdpa"`` takes, so both compute the same attention):

==============================================  ====================================
the batch                                       operator
==============================================  ====================================
no padding, no packing detected                 ``flash_attn_func``
an ``attention_mask`` (padding; all ones too)   ``flash_attn_segmented_func``
packed sequences (``position_ids`` restarting,  ``flash_attn_segmented_func``
no padding mask)
``cu_seq_lens_q/k`` given (padding-free         ``flash_attn_segmented_func``
collators), batch of 1, no padding mask
==============================================  ====================================

The mask function never reads tensor data: under a trace (where transformers cannot tell
whether ``position_ids`` restart) it turns the model's own mask rule into segment ids with
tensor ops, by asking the rule whether each token sees its neighbour (see
`attention_mask`). What flash attention cannot express is refused with
`UnsupportedAttentionError`: custom mask overlays, 4D masks, a padding mask with a
key/value cache, attention sinks. Two cases show only in the data and are refused by the
operator when the batch runs (a ``ValueError``): a token that sees a later token under a
causal mask, and ``cu_seq_lens_q`` and ``cu_seq_lens_k`` that differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import nnscaler_ops_flash_attn as ops
from nnscaler import NNScalerError

#: the ``attn_implementation`` name that `register_hf_attention` registers
HF_ATTENTION = "nnscaler_fa"

_FIX = "build the model with attn_implementation='sdpa' (or 'eager'), which nnscaler traces too"


class UnsupportedAttentionError(NNScalerError, ValueError):
    """A Hugging Face attention call that ``"nnscaler_fa"`` cannot compute exactly."""


def _refuse(case: str) -> UnsupportedAttentionError:
    return UnsupportedAttentionError(f"attn_implementation={HF_ATTENTION!r}: {case}; {_FIX}")


def register_hf_attention() -> str:
    """Register ``"nnscaler_fa"`` with transformers (attention and mask function); returns
    the name. Call it once per process before building the model; calling it again is
    harmless. Needs transformers 5."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_ATTENTION, attention_forward)
    AttentionMaskInterface.register(HF_ATTENTION, attention_mask)
    return HF_ATTENTION


# ---------------------------------------------------------------------------------------
# The mask function: once per forward, from the model's mask builder
# ---------------------------------------------------------------------------------------


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """What each layer receives as ``attention_mask``: None (nothing to mask), or segment
    ids ``(batch, kv_length)`` for `flash_attn_segmented_func`
    (the bool padding mask, or integers when sequences are packed).

    transformers' mask builders pass ``allow_is_causal_skip=False`` to a causal mask that
    is more than causal (packed sequences, found from ``position_ids`` when there is no
    padding mask and no cache, as ``sdpa`` finds them). Then ``mask_function`` holds the
    rule, and the segments are where it cuts neighbours apart: token ``i`` starts a new
    sequence when it does not see token ``i - 1``. A token that sees token ``i + 1`` is
    not causal: its id is -1, and the operator refuses the batch when it runs.
    """
    if kwargs.get("use_vmap"):
        raise _refuse(
            "the model adds its own rule to the mask (an or/and mask function, e.g. "
            "bidirectional image tokens), which flash attention's sequences cannot express"
        )
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
    bidirectional = "allow_is_bidirectional_skip" in kwargs
    more_than_causal = not bidirectional and not kwargs.get("allow_is_causal_skip", True)
    if not more_than_causal or mask_function is None:
        return attention_mask
    if q_length != kv_length or q_offset or kv_offset:  # decoding with a cache
        return attention_mask
    device = attention_mask.device if attention_mask is not None else kwargs.get("device")
    batch = torch.arange(batch_size, device=device).unsqueeze(1)
    head = torch.zeros((), dtype=torch.long, device=device)
    token = torch.arange(1, q_length, device=device).unsqueeze(0)
    sees_previous = mask_function(batch, head, token, token - 1).expand(batch_size, -1)
    sees_next = mask_function(batch, head, token - 1, token).expand(batch_size, -1)
    starts = torch.cat(
        [torch.ones(batch_size, 1, dtype=torch.bool, device=device), ~sees_previous], dim=1
    )
    segments = starts.to(torch.int32).cumsum(-1, dtype=torch.int32)
    not_causal = torch.cat(
        [sees_next, torch.zeros(batch_size, 1, dtype=torch.bool, device=device)], dim=1
    )
    segments = segments.masked_fill(not_causal, -1)
    if attention_mask is not None:
        segments = segments.masked_fill(~attention_mask.to(torch.bool), 0)
    return segments


# ---------------------------------------------------------------------------------------
# The attention function: once per layer
# ---------------------------------------------------------------------------------------


def _window(sliding_window: int | None, kv_length: int) -> tuple[int, int]:
    """transformers' rule: ``sliding_window`` tokens in all, the query's own included."""
    if sliding_window is None or kv_length <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, sliding_window - 1)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query (batch, nheads, seqlen, headdim)``, ``key``,
    ``value`` ``(batch, nheads_k, kv_length, headdim)``; returns ``(batch, seqlen, nheads,
    headdim)`` and no weights."""
    if kwargs.get("s_aux") is not None:
        raise _refuse("attention sinks (s_aux) are not an option of flash-attn's functions")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if v_head_dim != head_dim:  # e.g. MLA: zeros added to v add zeros to the output
        v = F.pad(v, [0, head_dim - v_head_dim])
    options = {
        "dropout_p": float(dropout),
        "softmax_scale": scaling,
        "causal": causal,
        "window_size": _window(sliding_window, k.shape[1]),
        "softcap": float(softcap or 0.0),
    }
    if attention_mask is not None:
        out = _masked(q, k, v, attention_mask, options)
    elif kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        out = _packed(q, k, v, kwargs, options)
    else:
        out = ops.flash_attn_func(q, k, v, **options)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


def _masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: torch.Tensor,
    options: dict[str, Any],
) -> torch.Tensor:
    batch, seqlen = q.shape[0], q.shape[1]
    if segment_ids.dim() != 2:
        raise _refuse(
            f"a {segment_ids.dim()}D attention mask of shape {tuple(segment_ids.shape)} (built "
            f"by the caller or the model) cannot be expressed; give a 2D padding mask "
            f"(batch, seqlen) instead"
        )
    if k.shape[1] != seqlen or tuple(segment_ids.shape) != (batch, seqlen):
        raise _refuse(
            f"a padding mask of shape {tuple(segment_ids.shape)} with {seqlen} queries and "
            f"{k.shape[1]} keys (decoding with a key/value cache) is not supported; only "
            f"masks over the same tokens as the queries are"
        )
    return ops.flash_attn_segmented_func(q, k, v, segment_ids, **options)


def _packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kwargs: dict[str, Any],
    options: dict[str, Any],
) -> torch.Tensor:
    """Padding-free batches: the sequences of one row given by ``cu_seq_lens_q/k``, turned
    into segment ids with tensor ops (``max_length_q/k`` are not used: as Python ints they
    would be the dummy batch's in a trace; the operator finds the longest at run time)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None:
        given = "cu_seq_lens_q" if cu_q is not None else "cu_seq_lens_k"
        raise _refuse(f"{given} was given without its partner; give both cu_seq_lens_q and _k")
    if q.shape[0] != 1 or k.shape[0] != 1 or q.shape[1] != k.shape[1]:
        raise _refuse(
            f"cu_seq_lens_q/k describe the sequences of a batch of one row whose queries are "
            f"its keys, got queries {tuple(q.shape[:2])} and keys {tuple(k.shape[:2])} "
            f"(batch, seqlen)"
        )
    tokens = torch.arange(q.shape[1], device=q.device)
    ids_q, ids_k = _segment_ids(cu_q, tokens), _segment_ids(cu_k, tokens)
    # the operator's ids serve queries and keys alike: where the two disagree it refuses
    segment_ids = ids_q.masked_fill(ids_q != ids_k, -1).unsqueeze(0)
    return ops.flash_attn_segmented_func(q, k, v, segment_ids, **options)


def _segment_ids(cu_seqlens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Token ``t`` is in sequence ``n`` (id ``n + 1``) when ``cu[n] <= t < cu[n + 1]``;
    tokens outside ``[cu[0], cu[-1])`` are padding (id 0)."""
    cu = cu_seqlens.to(device=tokens.device, dtype=torch.int64)
    ids = torch.searchsorted(cu[1:], tokens, right=True) + 1
    return ids.masked_fill((tokens < cu[0]) | (tokens >= cu[-1]), 0)
