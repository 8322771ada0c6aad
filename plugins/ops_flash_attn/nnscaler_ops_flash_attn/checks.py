"""Shape checks shared by the kernels and the annotations.

Every public function validates its arguments here before it dispatches (to flash-attn
or to the fallback), so that a bad call fails with a message that names the function,
the argument, the value seen and the rule, whichever backend would have run it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch


@attrs.frozen
class DenseShapes:
    """Sizes of a call in flash-attn's dense layout ``(batch, seqlen, nheads, headdim)``."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads_q: int
    nheads_k: int
    headdim: int


@attrs.frozen
class VarlenShapes:
    """Sizes of a call in flash-attn's packed layout ``(total, nheads, headdim)``."""

    total_q: int
    nheads_q: int
    nheads_k: int
    headdim: int
    nseqs: int
    paged: bool  # k/v given as paged blocks (block_table)


def _require_tensor(fn: str, name: str, x: Any, ndim: int, layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{fn}: {name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}"
        )
    if x.dim() != ndim:
        raise ValueError(f"{fn}: {name} must have {ndim} dims {layout}, got shape {tuple(x.shape)}")
    return x


def check_heads(
    fn: str, nheads_q: int, nheads_k: int, q_name: str = "q", k_name: str = "k/v"
) -> None:
    """The GQA/MQA rule: query heads come in whole groups, one group per key/value head."""
    if nheads_k < 1 or nheads_q < 1:
        raise ValueError(
            f"{fn}: {q_name} has {nheads_q} heads and {k_name} {nheads_k}; both need at least one"
        )
    if nheads_q % nheads_k != 0:
        raise ValueError(
            f"{fn}: {q_name} has {nheads_q} heads and {k_name} has {nheads_k}; the number of "
            f"query heads must be divisible by the number of key/value heads (MQA/GQA: each "
            f"key/value head serves a group of nheads_q // nheads_k consecutive query heads)"
        )


def check_headdims(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    dq, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if dq != dk or dq != dv:
        raise ValueError(
            f"{fn}: head dims differ: q has {dq}, k has {dk}, v has {dv}; flash-attn needs "
            f"one head dim for q, k and v"
        )


def check_dtypes(fn: str, **tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        seen = ", ".join(f"{n}: {d}" for n, d in dtypes.items())
        raise TypeError(f"{fn}: q, k and v must have one dtype, got {seen}")
    if not next(iter(dtypes.values())).is_floating_point:
        raise TypeError(
            f"{fn}: q, k and v must be floating point, got {next(iter(dtypes.values()))}"
        )


@attrs.frozen(eq=False)
class Options:
    """The options every flash-attn function takes after its tensors, in flash-attn's order."""

    dropout_p: Any = 0.0
    softmax_scale: Any = None
    causal: Any = False
    window_size: Any = (-1, -1)
    softcap: Any = 0.0
    alibi_slopes: Any = None


def check_options(fn: str, options: Options) -> tuple[int, int]:
    """Validate the scalar options; returns ``window_size`` as a pair of ints."""
    dropout_p, window_size, softcap = options.dropout_p, options.window_size, options.softcap
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"{fn}: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if (
        not isinstance(window_size, Sequence)
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    ):
        raise ValueError(
            f"{fn}: window_size must be a pair of ints (left, right), -1 meaning unbounded, "
            f"got {window_size!r}"
        )
    if not isinstance(softcap, (int, float)) or float(softcap) < 0.0:
        raise ValueError(f"{fn}: softcap must be a float >= 0 (0 disables it), got {softcap!r}")
    softmax_scale = options.softmax_scale
    if softmax_scale is not None and not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"{fn}: softmax_scale must be a float or None, got {softmax_scale!r}")
    return int(window_size[0]), int(window_size[1])


def check_alibi(fn: str, alibi_slopes: Any, nheads_q: int, batch: int, batch_name: str) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(
            f"{fn}: alibi_slopes must be a tensor or None, got {type(alibi_slopes).__name__}"
        )
    shape = tuple(alibi_slopes.shape)
    if shape not in ((nheads_q,), (batch, nheads_q)):
        raise ValueError(
            f"{fn}: alibi_slopes must have shape (nheads,) = ({nheads_q},) or "
            f"({batch_name}, nheads) = ({batch}, {nheads_q}), got {shape}"
        )


def check_dense(fn: str, q: Any, k: Any, v: Any, options: Options = Options()) -> DenseShapes:
    """Check a ``flash_attn_func`` call; returns its sizes."""
    layout = "(batch, seqlen, nheads, headdim)"
    _require_tensor(fn, "q", q, 4, layout)
    _require_tensor(fn, "k", k, 4, layout)
    _require_tensor(fn, "v", v, 4, layout)
    check_dtypes(fn, q=q, k=k, v=v)
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"{fn}: k and v must agree on (batch, seqlen_k, nheads_k), got k {tuple(k.shape)} "
            f"and v {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(
            f"{fn}: q and k/v must have the same batch size, got q {tuple(q.shape)} and "
            f"k {tuple(k.shape)}"
        )
    check_headdims(fn, q, k, v)
    check_heads(fn, q.shape[2], k.shape[2])
    check_options(fn, options)
    check_alibi(fn, options.alibi_slopes, q.shape[2], q.shape[0], "batch")
    return DenseShapes(
        batch=q.shape[0],
        seqlen_q=q.shape[1],
        seqlen_k=k.shape[1],
        nheads_q=q.shape[2],
        nheads_k=k.shape[2],
        headdim=q.shape[3],
    )


def check_cu_seqlens(fn: str, name: str, cu: Any) -> int:
    """``cu`` is a 1-D integer tensor ``(nseqs + 1,)``; returns ``nseqs``."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1:
        got = tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{fn}: {name} must be a 1-D tensor (nseqs + 1,), got {got}")
    if cu.dtype.is_floating_point or cu.dtype == torch.bool or cu.dtype.is_complex:
        raise TypeError(f"{fn}: {name} must hold integers (torch.int32), got {cu.dtype}")
    return cu.numel() - 1


def check_varlen(
    fn: str,
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    options: Options = Options(),
    block_table: Any = None,
) -> VarlenShapes:
    """Check a ``flash_attn_varlen_func`` call (shapes only; cu_seqlens values are not read)."""
    _require_tensor(fn, "q", q, 3, "(total_q, nheads, headdim)")
    paged = block_table is not None
    kv_layout = (
        "(num_blocks, page_block_size, nheads_k, headdim)"
        if paged
        else "(total_k, nheads_k, headdim)"
    )
    _require_tensor(fn, "k", k, 4 if paged else 3, kv_layout)
    _require_tensor(fn, "v", v, 4 if paged else 3, kv_layout)
    check_dtypes(fn, q=q, k=k, v=v)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"{fn}: k and v must agree on every dim but the head dim, got k {tuple(k.shape)} "
            f"and v {tuple(v.shape)}"
        )
    check_headdims(fn, q, k, v)
    check_heads(fn, q.shape[1], k.shape[-2])
    nq = check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q)
    nk = check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k)
    if nq != nk:
        raise ValueError(
            f"{fn}: cu_seqlens_q describes {nq} sequences and cu_seqlens_k {nk}; they must "
            f"describe the same sequences"
        )
    check_options(fn, options)
    check_alibi(fn, options.alibi_slopes, q.shape[1], nq, "nseqs")
    return VarlenShapes(
        total_q=q.shape[0],
        nheads_q=q.shape[1],
        nheads_k=k.shape[-2],
        headdim=q.shape[-1],
        nseqs=nq,
        paged=paged,
    )


def split_packed(
    fn: str, packed: Any, name: str, count: int, layout: str
) -> tuple[torch.Tensor, ...]:
    """Unbind dim 2 of a packed ``qkv`` (count 3) or ``kv`` (count 2) tensor."""
    _require_tensor(fn, name, packed, 5, layout)
    if packed.shape[2] != count:
        raise ValueError(
            f"{fn}: dim 2 of {name} must have size {count} {layout}, got shape {tuple(packed.shape)}"
        )
    return tuple(packed.unbind(2))


#: the packed tensor of each packed dense function: its name, how many it stacks, its layout
_PACKED = {
    "flash_attn_qkvpacked_func": ("qkv", 3, "(batch, seqlen, 3, nheads, headdim)"),
    "flash_attn_kvpacked_func": ("kv", 2, "(batch, seqlen_k, 2, nheads_k, headdim)"),
}


def check_dense_call(
    fn: str, tensors: tuple[Any, ...], options: Options
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], DenseShapes]:
    """Check a dense call whose tensors are ``(q, k, v)``, or ``(q, kv)`` / ``(qkv,)`` for
    the packed functions (by ``fn``); returns ``(q, k, v)`` unpacked, and the sizes."""
    if fn in _PACKED:
        name, count, layout = _PACKED[fn]
        tensors = (*tensors[:-1], *split_packed(fn, tensors[-1], name, count, layout))
    q, k, v = tensors
    return (q, k, v), check_dense(fn, q, k, v, options)


def check_segmented(
    fn: str, q: Any, k: Any, v: Any, segment_ids: Any, options: Options
) -> DenseShapes:
    """Check a ``flash_attn_segmented_func`` call: a dense call with one sequence length
    and ``segment_ids (batch, seqlen)`` of integers or bools (values are read at run time)."""
    shapes = check_dense(fn, q, k, v, options)
    if shapes.seqlen_q != shapes.seqlen_k:
        raise ValueError(
            f"{fn}: q and k/v must have one sequence length (the tokens of a padded or packed "
            f"batch), got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if options.alibi_slopes is not None:
        raise ValueError(f"{fn}: alibi_slopes is not an option of this function")
    want = (shapes.batch, shapes.seqlen_q)
    if not isinstance(segment_ids, torch.Tensor) or tuple(segment_ids.shape) != want:
        got = (
            tuple(segment_ids.shape)
            if isinstance(segment_ids, torch.Tensor)
            else type(segment_ids).__name__
        )
        raise ValueError(f"{fn}: segment_ids must have shape (batch, seqlen) = {want}, got {got}")
    if segment_ids.dtype.is_floating_point or segment_ids.dtype.is_complex:
        raise TypeError(
            f"{fn}: segment_ids must hold integers (0 = padding) or bools, got {segment_ids.dtype}"
        )
    return shapes
