"""The raw operators: flash-attn's signatures, dispatching to flash-attn or the fallback.

These are the callables registered as nnscaler ops (generated code calls them). Models
call the recording wrappers of the same names exported by `nnscaler_ops_flash_attn`,
which a running tracer records as one op each.

Dispatch: when the ``flash_attn`` package imports *and* the query tensor is on CUDA, the
call goes to ``flash_attn`` with the same arguments; otherwise to
`nnscaler_ops_flash_attn.fallback`. Both paths first check the shapes
(`nnscaler_ops_flash_attn.checks`).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any, Union

import torch

from nnscaler_ops_flash_attn import checks, fallback, segments

#: the output, or ``(out, softmax_lse, S_dmask)`` with ``return_attn_probs=True`` (flash-attn)
Result = Union[torch.Tensor, tuple[torch.Tensor, ...]]


@functools.cache
def _flash_attn_module() -> ModuleType | None:
    try:
        return importlib.import_module("flash_attn")
    except ImportError:
        return None


def flash_attn_available() -> bool:
    """Whether the ``flash_attn`` package can be imported (CUDA calls then use it)."""
    return _flash_attn_module() is not None


def _use_flash_attn(q: torch.Tensor) -> ModuleType | None:
    if not q.is_cuda:
        return None
    return _flash_attn_module()


def _flash_attn_kwargs(
    options: checks.Options, deterministic: bool, return_attn_probs: bool
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "dropout_p": options.dropout_p,
        "softmax_scale": options.softmax_scale,
        "causal": options.causal,
        "window_size": tuple(options.window_size),
        "alibi_slopes": options.alibi_slopes,
        "deterministic": deterministic,
        "return_attn_probs": return_attn_probs,
    }
    if options.softcap:  # flash-attn releases before 2.6 have no softcap argument
        kwargs["softcap"] = options.softcap
    return kwargs


def _dense(
    fn: str,
    tensors: tuple[torch.Tensor, ...],
    options: checks.Options,
    deterministic: bool,
    return_attn_probs: bool,
) -> Result:
    """Check, then run ``flash_attn.<fn>(*tensors, ...)`` or the fallback on the unpacked
    ``q, k, v`` (``tensors``: ``(q, k, v)``, ``(q, kv)`` or ``(qkv,)``)."""
    (q, k, v), _ = checks.check_dense_call(fn, tensors, options)
    if q.device.type == "meta" and not return_attn_probs:  # a trace on meta: the shape
        return q.new_empty(*q.shape[:3], v.shape[-1])
    fa = _use_flash_attn(tensors[0])
    if fa is not None:
        kwargs = _flash_attn_kwargs(options, deterministic, return_attn_probs)
        return getattr(fa, fn)(*tensors, **kwargs)
    return fallback.attention(q, k, v, options, return_attn_probs=return_attn_probs, fn=fn)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Result:
    """Attention over ``q (batch, seqlen_q, nheads, headdim)`` and ``k``, ``v``
    ``(batch, seqlen_k, nheads_k, headdim)``; returns ``(batch, seqlen_q, nheads, headdim)``.

    Same arguments and semantics as ``flash_attn.flash_attn_func``: MQA/GQA when
    ``nheads_k`` divides ``nheads``; ``causal`` aligned to the bottom-right corner;
    ``window_size=(left, right)`` local attention; ``softcap``; ``alibi_slopes`` of shape
    ``(nheads,)`` or ``(batch, nheads)``. ``deterministic`` only matters to flash-attn's
    backward. ``return_attn_probs=True`` needs flash-attn on CUDA.
    """
    options = checks.Options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    return _dense("flash_attn_func", (q, k, v), options, deterministic, return_attn_probs)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> Result:
    """Attention over packed sequences: ``q (total_q, nheads, headdim)``, ``k``, ``v``
    ``(total_k, nheads_k, headdim)``; sequence ``n`` is rows
    ``cu_seqlens_q[n]:cu_seqlens_q[n + 1]`` of ``q`` and ``cu_seqlens_k[n]:cu_seqlens_k[n + 1]``
    of ``k``/``v``. Returns ``(total_q, nheads, headdim)``.

    Same arguments and semantics as ``flash_attn.flash_attn_varlen_func`` (causal and
    windows aligned per sequence; ``alibi_slopes`` ``(nheads,)`` or ``(nseqs, nheads)``).
    ``block_table`` (paged k/v) and ``return_attn_probs=True`` need flash-attn on CUDA.
    """
    fn = "flash_attn_varlen_func"
    options = checks.Options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    checks.check_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, options, block_table)
    if q.device.type == "meta" and not return_attn_probs:  # a trace on meta: the shape
        return q.new_empty(*q.shape[:2], v.shape[-1])
    fa = _use_flash_attn(q)
    if fa is not None:
        kwargs = _flash_attn_kwargs(options, deterministic, return_attn_probs)
        if block_table is not None:
            kwargs["block_table"] = block_table
        return fa.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs
        )
    return fallback.varlen_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        options,
        return_attn_probs=return_attn_probs,
        block_table=block_table,
        fn=fn,
    )


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Result:
    """`flash_attn_func` with ``qkv (batch, seqlen, 3, nheads, headdim)`` stacked."""
    options = checks.Options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    return _dense("flash_attn_qkvpacked_func", (qkv,), options, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Result:
    """`flash_attn_func` with ``kv (batch, seqlen_k, 2, nheads_k, headdim)`` stacked."""
    options = checks.Options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    return _dense("flash_attn_kvpacked_func", (q, kv), options, deterministic, return_attn_probs)


def flash_attn_segmented_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
) -> torch.Tensor:
    """Attention over a padded or packed batch in the dense layout: ``q (batch, seqlen,
    nheads, headdim)``, ``k``, ``v`` ``(batch, seqlen, nheads_k, headdim)``, and
    ``segment_ids (batch, seqlen)`` (integers or bools).

    Token ``i`` sees token ``j`` of its row when both have the same nonzero id, and
    ``causal`` / ``window_size`` allow it (counted in positions of the row); 0 marks
    padding, whose output rows are zero. A batch whose rows are each one id with no padding
    is one `flash_attn_func` call; otherwise the tokens that are not padding are
    gathered into flash-attn's packed layout, run by `flash_attn_varlen_func`, and
    put back (`nnscaler_ops_flash_attn.segments` states when that is exact, and
    raises where it is not). The other options are `flash_attn_func`'s.
    """
    fn = "flash_attn_segmented_func"
    options = checks.Options(dropout_p, softmax_scale, causal, window_size, softcap)
    checks.check_segmented(fn, q, k, v, segment_ids, options)
    if q.device.type == "meta":  # a trace on meta: the shape
        return torch.empty_like(q)
    windowed = any(int(w) >= 0 for w in window_size)
    where = segments.plan(fn, segment_ids, windowed)
    if where.dense:
        return _dense("flash_attn_func", (q, k, v), options, deterministic, False)
    batch, seqlen, nheads, headdim = q.shape
    out = q.new_zeros(batch * seqlen, nheads, headdim)
    if not where.index.numel():  # every token is padding
        return out.view(batch, seqlen, nheads, headdim)

    def gather(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch * seqlen, *x.shape[2:]).index_select(0, where.index)

    packed = flash_attn_varlen_func(
        gather(q),
        gather(k),
        gather(v),
        where.cu_seqlens,
        where.cu_seqlens,
        where.max_seqlen,
        where.max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        None,
        deterministic,
    )
    return out.index_copy(0, where.index, packed).view(batch, seqlen, nheads, headdim)
