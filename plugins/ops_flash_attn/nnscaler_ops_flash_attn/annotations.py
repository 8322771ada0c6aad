"""Dim annotations of the flash-attn ops, and random calls to check them with.

What may be split: the batch dim and the heads, nothing else. The sequence dims carry a
softmax (a split would need a different algorithm, e.g. ring attention) and the head dim
is contracted by ``q k^T`` under a nonlinearity, so both are ``^``.

Heads under MQA/GQA. Query head ``i`` attends to key/value head ``i // r`` where
``r = nheads_q // nheads_k``, so the query heads are ``nheads_k`` consecutive groups of
``r``. The annotation names the query heads dim as the hidden group ``(h r^)`` where ``h``
is the key/value heads dim: splitting ``h`` into ``n`` parts gives each part
``nheads_k / n`` key/value heads and exactly their ``r * nheads_k / n`` query heads, so
every part is itself a valid GQA call. Special cases: equal head counts are plain ``h``;
MQA (one key/value head) names the query heads ``h`` and the key/value heads ``1``, so
the query heads split freely while ``k`` and ``v`` are replicated.

``alibi_slopes`` and the options before it are positional parameters of flash-attn's
signatures, so a call with slopes annotates the options as ``?`` (taken whole) and the
slopes with the heads (``(nheads,)``) or with batch and heads (``(batch, nheads)``).

``return_attn_probs=True`` returns flash-attn's softmax statistics and dropout pattern,
whose shapes are rounded internally: such a call is annotated whole (nothing split).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
import torch

from nnscaler_ops_flash_attn import checks, kernels

#: a random call of an op: ``(args, kwargs)``
Call = tuple[tuple[Any, ...], dict[str, Any]]

_OPTIONS = ("?",) * 5  # dropout_p, softmax_scale, causal, window_size, softcap


def head_dims(nheads_q: int, nheads_k: int) -> tuple[str, str]:
    """How the query heads and the key/value heads are annotated (see the module doc)."""
    if nheads_q == nheads_k:
        return "h", "h"
    if nheads_k == 1:
        return "h", "1"
    return "(h r^)", "h"


def _alibi(alibi_slopes: torch.Tensor | None, qh: str, batch: str) -> list[str]:
    if alibi_slopes is None:
        return []
    slopes = qh if alibi_slopes.dim() == 1 else f"{batch} {qh}"
    return [*_OPTIONS, slopes]


def _join(inputs: list[str], outputs: list[str]) -> str:
    return f"{', '.join(inputs)} -> {', '.join(outputs)}"


def _dense_annotation(
    fn: str,
    tensors: tuple[torch.Tensor, ...],
    q_kv: list[str],
    options: checks.Options,
    return_attn_probs: bool,
) -> str:
    """Check a dense call (`checks.check_dense_call`) and annotate it; ``q_kv``:
    templates of its tensors with ``{b} {s} {t} {qh} {kh} {d}`` fields."""
    _, shapes = checks.check_dense_call(fn, tensors, options)
    nheads_q, nheads_k, alibi_slopes = shapes.nheads_q, shapes.nheads_k, options.alibi_slopes
    if return_attn_probs:
        fields = {"b": "b^", "s": "s^", "t": "t^", "qh": "h^", "kh": "g^", "d": "d^"}
        if nheads_k == 1:
            fields["kh"] = "1"
        inputs = [t.format(**fields) for t in q_kv] + _alibi(alibi_slopes, "h^", "b^")
        return _join(inputs, ["b^ s^ h^ d^", "?", "?"])
    qh, kh = head_dims(nheads_q, nheads_k)
    fields = {"b": "b", "s": "s^", "t": "t^", "qh": qh, "kh": kh, "d": "d^"}
    inputs = [t.format(**fields) for t in q_kv] + _alibi(alibi_slopes, qh, "b")
    return _join(inputs, [f"b s^ {qh} d^"])


def flash_attn_func_annotation(
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
) -> str:
    """E.g. ``b s^ (h r^) d^, b t^ h d^, b t^ h d^ -> b s^ (h r^) d^`` (GQA)."""
    options = checks.Options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    templates = ["{b} {s} {qh} {d}", "{b} {t} {kh} {d}", "{b} {t} {kh} {d}"]
    return _dense_annotation("flash_attn_func", (q, k, v), templates, options, return_attn_probs)


def flash_attn_kvpacked_func_annotation(
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
) -> str:
    """E.g. ``b s^ (h r^) d^, b t^ 2 h d^ -> b s^ (h r^) d^`` (GQA)."""
    options = checks.Options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    templates = ["{b} {s} {qh} {d}", "{b} {t} 2 {kh} {d}"]
    return _dense_annotation(
        "flash_attn_kvpacked_func", (q, kv), templates, options, return_attn_probs
    )


def flash_attn_qkvpacked_func_annotation(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> str:
    """E.g. ``b s^ 3 h d^ -> b s^ h d^``."""
    options = checks.Options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    templates = ["{b} {s} 3 {qh} {d}"]
    return _dense_annotation(
        "flash_attn_qkvpacked_func", (qkv,), templates, options, return_attn_probs
    )


def flash_attn_varlen_func_annotation(
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
) -> str:
    """E.g. ``u^ (h r^) d^, w^ h d^, w^ h d^, ?, ?, ?, ? -> u^ (h r^) d^`` (GQA).

    The packed token dims (``u`` for queries, ``w`` for keys) are never split and the
    ``cu_seqlens`` are taken whole: only the heads split.
    """
    options = checks.Options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    shapes = checks.check_varlen(
        "flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, options, block_table
    )
    kv_tokens = "w^ p^" if shapes.paged else "w^"
    if return_attn_probs:
        qh, kh = "h^", ("1" if shapes.nheads_k == 1 else "g^")
    else:
        qh, kh = head_dims(shapes.nheads_q, shapes.nheads_k)
    inputs = [f"u^ {qh} d^", f"{kv_tokens} {kh} d^", f"{kv_tokens} {kh} d^", "?", "?", "?", "?"]
    inputs += _alibi(alibi_slopes, qh, "n^")
    outputs = [f"u^ {qh} d^"] + (["?", "?"] if return_attn_probs else [])
    return _join(inputs, outputs)


def flash_attn_segmented_func_annotation(
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
) -> str:
    """E.g. ``b s^ (h r^) d^, b s^ h d^, b s^ h d^, b s^ -> b s^ (h r^) d^`` (GQA).

    Sequences never cross rows, so the batch splits with its ``segment_ids``; the heads
    split as in `flash_attn_func_annotation`, with ``segment_ids`` replicated.
    """
    options = checks.Options(dropout_p, softmax_scale, causal, window_size, softcap)
    shapes = checks.check_segmented("flash_attn_segmented_func", q, k, v, segment_ids, options)
    qh, kh = head_dims(shapes.nheads_q, shapes.nheads_k)
    return _join([f"b s^ {qh} d^", f"b s^ {kh} d^", f"b s^ {kh} d^", "b s^"], [f"b s^ {qh} d^"])


# ---------------------------------------------------------------------------------------
# Random calls (``input_gen_fn``): small shapes, with heads and batch that can be split
# ---------------------------------------------------------------------------------------


def _randn(rng: random.Random, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(torch.float32)


def _draw_options(rng: random.Random) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if rng.random() < 0.5:
        options["causal"] = True
    window = rng.choice([(-1, -1), (-1, -1), (1, -1), (2, 0), (-1, 1), (0, 2)])
    if window != (-1, -1):
        options["window_size"] = window
    if rng.random() < 0.3:
        options["softcap"] = rng.choice([0.5, 5.0])
    if rng.random() < 0.3:
        options["softmax_scale"] = rng.choice([0.25, 1.0])
    return options


def _draw_heads(rng: random.Random) -> tuple[int, int]:
    nheads_k = rng.choice([1, 2, 4])
    return nheads_k * rng.choice([1, 2, 3]), nheads_k


def _draw_alibi(rng: random.Random, nheads_q: int, batch: int) -> torch.Tensor | None:
    kind = rng.choice(["none", "none", "heads", "batch_heads"])
    if kind == "none":
        return None
    shape = (nheads_q,) if kind == "heads" else (batch, nheads_q)
    return _randn(rng, *shape).abs()


def gen_flash_attn_func(rng: random.Random) -> Call:
    """A random ``flash_attn_func`` call (GQA/MQA, causal with ``seqlen_q != seqlen_k``...)."""
    batch = rng.choice([1, 2, 4])
    seqlen_q, seqlen_k = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3, 5])
    nheads_q, nheads_k = _draw_heads(rng)
    headdim = rng.choice([2, 4, 8])
    q = _randn(rng, batch, seqlen_q, nheads_q, headdim)
    k = _randn(rng, batch, seqlen_k, nheads_k, headdim)
    v = _randn(rng, batch, seqlen_k, nheads_k, headdim)
    options = _draw_options(rng)
    slopes = _draw_alibi(rng, nheads_q, batch)
    if slopes is not None:
        options["alibi_slopes"] = slopes
    return (q, k, v), options


def gen_flash_attn_kvpacked_func(rng: random.Random) -> Call:
    (q, k, v), options = gen_flash_attn_func(rng)
    return (q, torch.stack([k, v], dim=2)), options


def gen_flash_attn_qkvpacked_func(rng: random.Random) -> Call:
    batch = rng.choice([1, 2, 4])
    seqlen, nheads, headdim = (
        rng.choice([1, 2, 3, 5]),
        rng.choice([1, 2, 4, 6]),
        rng.choice([2, 4, 8]),
    )
    qkv = _randn(rng, batch, seqlen, 3, nheads, headdim)
    options = _draw_options(rng)
    slopes = _draw_alibi(rng, nheads, batch)
    if slopes is not None:
        options["alibi_slopes"] = slopes
    return (qkv,), options


def _offsets(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def gen_flash_attn_varlen_func(rng: random.Random) -> Call:
    """A random ``flash_attn_varlen_func`` call: 1-3 sequences of different lengths."""
    nseqs = rng.randint(1, 3)
    lens_q = [rng.randint(1, 5) for _ in range(nseqs)]
    lens_k = [rng.randint(1, 5) for _ in range(nseqs)]
    nheads_q, nheads_k = _draw_heads(rng)
    headdim = rng.choice([2, 4, 8])
    q = _randn(rng, sum(lens_q), nheads_q, headdim)
    k = _randn(rng, sum(lens_k), nheads_k, headdim)
    v = _randn(rng, sum(lens_k), nheads_k, headdim)
    args = (q, k, v, _offsets(lens_q), _offsets(lens_k), max(lens_q), max(lens_k))
    options = _draw_options(rng)
    slopes = _draw_alibi(rng, nheads_q, nseqs)
    if slopes is not None:
        options["alibi_slopes"] = slopes
    return args, options


def _segment_row(rng: random.Random, seqlen: int, window: bool) -> list[int]:
    """One row of segment ids: left or right padding, or packed sequences (see
    `nnscaler_ops_flash_attn.segments` for the rules a row keeps)."""
    kind = rng.choice(["plain", "left", "right", "packed", "packed_padded", "all_padding"])
    if kind == "plain":
        return [rng.randint(1, 3)] * seqlen
    if kind == "all_padding":
        return [0] * seqlen
    pad = rng.randint(1, seqlen - 1) if seqlen > 1 else 0
    if kind in ("left", "right"):
        real = [1] * (seqlen - pad)
        return [0] * pad + real if kind == "left" else real + [0] * pad
    ids, current = [], 0
    body = seqlen - (pad if kind == "packed_padded" else 0)
    while len(ids) < body:
        current += 1
        ids += [current] * rng.randint(1, 3)
    ids = ids[:body]
    if kind == "packed_padded":
        ids += [0] * pad
        if not window and pad and rng.random() < 0.5:  # padding between two sequences
            ids = ids[:1] + [0] + ids[1:-1]
    return ids


def gen_flash_attn_segmented_func(rng: random.Random) -> Call:
    """A random padded or packed batch (rows of every kind, GQA/MQA, windows, softcap)."""
    batch = rng.choice([1, 2, 4])
    seqlen = rng.choice([1, 3, 5, 6])
    nheads_q, nheads_k = _draw_heads(rng)
    headdim = rng.choice([2, 4, 8])
    q = _randn(rng, batch, seqlen, nheads_q, headdim)
    k = _randn(rng, batch, seqlen, nheads_k, headdim)
    v = _randn(rng, batch, seqlen, nheads_k, headdim)
    options = _draw_options(rng)
    window = options.get("window_size", (-1, -1)) != (-1, -1)
    rows = [_segment_row(rng, seqlen, window) for _ in range(batch)]
    return (q, k, v, torch.tensor(rows, dtype=torch.int32)), options


# ---------------------------------------------------------------------------------------
# The op table
# ---------------------------------------------------------------------------------------


@attrs.frozen
class OpSpec:
    """One op of this plugin: its registered name, raw callable, annotation, inputs."""

    name: str
    fn: Callable[..., Any]
    annotation: Callable[..., str]
    input_gen_fn: Callable[[random.Random], Call]


OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "flash_attn.flash_attn_func",
        kernels.flash_attn_func,
        flash_attn_func_annotation,
        gen_flash_attn_func,
    ),
    OpSpec(
        "flash_attn.flash_attn_varlen_func",
        kernels.flash_attn_varlen_func,
        flash_attn_varlen_func_annotation,
        gen_flash_attn_varlen_func,
    ),
    OpSpec(
        "flash_attn.flash_attn_qkvpacked_func",
        kernels.flash_attn_qkvpacked_func,
        flash_attn_qkvpacked_func_annotation,
        gen_flash_attn_qkvpacked_func,
    ),
    OpSpec(
        "flash_attn.flash_attn_kvpacked_func",
        kernels.flash_attn_kvpacked_func,
        flash_attn_kvpacked_func_annotation,
        gen_flash_attn_kvpacked_func,
    ),
    OpSpec(
        "flash_attn.flash_attn_segmented_func",
        kernels.flash_attn_segmented_func,
        flash_attn_segmented_func_annotation,
        gen_flash_attn_segmented_func,
    ),
)

#: op name by the name of the public function
OP_NAMES: dict[str, str] = {spec.fn.__name__: spec.name for spec in OPS}
