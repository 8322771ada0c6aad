"""The parts of an op split by a transform: what [`IRGraph.partition`][nnscaler.IRGraph.partition]
puts in the op's place. Each part gets its pieces of the op's tensors (inputs, outputs and
in-place writes), its keyword arguments and its bound annotation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nnscaler.anno import AnnotationError, Placement, Split, Transform, ValuePartial
from nnscaler.graph.errors import PartitionError, PlanError
from nnscaler.ir import Op, OpPlan, SubTensor, tensors_in

if TYPE_CHECKING:
    from nnscaler.graph.graph import IRGraph


def shapes_str(tensors: Iterable[SubTensor]) -> str:
    return ", ".join(f"[{','.join(map(str, t.shape))}]" for t in tensors) or "none"


PLAIN = (int, float, str, bool, type(None), torch.dtype)


def plain_equal(a: Any, b: Any) -> bool:
    """``a == b`` for keyword arguments made of plain values (numbers, strings, dtypes, and
    tuples, lists and dicts of them); False when either holds anything else (a tensor,
    whose ``==`` is elementwise): then the caller does not reuse what it computed."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, PLAIN):
        return a == b
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(plain_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(plain_equal(a[k], b[k]) for k in a)
    return False


def new_instance(graph: IRGraph, op: Op, **changes: Any) -> Op:
    """A new instance of ``op`` (a part or a replica) with a fresh id in ``graph``, the
    op's stage and recompute marks, no device yet, and ``changes``."""
    plan = OpPlan(stage=op.plan.stage, recompute=op.plan.recompute)
    return attrs.evolve(op, oid=graph.next_op_id(), plan=plan, **changes)


def op_parts(graph: IRGraph, op: Op, t: Transform) -> list[Op]:
    """The ``t.num`` parts of ``op`` split by ``t``: their pieces, keyword arguments and
    annotations. Each tensor is split once for all parts (``SubTensor.split`` makes
    every piece), and parts that read the same shapes with equal keyword arguments
    share one bound annotation."""
    num = t.num

    def pieces(sub: SubTensor, layout: Placement | None) -> tuple[SubTensor, ...]:
        if isinstance(layout, Split):
            return sub.split(layout.dim, num)
        if isinstance(layout, ValuePartial):
            return sub.value_split(num)
        return (sub,) * num  # Replicate, or '?': the same piece

    def fail(reason: str) -> PartitionError:
        return PartitionError(f"cannot partition {graph.describe(op)} as {t}: {reason}")

    split_inputs = [
        pieces(x, layout) if isinstance(x, SubTensor) else (x,) * num
        for x, layout in zip(op.inputs, t.inputs, strict=True)
    ]
    out_tensors = list(tensors_in(op.outputs))
    if len(out_tensors) != len(t.outputs):
        raise fail(f"its annotation has {len(t.outputs)} outputs but the call returned "
                   f"{len(out_tensors)} tensors; replicate the op instead")
    split_out = {id(x): pieces(x, layout)
                 for x, layout in zip(out_tensors, t.outputs, strict=True)}
    opdef, anno = op.opdef, op.anno
    if opdef is None or anno is None:
        raise fail("the op has no annotation")
    if t.part_op is not None:  # the parts call another op (a transform rule's part_op)
        try:
            part_def = graph.op_registry().get(t.part_op)
        except LookupError as e:
            raise fail(f"its transform rule names the part op {t.part_op!r}, which is "
                       f"not registered: {e}") from None
    else:
        part_def = opdef
    parts: list[Op] = []
    last: tuple[list[Any], dict[str, Any], Any] | None = None  # shapes, kwargs, bound
    for part in range(num):
        inputs = tuple(split[part] for split in split_inputs)
        outputs = tuple(split_out[id(x)][part] if id(x) in split_out else x
                        for x in op.outputs)
        # in-place writes: the piece written is the piece of the output (or input) it
        # aliases
        written = {x.full: x for x in (*tensors_in(outputs), *tensors_in(inputs))}
        mutations = []
        for before, after in op.mutations:
            b = written.get(before.full)
            if b is None:
                raise fail(f"it writes {before.full.name} in place through a view, which "
                           f"a split cannot follow; replicate the op instead")
            a = written.get(after.full) or SubTensor(full=after.full, indmap=b.indmap,
                                                     valmap=b.valmap)
            mutations.append((b, a))
        kwargs = opdef.part_kwargs(t, op.kwargs, part)
        shapes = [x.shape if isinstance(x, SubTensor) else None for x in inputs]
        if last is not None and last[0] == shapes and plain_equal(last[1], kwargs):
            bound = last[2]
        else:
            try:
                bound = _bind_part(anno.anno, part_def if t.part_op else None, inputs,
                                   shapes, kwargs)
            except AnnotationError as e:
                raise fail(f"part {part} has input shapes {shapes_str(tensors_in(inputs))}, "
                           f"which its annotation rejects: {e}") from None
            last = (shapes, kwargs, bound)
        parts.append(new_instance(graph, op, opdef=part_def, anno=bound, inputs=inputs,
                                  kwargs=kwargs, outputs=outputs,
                                  mutations=tuple(mutations)))
    return parts


def _bind_part(whole: Any, part_def: Any, inputs: tuple, shapes: list, kwargs: dict) -> Any:
    """A part's bound annotation: the whole op's, or, where that rejects the part's shapes
    and the parts call a part op (a rule's ``part_op``), the part op's own for them (a
    context-parallel part reads a mask with every key column against its chunk of keys)."""
    try:
        return whole.bind(shapes, kwargs)
    except AnnotationError:
        if part_def is None:
            raise
    args = [torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, SubTensor)
            else x for x in inputs]
    return part_def.annotation_for(args, kwargs).bind(shapes, kwargs)


def talking_parts(graph: IRGraph, op: Op) -> list[Op]:
    """The instances that ``op`` talks to, ``op`` among them, in part order: see
    [`IRGraph.split_parts`][nnscaler.IRGraph.split_parts].

    A part of a split whose parts talk (a collective part op) may itself be partitioned
    or replicated (a tensor-parallel head part split again along the sequence is the
    other order); instance ``j`` of part ``p`` then talks to instance ``j`` of every other
    part, so every part must be replaced alike. ``path`` is the position of ``op`` under
    its part, outermost last; a level with one instance and no split (a copy, an op
    rewired by ``multiref``) is not a position."""
    parent, replaced, split = graph._parent, graph._replaced, graph._split
    path: list[int] = []
    at = op
    while at in parent:
        up = parent[at][0]
        if up.opdef is None or not up.opdef.collective:
            break
        if len(replaced[up]) > 1 or at in split:
            path.append(replaced[up].index(at))
        at = up
    while at in parent and at not in split:  # e.g. rewired by multiref
        at = parent[at][0]
    if at not in split:
        return [op]
    siblings = replaced[parent[at][0]]
    if not path and not (op.opdef is not None and op.opdef.collective):
        parts: list[Op] = []  # the parts of an ordinary split: whatever they became
        for sibling in siblings:
            parts += graph.instances(sibling)
        return parts
    return [_follow(graph, sibling, path, op, len(siblings)) for sibling in siblings]


def _follow(graph: IRGraph, at: Op, path: list[int], op: Op, num: int) -> Op:
    """The instance at ``path`` under the part ``at`` (see `talking_parts`)."""
    replaced, split = graph._replaced, graph._split

    def unlike() -> PlanError:
        return PlanError(
            f"{graph.describe(op)} is a part of a split in {num} parts that talk to each "
            f"other ({op.opdef.name if op.opdef else op.name}), and its instance talks to "
            f"the instance at the same position under every other part; but op #{at.oid} "
            f"was replaced otherwise ({len(graph.instances(at))} instances). Partition or "
            f"replicate every part of the split alike (the same transform, the same count)")

    for index in reversed(path):
        while at in replaced and len(replaced[at]) == 1 and replaced[at][0] not in split:
            at = replaced[at][0]
        kids = replaced.get(at, ())
        if index >= len(kids):
            raise unlike()
        at = kids[index]
    found = graph.instances(at)
    if len(found) != 1:
        raise unlike()
    return found[0]
