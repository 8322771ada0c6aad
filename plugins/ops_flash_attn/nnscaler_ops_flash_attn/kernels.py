"""The raw operators: flash-attn's signatures, dispatching to flash-attn or the fallback.

These are the callables registered as nnscaler ops (generated code calls them). Models
call the recording wrappers of the same names exported by :mod:`nnscaler_ops_flash_attn`,
which a running tracer records as one op each.

Dispatch: when the ``flash_attn`` package imports *and* the query tensor is on CUDA, the
call goes to ``flash_attn`` with the same arguments; otherwise to
:mod:`nnscaler_ops_flash_attn.fallback`. Both paths first check the shapes
(:mod:`nnscaler_ops_flash_attn.checks`).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any, Union

import torch

from nnscaler_ops_flash_attn import checks, fallback

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


def _options(
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    return_attn_probs: bool,
) -> dict[str, Any]:
    options: dict[str, Any] = {
        "dropout_p": dropout_p,
        "softmax_scale": softmax_scale,
        "causal": causal,
        "window_size": window_size,
        "alibi_slopes": alibi_slopes,
        "deterministic": deterministic,
        "return_attn_probs": return_attn_probs,
    }
    if softcap:  # flash-attn releases before 2.6 have no softcap argument
        options["softcap"] = softcap
    return options


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
    fn = "flash_attn_func"
    checks.check_dense(fn, q, k, v, dropout_p, softmax_scale, window_size, softcap, alibi_slopes)
    fa = _use_flash_attn(q)
    if fa is not None:
        return fa.flash_attn_func(
            q,
            k,
            v,
            **_options(
                dropout_p,
                softmax_scale,
                causal,
                tuple(window_size),
                softcap,
                alibi_slopes,
                deterministic,
                return_attn_probs,
            ),
        )
    return fallback.attention(
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs,
        fn=fn,
    )


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
    checks.check_varlen(
        fn,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        dropout_p,
        softmax_scale,
        window_size,
        softcap,
        alibi_slopes,
        block_table,
    )
    fa = _use_flash_attn(q)
    if fa is not None:
        options = _options(
            dropout_p,
            softmax_scale,
            causal,
            tuple(window_size),
            softcap,
            alibi_slopes,
            deterministic,
            return_attn_probs,
        )
        if block_table is not None:
            options["block_table"] = block_table
        return fa.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options
        )
    return fallback.varlen_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
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
    """:func:`flash_attn_func` with ``qkv (batch, seqlen, 3, nheads, headdim)`` stacked."""
    fn = "flash_attn_qkvpacked_func"
    q, k, v = checks.split_packed(fn, qkv, "qkv", 3, "(batch, seqlen, 3, nheads, headdim)")
    checks.check_dense(fn, q, k, v, dropout_p, softmax_scale, window_size, softcap, alibi_slopes)
    fa = _use_flash_attn(qkv)
    if fa is not None:
        return fa.flash_attn_qkvpacked_func(
            qkv,
            **_options(
                dropout_p,
                softmax_scale,
                causal,
                tuple(window_size),
                softcap,
                alibi_slopes,
                deterministic,
                return_attn_probs,
            ),
        )
    return fallback.attention(
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs,
        fn=fn,
    )


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
    """:func:`flash_attn_func` with ``kv (batch, seqlen_k, 2, nheads_k, headdim)`` stacked."""
    fn = "flash_attn_kvpacked_func"
    k, v = checks.split_packed(fn, kv, "kv", 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    checks.check_dense(fn, q, k, v, dropout_p, softmax_scale, window_size, softcap, alibi_slopes)
    fa = _use_flash_attn(q)
    if fa is not None:
        return fa.flash_attn_kvpacked_func(
            q,
            kv,
            **_options(
                dropout_p,
                softmax_scale,
                causal,
                tuple(window_size),
                softcap,
                alibi_slopes,
                deterministic,
                return_attn_probs,
            ),
        )
    return fallback.attention(
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs,
        fn=fn,
    )
