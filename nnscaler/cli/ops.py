"""Training ops the Trainer's examples use, registered with
[`nnscaler.register_op`][nnscaler.register_op].

`chunk_linear_cross_entropy` is the language-model head and its loss in one op:
``cross_entropy(hidden @ weight.T, target)`` computed a chunk of tokens at a time, so
the ``[tokens, vocabulary]`` logits never exist whole (for a 128k vocabulary and 8k
tokens they would take 4 GiB in fp32). Backward recomputes each chunk's logits from the
saved hidden states and the per-token log-normalizer; its gradients are those of the
unchunked form.

A plan can split it two ways:

- **tokens** (the annotation: every dim of ``hidden`` but the last, and ``target``
  alike): with ``reduction='sum'`` a part returns the sum over its tokens and the
  outputs are summed (value-partial); with ``'none'`` each part returns its tokens'
  losses; ``'mean'`` divides by a count of the whole and does not split the tokens;
- **vocabulary** (a transform rule, Megatron's vocabulary-parallel loss): each part holds
  rows ``[vocab_start, vocab_start + V_part)`` of ``weight`` and runs
  `vocab_parallel_chunk_linear_cross_entropy`, which reduces its logits, chunk by
  chunk, to three numbers per token (maximum, sum of exponentials, the target's logit
  where the part holds the target); one all-gather of those gives every part the whole
  loss. In backward each part recomputes its logits chunk by chunk and returns its share
  of ``hidden``'s gradient (summed over the parts like any replicated input's) and its
  rows of ``weight``'s.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from nnscaler.anno import Replicate, Split, TransformRule
from nnscaler.errors import ChunkedLossError
from nnscaler.ops.partgroup import SINGLE
from nnscaler.ops.user_ops import register_op

__all__ = [
    "OP_NAME",
    "ChunkedLossError",
    "chunk_linear_cross_entropy",
    "chunk_linear_cross_entropy_anno",
    "chunk_linear_cross_entropy_fn",
    "vocab_parallel_chunk_linear_cross_entropy",
]

#: The registered op's name: the import path of the function the generated code calls.
OP_NAME = "nnscaler.cli.ops.chunk_linear_cross_entropy_fn"
#: The part op of the vocabulary split.
VOCAB_PARALLEL_OP = "nnscaler.cli.ops.vocab_parallel_chunk_linear_cross_entropy"
_NAMES = "abcefghijklmnopqrstuwxyz"  # no 'd' (the hidden dim) and no 'v' (the vocabulary)


def chunk_linear_cross_entropy_anno(hidden: Any, weight: Any, target: Any,
                                    reduction: str = "mean", ignore_index: int = -100,
                                    chunk_size: int = 1024) -> str:
    """``a b d^, v^ d^, a b -> 1`` with the token dims marked by the reduction."""
    mark = {"sum": "+", "none": ""}.get(reduction, "^")
    tokens = [_NAMES[i] for i in range(hidden.dim() - 1)]
    h = " ".join([t + mark for t in tokens] + ["d^"])
    t = " ".join(t + mark for t in tokens) or "1"
    out = " ".join(tokens) if reduction == "none" and tokens else "1"
    return f"{h}, v^ d^, {t} -> {out}"


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token losses of ``hidden2d @ weight.T`` against ``target1d``, chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                chunk_size: int, ignore_index: int) -> torch.Tensor:
        n = hidden.shape[0]
        stat_dtype = torch.promote_types(hidden.dtype, torch.float32)
        losses = torch.empty(n, dtype=stat_dtype, device=hidden.device)
        lse = torch.empty(n, dtype=stat_dtype, device=hidden.device)
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logits = (hidden[s:e] @ weight.t()).to(stat_dtype)
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[s:e].unsqueeze(1)).squeeze(1)
            losses[s:e] = torch.where(valid[s:e], lse[s:e] - picked, 0.0)
        ctx.save_for_backward(hidden, weight, safe, valid, lse)
        ctx.chunk_size = chunk_size
        return losses

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        hidden, weight, safe, valid, lse = ctx.saved_tensors
        n = hidden.shape[0]
        d_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        scale = torch.where(valid, grad, 0.0)
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            logits = (hidden[s:e] @ weight.t()).to(lse.dtype)
            # d loss / d logits = softmax - onehot(target), times the incoming gradient
            d_logits = torch.exp(logits - lse[s:e].unsqueeze(1))
            d_logits[torch.arange(e - s, device=logits.device), safe[s:e]] -= 1.0
            d_logits = (d_logits * scale[s:e].unsqueeze(1)).to(hidden.dtype)
            if d_hidden is not None:
                d_hidden[s:e] = d_logits @ weight
            if d_weight is not None:
                d_weight += d_logits.t() @ hidden[s:e]
        return d_hidden, d_weight, None, None, None


class _ChunkedLogitStats(torch.autograd.Function):
    """Per token, over this part's vocabulary rows: the maximum logit (no gradient), the
    sum of ``exp(logit - maximum)`` and the target's logit where the part holds the
    target (0 elsewhere); chunk by chunk along the tokens."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, local: torch.Tensor,
                held: torch.Tensor, chunk_size: int) -> torch.Tensor:
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        stats = torch.empty(3, n, dtype=dtype, device=hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logits = (hidden[s:e] @ weight.t()).to(dtype)
            peak = logits.amax(-1)
            stats[0, s:e] = peak
            stats[1, s:e] = torch.exp(logits - peak.unsqueeze(1)).sum(-1)
            picked = logits.gather(1, local[s:e].unsqueeze(1)).squeeze(1)
            stats[2, s:e] = torch.where(held[s:e], picked, 0.0)
        ctx.save_for_backward(hidden, weight, local, held, stats[0].clone())
        ctx.chunk_size = chunk_size
        return stats

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        hidden, weight, local, held, peak = ctx.saved_tensors
        n = hidden.shape[0]
        d_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        g_sum, g_picked = grad[1], torch.where(held, grad[2], 0.0)  # the maximum: a shift
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            logits = (hidden[s:e] @ weight.t()).to(peak.dtype)
            d_logits = torch.exp(logits - peak[s:e].unsqueeze(1)) * g_sum[s:e].unsqueeze(1)
            d_logits[torch.arange(e - s, device=logits.device), local[s:e]] += g_picked[s:e]
            d_logits = d_logits.to(hidden.dtype)
            if d_hidden is not None:
                d_hidden[s:e] = d_logits @ weight
            if d_weight is not None:
                d_weight += d_logits.t() @ hidden[s:e]
        return d_hidden, d_weight, None, None, None


def vocab_parallel_chunk_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
    ignore_index: int = -100, chunk_size: int = 1024, *, vocab_start: int = 0,
    vocab_size: int | None = None, group: Any = SINGLE,
) -> torch.Tensor:
    """`chunk_linear_cross_entropy` on this part's rows of ``weight``
    (``[vocab_start, vocab_start + weight.shape[0])`` of ``vocab_size``), the parts joined
    by ``group`` (a `PartGroup`): every part returns the
    loss over the whole vocabulary."""
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = target.reshape(-1)
    local = flat_t - vocab_start
    held = (local >= 0) & (local < weight.shape[0])
    stats = _ChunkedLogitStats.apply(flat_h, weight, torch.where(held, local, 0), held,
                                     chunk_size)
    every = group.all_gather(stats)  # [parts, 3, tokens]
    peaks = every[:, 0].detach()
    top = peaks.amax(0)
    lse = top + (every[:, 1] * torch.exp(peaks - top)).sum(0).log()
    valid = flat_t != ignore_index
    losses = torch.where(valid, lse - every[:, 2].sum(0), 0.0).to(hidden.dtype)
    if reduction == "none":
        return losses.reshape(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum()


def _vocab_parallel_anno(hidden: Any, weight: Any, target: Any, reduction: str = "mean",
                         ignore_index: int = -100, chunk_size: int = 1024, **_: Any) -> str:
    return chunk_linear_cross_entropy_anno(hidden, weight, target, reduction)


register_op(_vocab_parallel_anno, name=VOCAB_PARALLEL_OP, collective=True)(
    vocab_parallel_chunk_linear_cross_entropy)


def _rules(bound: Any) -> list[TransformRule]:
    """The vocabulary split: ``weight`` split along its rows, ``hidden`` and ``target``
    whole, every part returning the whole loss through the part op above."""
    h, w, t = bound.input_shapes[:3]
    if h is None or w is None or t is None or len(w) != 2:
        return []
    vocab = w[0]

    def modifier(kwargs: dict, idx: int, dim: int, num: int, part: int) -> dict:
        return {**kwargs, "vocab_start": part * (vocab // num), "vocab_size": vocab}

    return [TransformRule(inputs=(Replicate(), Split(0), Replicate()), outputs=(Replicate(),),
                          modifier=modifier, part_op=VOCAB_PARALLEL_OP)]


def _gen(rng: random.Random) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    lead = [rng.choice((2, 4)), rng.choice((2, 6))][: rng.choice((1, 2))]
    d, v = rng.choice((3, 8)), rng.choice((5, 11))
    hidden = torch.randn(*lead, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, tuple(lead), generator=g)
    if rng.random() < 0.3:
        target = target.masked_fill(torch.rand(tuple(lead), generator=g) < 0.3, -100)
    kw = {"reduction": rng.choice(("sum", "none", "mean")), "chunk_size": rng.choice((1, 3, 64))}
    return (hidden, weight, target), kw


def chunk_linear_cross_entropy_fn(hidden: torch.Tensor, weight: torch.Tensor,
                               target: torch.Tensor, reduction: str = "mean",
                               ignore_index: int = -100, chunk_size: int = 1024) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, target)`` without materialising the logits.

    ``hidden``: ``[..., D]``; ``weight``: ``[V, D]`` (the LM head's, no bias);
    ``target``: ``[...]`` class indices (``ignore_index`` ones count for nothing);
    ``reduction``: ``'mean'`` (over the counted tokens), ``'sum'`` or ``'none'``;
    ``chunk_size``: tokens per chunk (peak extra memory ``chunk_size x V``).
    """
    if hidden.shape[:-1] != target.shape:
        raise ChunkedLossError(
            f"chunk_linear_cross_entropy: target must have hidden's shape without the last "
            f"dim, got hidden {tuple(hidden.shape)} and target {tuple(target.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ChunkedLossError(
            f"chunk_linear_cross_entropy: weight must be [vocabulary, {hidden.shape[-1]}] "
            f"(hidden's last dim), got {tuple(weight.shape)}")
    if reduction not in ("mean", "sum", "none"):
        raise ChunkedLossError(f"chunk_linear_cross_entropy: reduction must be 'mean', 'sum' "
                               f"or 'none', got {reduction!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ChunkedLossError(f"chunk_linear_cross_entropy: chunk_size must be a positive "
                               f"int, got {chunk_size!r}")
    flat = _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                            target.reshape(-1), chunk_size, ignore_index)
    flat = flat.to(hidden.dtype)
    if reduction == "none":
        return flat.reshape(target.shape)
    if reduction == "sum":
        return flat.sum()
    return flat.sum() / (target != ignore_index).sum()


#: The op models call (the tracer records each call as one op; the generated code calls
#: `chunk_linear_cross_entropy_fn` itself, the op's name).
chunk_linear_cross_entropy = register_op(
    chunk_linear_cross_entropy_anno, name=OP_NAME, input_gen_fn=_gen, transform_rules=_rules,
)(chunk_linear_cross_entropy_fn)
