"""A mean cross-entropy split over its tokens: `token_parallel_cross_entropy`.

``F.cross_entropy(..., reduction='mean')`` divides the sum of the per-token losses by a
count over all tokens (the targets not ignored, or their class weights; the samples for
class probabilities), so its token dim is ``^``. Its transform rule splits dim 0 all the
same (a long sequence split across devices, a batch of one): each part adds its own
tokens' losses and counts them, and one all-reduce of those two numbers gives every part
the whole mean. Its gradient is the all-reduce's adjoint: each part's sum receives the
gradient of every part's result.

The rule is offered inside `token_split` only (the ``sequence`` and ``data`` policies
and autodist plan in it): the other policies keep the plans they had, in which a mean loss gathers its
inputs.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from nnscaler.anno import DimAnno, Reduce, Replicate, Split, TransformRule
from nnscaler.anno.partgroup import SINGLE
from nnscaler.ops.registry import OpRegistry

__all__ = ["TOKEN_PARALLEL_CE", "token_parallel_cross_entropy", "token_rules", "token_split"]

TOKEN_PARALLEL_CE = "nnscaler.ops.builtin.token_loss.token_parallel_cross_entropy"

_OFFERED: ContextVar[bool] = ContextVar("nnscaler_token_split", default=False)


@contextmanager
def token_split() -> Iterator[None]:
    """Within it, a mean cross_entropy's transform space includes the token split."""
    token = _OFFERED.set(True)
    try:
        yield
    finally:
        _OFFERED.reset(token)


def token_parallel_cross_entropy(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
    reduction="mean", label_smoothing=0.0, *, group=SINGLE,
):
    """``F.cross_entropy(reduction='mean')`` on this part's tokens (a slice of dim 0), the
    parts joined by ``group`` (a `PartGroup`): every part returns the mean over every
    part's tokens."""
    total = F.cross_entropy(input, target, weight, ignore_index=ignore_index,
                            reduction="sum", label_smoothing=label_smoothing)
    if target.is_floating_point():  # class probabilities: the mean is over the samples
        count = torch.tensor(float(target.numel() // target.shape[1]), dtype=total.dtype,
                             device=total.device)
    else:
        valid = target != ignore_index
        if weight is None:
            count = valid.sum().to(total.dtype)
        else:
            count = torch.where(valid, weight[torch.where(valid, target, 0)], 0).sum()
    both = group.all_reduce(torch.stack([total, count.to(total.dtype).detach()]))
    return both[0] / both[1]


def token_rules(bound: Any) -> list[TransformRule]:
    """cross_entropy with ``reduction='mean'`` over ``(N, C, ...)`` splits ``N`` (the
    annotation marks a mean's token dim ``^``, a sum's ``+``), inside `token_split`."""
    x, t, w = bound.input_shapes[:3]
    if not _OFFERED.get() or x is None or t is None or len(x) < 2:
        return []
    first = bound.expanded.inputs[0].dims[0]
    if not isinstance(first, DimAnno) or first.idents[0].reduce is not Reduce.FROZEN:
        return []
    return [TransformRule(
        inputs=(Split(0), Split(0), None if w is None else Replicate()),
        outputs=(Replicate(),),
        part_op=TOKEN_PARALLEL_CE,
    )]


def _anno(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
          reduction="mean", label_smoothing=0.0, **_: Any) -> str:
    from nnscaler.ops.builtin.loss import cross_entropy_anno

    return cross_entropy_anno(input, target, weight, size_average, ignore_index, reduce,
                              reduction, label_smoothing)


def _gen(rng: random.Random) -> tuple[tuple, dict]:
    """A mean cross_entropy over ``(N, C, ...)`` (the calls the rule makes parts of)."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    n, c = rng.choice((2, 4, 6)), rng.choice((2, 3, 5))
    spatial = rng.choice(((), (2,)))
    x = torch.randn(n, c, *spatial, generator=g, dtype=torch.float64)
    kw: dict[str, Any] = {}
    if rng.random() < 0.3:
        target = torch.randn(n, c, *spatial, generator=g, dtype=torch.float64).softmax(1)
    else:
        target = torch.randint(0, c, (n, *spatial), generator=g)
        target[0] = -100 if rng.random() < 0.3 else target[0]
        if rng.random() < 0.4:
            kw["weight"] = torch.rand(c, generator=g, dtype=torch.float64) + 0.1
    if rng.random() < 0.3:
        kw["label_smoothing"] = 0.1
    return (x, target), kw


def register(registry: OpRegistry) -> None:
    registry.register(token_parallel_cross_entropy, _anno, name=TOKEN_PARALLEL_CE,
                      input_gen_fn=_gen, collective=True)
