"""Training ops the Trainer's examples use, registered with :func:`nnscaler.register_op`.

:func:`chunk_linear_cross_entropy` is the language-model head and its loss in one op:
``cross_entropy(hidden @ weight.T, target)`` computed a chunk of tokens at a time, so
the ``[tokens, vocabulary]`` logits never exist whole (for a 128k vocabulary and 8k
tokens they would take 4 GiB in fp32). Backward recomputes each chunk's logits from the
saved hidden states and the per-token log-normalizer; its gradients are those of the
unchunked form.

Its annotation lets a plan split the tokens (every dim of ``hidden`` but the last, and
``target`` alike): with ``reduction='sum'`` a part returns the sum over its tokens and
the outputs are summed (value-partial); with ``'none'`` each part returns its tokens'
losses; ``'mean'`` divides by a count of the whole and is not split. The vocabulary is
not split: splitting it needs a collective part op that exchanges the per-token
statistics in the backward as well, which this op does not provide yet.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from nnscaler.errors import NNScalerError
from nnscaler.ops.registry import register_op

__all__ = [
    "OP_NAME",
    "ChunkedLossError",
    "chunk_linear_cross_entropy",
    "chunk_linear_cross_entropy_anno",
    "chunk_linear_cross_entropy_fn",
]

#: The registered op's name: the import path of the function the generated code calls.
OP_NAME = "nnscaler.cli.ops.chunk_linear_cross_entropy_fn"
_NAMES = "abcefghijklmnopqrstuwxyz"  # no 'd' (the hidden dim) and no 'v' (the vocabulary)


class ChunkedLossError(NNScalerError, ValueError):
    """Arguments of :func:`chunk_linear_cross_entropy` that do not fit together."""


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
#: :func:`chunk_linear_cross_entropy_fn` itself, the op's name).
chunk_linear_cross_entropy = register_op(
    chunk_linear_cross_entropy_anno, name=OP_NAME, input_gen_fn=_gen,
)(chunk_linear_cross_entropy_fn)
