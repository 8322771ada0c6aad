"""Losses: cross_entropy, nll_loss and the elementwise losses (mse, l1, bce, kl_div, ...).

The marks follow the reduction:

- ``'none'``: one loss per sample (element): the sample dims split;
- ``'sum'``: the loss is the sum of the per-sample losses, so the sample dims are ``+``;
- ``'mean'``: the sum divided by a count (of elements, of non-ignored targets, or of the
  weights): a part would divide by its own count, so every dim is ``^``;
- ``'batchmean'`` (kl_div): the sum divided by the size of dim 0: dim 0 is ``^`` and the
  other dims are ``+``.

A dim that a per-sample loss mixes (the class dim of cross_entropy) is ``^`` throughout;
cross_entropy's transform rule splits its class dim all the same, into parts that run
`class_parallel_cross_entropy` and exchange a few numbers per sample; with
``reduction='mean'`` another rule splits its tokens (dim 0), into parts that run
`nnscaler.ops.builtin.token_loss.token_parallel_cross_entropy`.
The output of a reduced loss is the 0-d tensor ``1``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import _reduction

from nnscaler.anno import Replicate, Split, TransformRule
from nnscaler.anno.partgroup import SINGLE
from nnscaler.ops.builtin._common import idents, randint, tensor_str
from nnscaler.ops.builtin.nn import bcast, f64, marked, shape_of, size
from nnscaler.ops.registry import OpRegistry


def _reduction_of(size_average: Any, reduce: Any, reduction: str) -> str:
    if size_average is not None or reduce is not None:
        return _reduction.legacy_get_string(size_average, reduce, emit_warning=False)
    return reduction


def _sample_mark(reduction: str) -> str:
    return {"none": "", "sum": "+"}.get(reduction, "^")


def _elementwise(tensors: Sequence[Any], reduction: str) -> tuple[list[str], str]:
    """Entries of losses computed element by element on broadcast inputs, and the output."""
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in tensors]
    per, names, _ = bcast(shapes)
    if reduction == "none":
        mark = ""
    elif reduction == "batchmean":
        mark = "+"
    else:
        mark = _sample_mark(reduction)
    entries = []
    for dims in per:
        if dims is None:
            entries.append("?")
            continue
        dims = marked(dims, mark)
        if reduction == "batchmean" and names and len(dims) == len(names) and dims[0] != "1":
            dims[0] = dims[0].rstrip("+") + "^"  # the divisor is the size of dim 0
        entries.append(tensor_str(dims))
    out = tensor_str(names) if reduction == "none" else "1"
    return entries, out


def _anno(entries: Sequence[str], out: str) -> str:
    return f"{', '.join(entries)} -> {out}"


# -- cross_entropy, nll_loss ---------------------------------------------------------------


def _class_loss(input, target, weight, reduction: str) -> str:
    """``input`` is ``(C)``, ``(N, C)`` or ``(N, C, d1, ...)``: the class dim is 1 (0)."""
    names = idents(input.dim())
    c = 0 if input.dim() == 1 else 1
    mark = _sample_mark(reduction)
    dims = [n + ("^" if i == c else mark) for i, n in enumerate(names)]
    w = "?" if weight is None else dims[c]
    if target.is_floating_point():  # class probabilities, shaped like input
        tgt = tensor_str(dims)
    else:
        tgt = tensor_str([d for i, d in enumerate(dims) if i != c])
    if reduction == "none":
        out = tensor_str([n for i, n in enumerate(names) if i != c])
    else:
        out = "1"
    return f"{tensor_str(dims)}, {tgt}, {w} -> {out}"


def cross_entropy_anno(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
    reduction="mean", label_smoothing=0.0,
) -> str:
    return _class_loss(input, target, weight, _reduction_of(size_average, reduce, reduction))


def nll_loss_anno(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
    reduction="mean",
) -> str:
    return _class_loss(input, target, weight, _reduction_of(size_average, reduce, reduction))


def _reduction_kwargs(rng: random.Random, choices: Sequence[str] = ("none", "sum", "mean")) -> dict:
    r = rng.random()
    if r < 0.1:
        return {"reduce": False}
    if r < 0.15:
        return {"size_average": False}
    if r < 0.3:
        return {}
    return {"reduction": rng.choice(choices)}


def _gen_class_loss(probabilities: bool, weights: bool = True):
    def gen(rng: random.Random) -> tuple[tuple, dict]:
        c = rng.choice((2, 3, 5))
        lead = [size(rng)] if rng.random() < 0.85 else []
        spatial = list(shape_of(rng, 0, 2)) if lead else []
        x = f64(rng, *lead, c, *spatial)
        cls_dim = 1 if lead else 0
        if probabilities and rng.random() < 0.4:
            target = f64(rng, *x.shape).softmax(cls_dim)
        else:
            target = randint(rng, 0, c, *lead, *spatial)
            if rng.random() < 0.3 and target.numel():
                target = target.masked_fill(randint(rng, 0, 4, *target.shape) == 0, -100)
        kw: dict[str, Any] = _reduction_kwargs(rng)
        if weights and rng.random() < 0.3:
            kw["weight"] = f64(rng, c).abs() + 0.1
        if probabilities and rng.random() < 0.3:
            kw["label_smoothing"] = 0.1
        if not probabilities:
            x = x.log_softmax(cls_dim)
        return (x, target), kw

    return gen


# -- cross_entropy over classes split in parts ---------------------------------------------

#: The part op of a cross_entropy whose class dim is split (Megatron's vocabulary-parallel
#: cross-entropy): the parts exchange their maximum, normalizer and target logit.
CLASS_PARALLEL_CE = "nnscaler.ops.builtin.loss.class_parallel_cross_entropy"


def class_parallel_cross_entropy(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
    reduction="mean", label_smoothing=0.0, *, class_start=0, num_classes=None,
    group=SINGLE,
):
    """``F.cross_entropy`` on this part's classes ``[class_start, class_start + C_part)``
    of ``num_classes``, the parts joined by ``group`` (a `PartGroup`): every part
    returns the loss over all classes. Targets are class indices (read whole) or class
    probabilities (split like ``input``); no class weights.

    Each part reduces its classes to a few numbers per sample (its maximum, its sum of
    exponentials relative to it, the target's logit where it holds the target, ...) and
    one all-gather of those lets every part finish the loss; the backward is the
    all-gather's adjoint, one reduce-scatter of as many numbers.
    """
    if weight is not None:
        raise ValueError("class_parallel_cross_entropy: class weights are not supported; "
                         "the transform rule only splits the classes of an unweighted loss")
    red = _reduction_of(size_average, reduce, reduction)
    c = 0 if input.dim() == 1 else 1
    if num_classes is None:
        num_classes = input.size(c) * group.size
    eps = float(label_smoothing)
    peak = input.detach().amax(c)
    stats = [peak, (input - peak.unsqueeze(c)).exp().sum(c)]
    probabilities = target.is_floating_point()
    if probabilities:
        t = target * (1 - eps) + eps / num_classes if eps else target
        stats += [t.sum(c), (t * input).sum(c)]
    else:
        local = target - class_start
        held = (local >= 0) & (local < input.size(c))
        picked = input.gather(c, torch.where(held, local, 0).unsqueeze(c)).squeeze(c)
        stats.append(torch.where(held, picked, 0.0))
        if eps:
            stats.append(input.sum(c))
    every = group.all_gather(torch.stack(stats))  # [parts, stats, *samples]
    peaks = every[:, 0].detach()
    top = peaks.amax(0)
    lse = top + (every[:, 1] * (peaks - top).exp()).sum(0).log()
    if probabilities:
        loss = lse * every[:, 2].sum(0) - every[:, 3].sum(0)
        if red == "none":
            return loss
        return loss.sum() if red == "sum" else loss.sum() / loss.numel()
    loss = lse - every[:, 2].sum(0)
    if eps:
        loss = (1 - eps) * loss + eps * (lse - every[:, 3].sum(0) / num_classes)
    valid = target != ignore_index
    loss = torch.where(valid, loss, 0.0)
    if red == "none":
        return loss
    return loss.sum() if red == "sum" else loss.sum() / valid.sum()


def _class_parallel_ce_anno(input, target, weight=None, size_average=None, ignore_index=-100,
                            reduce=None, reduction="mean", label_smoothing=0.0,
                            **_: Any) -> str:
    return cross_entropy_anno(input, target, weight, size_average, ignore_index, reduce,
                              reduction, label_smoothing)


def cross_entropy_rules(bound: Any) -> list[TransformRule]:
    """cross_entropy without class weights splits its class dim: the parts run
    `class_parallel_cross_entropy` and each returns the whole loss; a mean one also
    splits its tokens (`token_rules`)."""
    from nnscaler.ops.builtin.token_loss import token_rules

    return _class_rules(bound) + token_rules(bound)


def _class_rules(bound: Any) -> list[TransformRule]:
    x, t, w = bound.input_shapes[:3]
    if x is None or t is None or w is not None or not x:
        return []
    c = 0 if len(x) == 1 else 1
    probabilities = len(t) == len(x)
    num_classes = x[c]

    def modifier(kwargs: dict, idx: int, dim: int, num: int, part: int) -> dict:
        return {**kwargs, "class_start": part * (num_classes // num), "num_classes": num_classes}

    return [TransformRule(
        inputs=(Split(c), Split(c) if probabilities else Replicate(), None),
        outputs=(Replicate(),),
        modifier=modifier,
        part_op=CLASS_PARALLEL_CE,
    )]


# -- elementwise losses --------------------------------------------------------------------


def mse_loss_anno(input, target, size_average=None, reduce=None, reduction="mean", weight=None) -> str:
    red = _reduction_of(size_average, reduce, reduction)
    if weight is None:
        return _anno(*_elementwise([input, target], red))
    (x, t, w), out = _elementwise([input, target, weight], red)
    return _anno([x, t, "?", "?", "?", w], out)


def smooth_l1_loss_anno(
    input, target, size_average=None, reduce=None, reduction="mean", beta=1.0
) -> str:
    return _anno(*_elementwise([input, target], _reduction_of(size_average, reduce, reduction)))


def huber_loss_anno(input, target, reduction="mean", delta=1.0, weight=None) -> str:
    if weight is None:
        return _anno(*_elementwise([input, target], reduction))
    (x, t, w), out = _elementwise([input, target, weight], reduction)
    return _anno([x, t, "?", "?", w], out)


def binary_cross_entropy_anno(
    input, target, weight=None, size_average=None, reduce=None, reduction="mean"
) -> str:
    red = _reduction_of(size_average, reduce, reduction)
    return _anno(*_elementwise([input, target, weight], red))


def binary_cross_entropy_with_logits_anno(
    input, target, weight=None, size_average=None, reduce=None, reduction="mean",
    pos_weight=None,
) -> str:
    red = _reduction_of(size_average, reduce, reduction)
    if pos_weight is None:
        return _anno(*_elementwise([input, target, weight], red))
    (x, t, w, pw), out = _elementwise([input, target, weight, pos_weight], red)
    return _anno([x, t, w, "?", "?", "?", pw], out)


def kl_div_anno(
    input, target, size_average=None, reduce=None, reduction="mean", log_target=False
) -> str:
    red = _reduction_of(size_average, reduce, reduction)
    if red == "batchmean" and input.dim() == 0:
        red = "sum"
    return _anno(*_elementwise([input, target], red))


def soft_margin_loss_anno(input, target, size_average=None, reduce=None, reduction="mean") -> str:
    return _anno(*_elementwise([input, target], _reduction_of(size_average, reduce, reduction)))


def hinge_embedding_loss_anno(
    input, target, margin=1.0, size_average=None, reduce=None, reduction="mean"
) -> str:
    return _anno(*_elementwise([input, target], _reduction_of(size_average, reduce, reduction)))


def margin_ranking_loss_anno(
    input1, input2, target, margin=0, size_average=None, reduce=None, reduction="mean"
) -> str:
    red = _reduction_of(size_average, reduce, reduction)
    return _anno(*_elementwise([input1, input2, target], red))


def poisson_nll_loss_anno(
    input, target, log_input=True, full=False, size_average=None, eps=1e-08, reduce=None,
    reduction="mean",
) -> str:
    return _anno(*_elementwise([input, target], _reduction_of(size_average, reduce, reduction)))


def multilabel_soft_margin_loss_anno(
    input, target, weight=None, size_average=None, reduce=None, reduction="mean"
) -> str:
    # the per-sample loss is the mean over the classes (the last dim): '^'
    red = _reduction_of(size_average, reduce, reduction)
    mark = _sample_mark(red)
    names = idents(input.dim())
    dims = [n + ("^" if i == input.dim() - 1 else mark) for i, n in enumerate(names)]
    w = "?"
    if weight is not None:
        per, _, _ = bcast([tuple(input.shape), tuple(weight.shape)], names)
        wd = per[1] or []
        w = tensor_str([d if d == "1" else dims[names.index(d)] for d in wd])
    out = tensor_str(names[:-1]) if red == "none" else "1"
    return f"{tensor_str(dims)}, {tensor_str(dims)}, {w} -> {out}"


# -- input generators for the elementwise losses ---------------------------------------------


def _pair(rng: random.Random, target_kind: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    shape = shape_of(rng, 0, 3)
    x = f64(rng, *shape)
    if target_kind == "prob":
        x = x.sigmoid()
        t = f64(rng, *shape).sigmoid()
    elif target_kind == "sign":
        t = randint(rng, 0, 2, *shape).to(torch.float64) * 2 - 1
    elif target_kind == "count":
        t = randint(rng, 0, 4, *shape).to(torch.float64)
    else:
        t = f64(rng, *shape)
    return x, t


def _sub_shape(rng: random.Random, shape: Sequence[int]) -> list[int]:
    """A shape that broadcasts to ``shape``."""
    nd = rng.randint(0, len(shape))
    return [n if rng.random() < 0.7 else 1 for n in shape[len(shape) - nd :]]


def _gen_weighted(weight_kw: bool, with_weight: bool = True, choices=("none", "sum", "mean")):
    def gen(rng: random.Random) -> tuple[tuple, dict]:
        x, t = _pair(rng)
        kw = _reduction_kwargs(rng, choices)
        if with_weight and rng.random() < 0.4 and x.dim():
            kw["weight"] = f64(rng, *x.shape).abs() + 0.1  # mse/l1/huber: same size
        if weight_kw and rng.random() < 0.3:
            kw["delta" if "delta" in choices else "beta"] = 0.5
        return (x, t), kw

    return gen


def gen_huber(rng: random.Random) -> tuple[tuple, dict]:
    x, t = _pair(rng)
    kw: dict[str, Any] = {}
    if rng.random() < 0.7:
        kw["reduction"] = rng.choice(("none", "sum", "mean"))
    if rng.random() < 0.4 and x.dim():
        kw["weight"] = f64(rng, *x.shape).abs() + 0.1
    if rng.random() < 0.3:
        kw["delta"] = 0.5
    return (x, t), kw


def gen_smooth_l1(rng: random.Random) -> tuple[tuple, dict]:
    x, t = _pair(rng)
    kw = _reduction_kwargs(rng)
    if rng.random() < 0.3:
        kw["beta"] = 0.5
    return (x, t), kw


def gen_bce(rng: random.Random) -> tuple[tuple, dict]:
    x, t = _pair(rng, "prob")
    kw = _reduction_kwargs(rng)
    if rng.random() < 0.4:
        kw["weight"] = f64(rng, *_sub_shape(rng, x.shape)).abs() + 0.1
    return (x, t), kw


def gen_bce_logits(rng: random.Random) -> tuple[tuple, dict]:
    x, t = _pair(rng)
    t = t.sigmoid()
    kw = _reduction_kwargs(rng)
    if rng.random() < 0.4:
        kw["weight"] = f64(rng, *_sub_shape(rng, x.shape)).abs() + 0.1
    if rng.random() < 0.4:
        kw["pos_weight"] = f64(rng, *_sub_shape(rng, x.shape)).abs() + 0.1
    return (x, t), kw


def gen_kl_div(rng: random.Random) -> tuple[tuple, dict]:
    x, t = _pair(rng)
    x = x.log_softmax(-1) if x.dim() else x
    log_target = rng.random() < 0.3
    t = t.log_softmax(-1) if log_target and t.dim() else (t.softmax(-1) if t.dim() else t.abs())
    kw = _reduction_kwargs(rng, ("none", "sum", "mean", "batchmean", "batchmean"))
    if log_target:
        kw["log_target"] = True
    return (x, t), kw


def _gen_simple(target_kind: str):
    def gen(rng: random.Random) -> tuple[tuple, dict]:
        x, t = _pair(rng, target_kind)
        return (x, t), _reduction_kwargs(rng)

    return gen


def gen_margin_ranking(rng: random.Random) -> tuple[tuple, dict]:
    x, t = _pair(rng, "sign")
    kw = _reduction_kwargs(rng)
    if rng.random() < 0.4:
        kw["margin"] = 0.5
    return (x, f64(rng, *x.shape), t), kw


def gen_poisson_nll(rng: random.Random) -> tuple[tuple, dict]:
    x, t = _pair(rng, "count")
    kw = _reduction_kwargs(rng)
    if rng.random() < 0.4:
        kw["log_input"] = False
        x = x.abs() + 0.1
    if rng.random() < 0.4:
        kw["full"] = True
    return (x, t), kw


def gen_multilabel_soft_margin(rng: random.Random) -> tuple[tuple, dict]:
    c = rng.choice((2, 3, 5))
    lead = [size(rng)] if rng.random() < 0.85 else []
    x = f64(rng, *lead, c)
    t = randint(rng, 0, 2, *lead, c).to(torch.float64)
    kw = _reduction_kwargs(rng)
    if rng.random() < 0.4:
        kw["weight"] = f64(rng, *_sub_shape(rng, x.shape)).abs() + 0.1
    return (x, t), kw


def register(registry: OpRegistry) -> None:
    r = registry.register
    r(F.cross_entropy, cross_entropy_anno, name="torch.nn.functional.cross_entropy",
      input_gen_fn=_gen_class_loss(True), transform_rules=cross_entropy_rules)
    r(class_parallel_cross_entropy, _class_parallel_ce_anno, name=CLASS_PARALLEL_CE,
      input_gen_fn=_gen_class_loss(True, weights=False), collective=True)
    r(F.nll_loss, nll_loss_anno, name="torch.nn.functional.nll_loss",
      input_gen_fn=_gen_class_loss(False))
    r(F.mse_loss, mse_loss_anno, name="torch.nn.functional.mse_loss",
      input_gen_fn=_gen_weighted(False))
    r(F.l1_loss, mse_loss_anno, name="torch.nn.functional.l1_loss",
      input_gen_fn=_gen_weighted(False))
    r(F.smooth_l1_loss, smooth_l1_loss_anno, name="torch.nn.functional.smooth_l1_loss",
      input_gen_fn=gen_smooth_l1)
    r(F.huber_loss, huber_loss_anno, name="torch.nn.functional.huber_loss",
      input_gen_fn=gen_huber)
    r(F.binary_cross_entropy, binary_cross_entropy_anno,
      name="torch.nn.functional.binary_cross_entropy", input_gen_fn=gen_bce)
    r(F.binary_cross_entropy_with_logits, binary_cross_entropy_with_logits_anno,
      name="torch.nn.functional.binary_cross_entropy_with_logits", input_gen_fn=gen_bce_logits)
    r(F.kl_div, kl_div_anno, name="torch.nn.functional.kl_div", input_gen_fn=gen_kl_div)
    r(F.soft_margin_loss, soft_margin_loss_anno, name="torch.nn.functional.soft_margin_loss",
      input_gen_fn=_gen_simple("sign"))
    r(F.hinge_embedding_loss, hinge_embedding_loss_anno,
      name="torch.nn.functional.hinge_embedding_loss", input_gen_fn=_gen_simple("sign"))
    r(F.margin_ranking_loss, margin_ranking_loss_anno,
      name="torch.nn.functional.margin_ranking_loss", input_gen_fn=gen_margin_ranking)
    r(F.poisson_nll_loss, poisson_nll_loss_anno, name="torch.nn.functional.poisson_nll_loss",
      input_gen_fn=gen_poisson_nll)
    r(F.multilabel_soft_margin_loss, multilabel_soft_margin_loss_anno,
      name="torch.nn.functional.multilabel_soft_margin_loss",
      input_gen_fn=gen_multilabel_soft_margin)
