"""Two-axis splits inside a stage: data x tensor.

A stage of ``k`` devices may run an op split ``k1`` ways along a data dim (the *outer*
split, `data_transforms`) and each of those parts ``k2`` ways along another dim (the
*inner* split), with ``k = k1 * k2`` and both above 1: a batch x heads attention, a
batch x columns linear. The kernel allows it: a part of `IRGraph.partition` can itself be
partitioned. Part ``b`` of outer part ``a`` runs on device ``a * k2 + b`` of the stage,
so the inner parts of one data part sit side by side (inside one node where ``k2``
devices fit in it: the inner split talks more).

What the cost model needs of such an option is what it needs of a one-axis split: the
layouts each device's pieces form (`layouts`, RVD layouts with a split on two dims, or a
split and replicas, that `nnscaler.layout.plan` moves to and from any other), and the
time of one part (the profiler runs part ``(0, 0)``, `part_call`).

Which pairs are options (`two_axis_transforms`): the outer split is along an input's
first dim that no weight carries, with no value-partial output (the batch; a sequence
where the model is sequence-first); the inner split, of the outer part's own
annotation, is along another identifier and, where the op reads weights, one that
splits a weight (tensor parallelism): so a linear's options are data x columns and
data x rows, not data x sequence. Every factor pair ``(k1, k2)`` of ``k`` is tried.
Splits whose parts call another op (a rule's ``part_op``) are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from nnscaler.extend import (
    FullTensor,
    IRGraph,
    Layout,
    Op,
    PartitionError,
    Split,
    SubTensor,
    TensorKind,
    Transform,
    ValuePartial,
    layout_of,
    part_piece,
    tensors_in,
)

__all__ = ["TwoAxis", "aliases", "allowed", "apply", "continues", "data_transforms", "factor_pairs", "layouts",
           "part_call", "two_axis_transforms"]


@attrs.frozen
class TwoAxis:
    """An op split ``outer.num`` ways by ``outer`` (of the whole op) and each part
    ``inner.num`` ways by ``inner`` (of a part's own annotation); part ``b`` of outer
    part ``a`` on device ``a * inner.num + b``."""

    outer: Transform
    inner: Transform

    #: no rule's part op: the parts run the op itself and do not talk
    part_op = None

    @property
    def num(self) -> int:
        return self.outer.num * self.inner.num

    @property
    def key(self) -> tuple[tuple[int, int | None], tuple[int, int | None]]:
        """What a constraint names: ``((idx, dim) outer, (idx, dim) inner)``."""
        return (self.outer.idx, self.outer.dim), (self.inner.idx, self.inner.dim)

    def describe(self) -> str:
        return (f"split input {self.outer.idx} dim {self.outer.dim} ({self.outer.ident!r}) "
                f"in {self.outer.num} x input {self.inner.idx} dim {self.inner.dim} "
                f"({self.inner.ident!r}) in {self.inner.num}")

    def choice(self) -> dict[str, Any]:
        """The plan file's form: the outer split, ``then`` the inner one."""
        return {"idx": self.outer.idx, "dim": self.outer.dim, "num": self.outer.num,
                "then": {"idx": self.inner.idx, "dim": self.inner.dim,
                         "num": self.inner.num}}


def _is_weight(x: Any) -> bool:
    return isinstance(x, SubTensor) and x.full.is_leaf and x.full.kind is not TensorKind.INPUT


def _usable(op: Op) -> bool:
    return op.anno is not None and op.opdef is not None and not op.opdef.collective


def data_transforms(op: Op, k1: int) -> list[Transform]:
    """The outer splits of ``op`` in ``k1`` parts: along the first dim of an input that is
    not a weight, by an identifier no weight carries, every output split (not
    value-partial), the parts running the op itself."""
    if not _usable(op):
        return []
    out = []
    seen: set[str] = set()
    for t in op.anno.transform_space(k1, rules=op.opdef.rules_for(op.anno)):
        if t.dim is None or t.part_op is not None or t.ident in seen:
            continue
        if any(isinstance(p, ValuePartial) for p in t.outputs):
            continue
        placed = list(zip(op.inputs, t.inputs))
        if any(_is_weight(x) and isinstance(p, (Split, ValuePartial)) for x, p in placed):
            continue
        if any(isinstance(x, SubTensor) and not _is_weight(x) and p == Split(0)
               for x, p in placed):
            seen.add(t.ident)
            out.append(t)
    return out


def part_call(op: Op, t: Transform, num: int, part: int) -> tuple[list[Any], dict[str, Any]]:
    """The inputs (pieces where ``op.inputs`` holds tensors) and keyword arguments of part
    ``part`` of ``op`` split by ``t`` in ``num``; a `TwoAxis` ``t`` (``num`` its total)
    gives inner part ``part % k2`` of outer part ``part // k2``."""
    if isinstance(t, TwoAxis):
        k2 = t.inner.num
        outer, kw = part_call(op, t.outer, t.outer.num, part // k2)
        inputs = [part_piece(x, t.inner.inputs[j], k2, part % k2)
                  if isinstance(x, SubTensor) else x for j, x in enumerate(outer)]
        return inputs, op.opdef.part_kwargs(t.inner, kw, part % k2)
    inputs = [part_piece(x, t.inputs[j], num, part) if isinstance(x, SubTensor) else x
              for j, x in enumerate(op.inputs)]
    return inputs, op.opdef.part_kwargs(t, op.kwargs, part)


def _inner_transforms(op: Op, outer: Transform, k2: int) -> list[Transform]:
    """The inner splits in ``k2`` of outer part 0 (the parts have equal shapes): of its
    own bound annotation, as `IRGraph.partition` of the part derives them."""
    inputs, kwargs = part_call(op, outer, outer.num, 0)
    shapes = [x.shape if isinstance(x, SubTensor) else None for x in inputs]
    try:
        bound = op.anno.anno.bind(shapes, kwargs)
        space = bound.transform_space(k2, rules=op.opdef.rules_for(bound))
    except Exception:  # noqa: BLE001 - a part its annotation rejects: no inner split
        return []
    weighted = any(_is_weight(x) for x in op.inputs)
    out = []
    seen = {outer.ident}  # one split per identifier (the space names it by each tensor)
    for t in space:
        if t.part_op is not None or t.ident in seen:
            continue
        seen.add(t.ident)
        if weighted and not any(_is_weight(x) and isinstance(p, (Split, ValuePartial))
                                for x, p in zip(op.inputs, t.inputs)):
            continue
        out.append(t)
    return out


def factor_pairs(k: int) -> list[tuple[int, int]]:
    """``(k1, k2)`` with ``k1 * k2 == k``, both above 1."""
    return [(k1, k // k1) for k1 in range(2, k // 2 + 1) if k % k1 == 0]


def two_axis_transforms(op: Op, k: int, memo: dict | None = None) -> list[TwoAxis]:
    """Every data x tensor split of ``op`` over ``k`` devices whose pieces form RVD
    layouts (see the module docstring); ``memo`` keeps the layouts (`layouts`)."""
    if not _usable(op):
        return []
    out = []
    for k1, k2 in factor_pairs(k):
        for outer in data_transforms(op, k1):
            for inner in _inner_transforms(op, outer, k2):
                two = TwoAxis(outer, inner)
                reads, writes = layouts(op, two, memo)
                if all(lay is not None for _, lay, _ in reads) and \
                        all(lay is not None for _, lay in writes):
                    out.append(two)
    return out


Reads = tuple[tuple[FullTensor, Layout | None, bool], ...]
Writes = tuple[tuple[FullTensor, Layout | None], ...]


def layouts(op: Op, two: TwoAxis, memo: dict | None = None) -> tuple[Reads, Writes]:
    """The layouts ``op`` reads and writes split by ``two`` over its ``num`` devices, as
    `nnscaler.extend.op_layouts` gives them for one split: every input tensor with the
    layout its parts need, every output and in-place write with the layout they leave.
    Tensors nested in a list or passed by keyword are read whole. ``memo``: a dict that
    keeps them by ``(op, two)`` (a search asks again for every stage it costs)."""
    if memo is not None:
        key = (op, two)
        if key not in memo:
            memo[key] = layouts(op, two)
        return memo[key]
    n, k2 = two.num, two.inner.num
    calls = [part_call(op, two, n, p)[0] for p in range(n)]

    def read_pieces(p: int) -> list[SubTensor]:
        got: list[SubTensor] = []
        for x in calls[p]:
            got.extend([x] if isinstance(x, SubTensor) else tensors_in(x))
        got.extend(tensors_in(dict(op.kwargs)))
        return got

    pieces = [read_pieces(p) for p in range(n)]
    reads = tuple((x.full, layout_of((p, pieces[p][j]) for p in range(n)),
                   x.full.requires_grad and not op.no_grad)
                  for j, x in enumerate(op.input_tensors()))

    def cut(x: SubTensor, outer: Any, inner: Any, p: int) -> SubTensor:
        return part_piece(part_piece(x, outer, two.outer.num, p // k2), inner, k2, p % k2)

    outs = list(tensors_in(op.outputs))
    writes = [(x.full, layout_of((p, cut(x, lo, li, p)) for p in range(n)))
              for x, lo, li in zip(outs, two.outer.outputs, two.inner.outputs)]
    written = {w[0] for w in writes}
    positions = {x: j for j, x in enumerate(op.inputs) if isinstance(x, SubTensor)}
    for before, after in op.mutations:
        if after.full in written:
            continue
        j = positions.get(before)
        lo = None if j is None else two.outer.inputs[j]
        li = None if j is None else two.inner.inputs[j]
        held = [(p, cut(before, lo, li, p)) for p in range(n)]
        writes.append((after.full, layout_of(
            (p, SubTensor(full=after.full, indmap=b.indmap, valmap=b.valmap))
            for p, b in held)))
    return reads, tuple(writes)


def apply(g: IRGraph, op: Op, two: TwoAxis) -> list[Op]:
    """Partition ``op`` by ``two``: the outer split, then each part by the inner one; the
    parts in device order (part ``b`` of outer part ``a`` at ``a * k2 + b``)."""
    parts: list[Op] = []
    for outer in g.partition(op, idx=two.outer.idx, dim=two.outer.dim, num=two.outer.num):
        try:
            parts += g.partition(outer, idx=two.inner.idx, dim=two.inner.dim,
                                 num=two.inner.num)
        except PartitionError as e:
            e.add_note(f"autodist: the inner split of the two-axis option {two.describe()}")
            raise
    return parts


def aliases(t: Transform) -> set[tuple[int, int | None]]:
    """Every ``(idx, dim)`` that names the split ``t``: each input it splits along a dim
    (a linear's input columns are its weight's columns), and its own."""
    names = {(t.idx, t.dim)}
    names.update((j, p.dim) for j, p in enumerate(t.inputs) if isinstance(p, Split))
    return names


def allowed(two: TwoAxis, choices: Sequence[Any] | set[Any] | None) -> bool:
    """Whether constraints ``choices`` (``None``: none) allow ``two``: an entry
    ``"i,d x j,e"`` names it when ``i,d`` names its outer split and ``j,e`` its inner one
    (by any tensor the split cuts)."""
    if choices is None:
        return True
    outer, inner = aliases(two.outer), aliases(two.inner)
    return any(isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], tuple)
               and c[0] in outer and c[1] in inner for c in choices)


def continues(op: Op, t: Any, written: dict[FullTensor, set], memo: dict | None = None) -> bool:
    """Whether a stage offers option ``t`` of ``op``: every one-axis option and every
    two-axis option of an op that reads weights (data x tensor proper); a two-axis
    option of an op without weights only where it reads a tensor in a layout that a
    two-axis option of its producer writes (``written``, by tensor): it carries a data x
    tensor layout on, without a move, to the next op that reads weights. Elsewhere it
    computes what the one-axis split over as many devices does and only adds layouts
    that the planner must price against every other (the search's largest cost)."""
    if not isinstance(t, TwoAxis) or any(_is_weight(x) for x in op.inputs):
        return True
    reads, _ = layouts(op, t, memo)
    return any(lay in written.get(full, ()) for full, lay, _ in reads)
