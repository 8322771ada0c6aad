"""Attention with flash-attn's semantics, in plain PyTorch (any device, any float dtype).

Used when flash-attn is not installed or the tensors are not on CUDA. The semantics are
flash-attn's, as its documentation states them:

- layout ``(batch, seqlen, nheads, headdim)``; query head ``i`` attends to key/value
  head ``i // (nheads_q // nheads_k)`` (MQA/GQA);
- ``causal=True`` aligns the causal mask to the *bottom-right* corner of the
  ``seqlen_q x seqlen_k`` score matrix: query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q``;
- ``window_size=(left, right)``: query ``i`` sees keys ``j`` in
  ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``, ``-1`` meaning
  unbounded on that side; ``causal`` sets ``right`` to 0;
- ``softcap > 0``: scores become ``softcap * tanh(scores / softcap)`` (after scaling);
- ``alibi_slopes``: ``-slope * |i + seqlen_k - seqlen_q - j|`` is added to the scores;
- a query row that sees no key at all yields zeros.

The common case runs `torch.nn.functional.scaled_dot_product_attention`; softcap
needs the scores themselves, so it takes an explicit softmax path.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from nnscaler_ops_flash_attn.checks import Options

#: ``scaled_dot_product_attention(enable_gqa=...)`` appeared in torch 2.5
_SDPA_HAS_GQA = torch.__version__ >= (2, 5)  # type: ignore[operator]


def _not_implemented(fn: str, argument: str, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"{fn}: {argument} is not supported by the PyTorch fallback ({why}). The fallback runs "
        f"when flash-attn is not installed or the tensors are not on CUDA; install "
        f"`nnscaler-ops-flash-attn[cuda]` and run on a CUDA device to use it."
    )


def allowed_keys(
    seqlen_q: int,
    seqlen_k: int,
    window: tuple[int, int],
    device: torch.device,
) -> torch.Tensor | None:
    """``(seqlen_q, seqlen_k)`` bool mask of the keys each query sees, or None for all."""
    left, right = window
    if left < 0 and right < 0:
        return None
    i = torch.arange(seqlen_q, device=device).unsqueeze(1) + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def alibi_bias(
    slopes: torch.Tensor, seqlen_q: int, seqlen_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """``-slope * |i + seqlen_k - seqlen_q - j|`` as ``(batch or 1, nheads, seqlen_q, seqlen_k)``."""
    i = torch.arange(seqlen_q, device=slopes.device).unsqueeze(1) + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=slopes.device).unsqueeze(0)
    work = torch.promote_types(dtype, torch.float32)
    distance = (i - j).abs().to(work)
    s = slopes.to(work)
    s = s.view(1, -1, 1, 1) if s.dim() == 1 else s.view(s.shape[0], s.shape[1], 1, 1)
    return (-s * distance).to(dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: Options = Options(),
    *,
    return_attn_probs: bool = False,
    fn: str = "flash_attn_func",
) -> torch.Tensor:
    """Dense attention, ``q (b, sq, hq, d)``, ``k``/``v`` ``(b, sk, hk, d)`` -> ``(b, sq, hq, d)``.

    The caller has checked the shapes (`nnscaler_ops_flash_attn.checks.check_dense`).
    """
    if return_attn_probs:
        raise _not_implemented(
            fn,
            "return_attn_probs=True",
            "it returns flash-attn's internal softmax statistics and dropout pattern",
        )
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    softmax_scale, causal, softcap = options.softmax_scale, options.causal, options.softcap
    alibi_slopes, dropout_p = options.alibi_slopes, options.dropout_p
    scale = float(softmax_scale) if softmax_scale is not None else d**-0.5
    window = (int(options.window_size[0]), 0 if causal else int(options.window_size[1]))
    if sk == 0 or sq == 0:  # nothing to attend to: flash-attn returns zeros
        return q.new_zeros(b, sq, hq, v.shape[-1])

    keep = allowed_keys(sq, sk, window, q.device)
    empty_rows = None
    if keep is not None:
        row_sees_nothing = ~keep.any(dim=-1)
        if bool(row_sees_nothing.any()):
            # Let those rows see everything (no NaN, in forward or backward), zero them below.
            keep = keep | row_sees_nothing.unsqueeze(1)
            empty_rows = row_sees_nothing
    bias = None
    if alibi_slopes is not None:
        work_dtype = (
            torch.float32 if softcap > 0 and q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        )
        bias = alibi_bias(alibi_slopes, sq, sk, work_dtype)

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # b h s d
    if softcap > 0:
        out = _explicit(qt, kt, vt, scale, float(softcap), keep, bias, float(dropout_p))
    else:
        out = _sdpa(qt, kt, vt, scale, causal, window, keep, bias, float(dropout_p))
    out = out.transpose(1, 2)
    if empty_rows is not None:
        out = out.masked_fill(empty_rows.view(1, sq, 1, 1), 0.0)
    return out.contiguous()


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window: tuple[int, int],
    keep: torch.Tensor | None,
    bias: torch.Tensor | None,
    dropout_p: float,
) -> torch.Tensor:
    sq, sk = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    is_causal = False
    mask: torch.Tensor | None = None
    if bias is None and causal and sq == sk and window[0] < 0:
        is_causal = True  # top-left and bottom-right alignment agree on a square matrix
    elif bias is None:
        mask = keep
    else:
        mask = bias if keep is None else bias.masked_fill(~keep, float("-inf"))
    extra = {}
    if groups > 1:
        if _SDPA_HAS_GQA:
            extra["enable_gqa"] = True
        else:
            k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
    )


def _explicit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float,
    keep: torch.Tensor | None,
    bias: torch.Tensor | None,
    dropout_p: float,
) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    dtype = q.dtype
    # half precision: scores and softmax in float32, as flash-attn accumulates
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    scores = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.to(work)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, v.to(work)).to(dtype)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    options: Options = Options(),
    *,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    fn: str = "flash_attn_varlen_func",
) -> torch.Tensor:
    """Packed attention: one `attention` per sequence given by the cu_seqlens.

    Query rows past ``cu_seqlens_q[-1]`` (padding) are zero.
    """
    if block_table is not None:
        raise _not_implemented(fn, "block_table", "paged key/value caches need flash-attn")
    if return_attn_probs:
        raise _not_implemented(
            fn,
            "return_attn_probs=True",
            "it returns flash-attn's internal softmax statistics and dropout pattern",
        )
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    _check_offsets(fn, "cu_seqlens_q", cq, q.shape[0], "max_seqlen_q", max_seqlen_q)
    _check_offsets(fn, "cu_seqlens_k", ck, k.shape[0], "max_seqlen_k", max_seqlen_k)
    parts = []
    if cq[0] > 0:
        parts.append(q.new_zeros(cq[0], q.shape[1], v.shape[-1]))
    for n in range(len(cq) - 1):
        qs = q[cq[n] : cq[n + 1]].unsqueeze(0)
        ks = k[ck[n] : ck[n + 1]].unsqueeze(0)
        vs = v[ck[n] : ck[n + 1]].unsqueeze(0)
        slopes = options.alibi_slopes
        if slopes is not None and slopes.dim() != 1:  # (nseqs, nheads): this sequence's
            slopes = slopes[n]
        out = attention(qs, ks, vs, attrs.evolve(options, alibi_slopes=slopes), fn=fn)
        parts.append(out[0])
    if cq[-1] < q.shape[0]:
        parts.append(q.new_zeros(q.shape[0] - cq[-1], q.shape[1], v.shape[-1]))
    if not parts:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    return torch.cat(parts, dim=0)


def _check_offsets(
    fn: str, name: str, cu: list[int], total: int, max_name: str, max_len: int
) -> None:
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    if cu[0] < 0 or any(n < 0 for n in lengths) or cu[-1] > total:
        raise ValueError(
            f"{fn}: {name} must be non-decreasing offsets within [0, {total}] (the packed "
            f"length), got {cu}"
        )
    longest = max(lengths, default=0)
    if longest > max_len:
        raise ValueError(
            f"{fn}: {name} has a sequence of length {longest} but {max_name}={max_len}; "
            f"{max_name} must be at least the longest sequence"
        )
