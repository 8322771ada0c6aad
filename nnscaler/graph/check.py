"""``check_plan``: is a planned graph complete and consistent?

Three rules, checked in this order:

1. every op instance is assigned to a device of the scale unit (``0 <= device < ndevices``);
2. every instance's pieces fit its annotation: binding the annotation to the shapes of the
   pieces it reads gives the shapes of the pieces it writes;
3. every piece an op reads (and every graph output) can be formed from the pieces that
   earlier ops write: where it lies, their value parts sum to the whole value (see
   `nnscaler.graph.pieces`). Parameters, buffers, constants and inputs are leaves,
   available whole everywhere.

Moving pieces between devices is the layout layer's job; the check only asks that the
pieces exist.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any

import torch

from nnscaler.anno import AnnotationError
from nnscaler.graph.errors import PlanCheckError
from nnscaler.graph.graph import IRGraph, as_irgraph
from nnscaler.graph.pieces import Gap, ValueKey, cover
from nnscaler.ir import FullTensor, Graph, Op, SubTensor, tensors_in

_LISTED = 8  # ops listed by name in one message


def _same_shape(a: tuple[int, ...] | None, b: tuple[int, ...]) -> bool:
    return a == b or (a == (1,) and b == ()) or (a == () and b == (1,))


def check_plan(graph: Graph, ndevices: int) -> None:
    """Raise `PlanCheckError` unless ``graph`` is a complete plan
    for ``ndevices`` devices (see the module docstring for the rules)."""
    if isinstance(ndevices, bool) or not isinstance(ndevices, int) or ndevices < 1:
        raise PlanCheckError(f"check: ndevices is the number of devices of the scale unit, a "
                             f"positive int; got {ndevices!r}")
    g = as_irgraph(graph)
    stamp = _stamp(g, ndevices)
    passed = _passed.get(g)
    if passed is not None and passed == stamp:
        return  # checked already, and nothing the check reads has changed since
    _check_devices(g, ndevices)
    bound: dict[Hashable, Any] = {}
    for op in g.ops:
        _check_shapes(g, op, bound)
    _check_pieces(g)
    _passed[g] = stamp


#: graph -> the stamp of its last passed check (a policy, parallelize and build_program
#: each check the same plan: the second and third check are free)
_passed: weakref.WeakKeyDictionary[IRGraph, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def _stamp(g: IRGraph, ndevices: int) -> tuple[Any, ...]:
    """What the check reads: the op instances (frozen values: their pieces, annotations
    and lineage never change; partition, replicate and multiref make new ones), the device
    each runs on, and the graph's outputs. Equal stamps, equal verdicts."""
    return (ndevices, tuple(g.ops), tuple(op.plan.device for op in g.ops),
            tuple(g.output_tensors()))


_PLAIN = (int, float, str, bool, type(None), torch.dtype)


def _plain_key(value: Any) -> Hashable | None:
    """A hashable key that is equal for equal plain values (numbers, strings, dtypes, and
    lists, tuples and dicts of them) of the same types; None for anything else."""
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        items = [_plain_key(x) for x in value]
        return None if any(k is None for k in items) else (type(value), tuple(items))
    if isinstance(value, dict):
        keys = [(k, _plain_key(v)) for k, v in value.items()]
        if any(v is None for _, v in keys) or not all(isinstance(k, str) for k, _ in keys):
            return None
        return (dict, tuple(sorted(keys)))
    return None


def _listing(g: IRGraph, ops: list[Op]) -> str:
    shown = "\n".join(f"  {g.describe(op)}" for op in ops[:_LISTED])
    more = f"\n  ... and {len(ops) - _LISTED} more" if len(ops) > _LISTED else ""
    return shown + more


def _check_devices(g: IRGraph, ndevices: int) -> None:
    unassigned = [op for op in g.ops if op.plan.device is None]
    if unassigned:
        raise PlanCheckError(
            f"every op instance must be assigned to a device, but {len(unassigned)} of "
            f"{len(g.ops)} are not:\n{_listing(g, unassigned)}\nAssign each with "
            f"graph.assign(op, device)."
        )
    outside = [op for op in g.ops if not 0 <= op.plan.device < ndevices]  # type: ignore[operator]
    if outside:
        devices = sorted({op.plan.device for op in outside})  # type: ignore[type-var]
        raise PlanCheckError(
            f"devices are numbered 0 to {ndevices - 1} in a scale unit of {ndevices}, but "
            f"{len(outside)} op instances are assigned to device(s) {devices}:\n"
            f"{_listing(g, outside)}\nAssign them to a device below {ndevices}, or check "
            f"with the number of devices the plan is for."
        )


def _check_shapes(g: IRGraph, op: Op, bound_by: dict[Hashable, Any]) -> None:
    """``bound_by``: the output shapes of earlier binds of one annotation to the same
    shapes and plain keyword arguments (the parts of one split, repeated layers)."""
    if op.anno is None:
        return
    shapes = [x.shape if isinstance(x, SubTensor) else None for x in op.inputs]
    if tuple(shapes) != tuple(op.anno.input_shapes):
        raise PlanCheckError(
            f"{g.describe(op)}: its annotation is bound to the input shapes "
            f"{list(op.anno.input_shapes)} but the op reads pieces of shapes {shapes}; the op "
            f"was edited inconsistently (partition ops with graph.partition, which keeps "
            f"pieces and annotations in step)"
        )
    kwargs = _plain_key(op.kwargs)
    key = None if kwargs is None else (id(op.anno.anno), tuple(shapes), kwargs)
    output_shapes = bound_by.get(key) if key is not None else None
    if output_shapes is None:
        try:
            output_shapes = op.anno.anno.bind(shapes, op.kwargs).output_shapes
        except AnnotationError as e:
            raise PlanCheckError(f"{g.describe(op)} reads pieces of shapes {shapes} that its "
                                 f"annotation rejects: {e}") from None
        if key is not None:
            bound_by[key] = output_shapes
            bound_by[("anno", id(op.anno.anno))] = op.anno.anno  # keeps the id taken
    outs = list(tensors_in(op.outputs))
    if len(outs) != len(output_shapes):
        return  # e.g. an in-place op annotated with the tensor it writes
    for k, (want, piece) in enumerate(zip(output_shapes, outs, strict=True)):
        if want is not None and not _same_shape(want, piece.shape):
            raise PlanCheckError(
                f"{g.describe(op)}: its annotation gives output {k} the shape {list(want)} "
                f"for the pieces it reads ({shapes}), but it writes the piece {piece} of shape "
                f"{list(piece.shape)}; the op was edited inconsistently (partition ops with "
                f"graph.partition, which keeps pieces and annotations in step)"
            )


def written_by(g: IRGraph, op: Op) -> list[tuple[SubTensor, ValueKey]]:
    """The pieces ``op`` writes, each with its value key (see `nnscaler.graph.pieces`)."""
    results = len(list(tensors_in(op.outputs)))
    return [(piece, g.value_key(op, k) if k < results else ())
            for k, piece in enumerate(op.output_tensors())]


def _check_pieces(g: IRGraph) -> None:
    written: dict[FullTensor, list[SubTensor]] = {}
    keys: dict[FullTensor, list[ValueKey]] = {}
    writers: dict[FullTensor, list[Op]] = {}

    covered: set[tuple[FullTensor, Any, int]] = set()  # (full, box, pieces written then)

    def need(piece: SubTensor, reader: Op | str) -> None:
        if piece.full.is_leaf:
            return
        pieces = written.get(piece.full, [])
        # pieces are only added: a box formed by the first n pieces is formed again
        key = (piece.full, piece.indmap, len(pieces))
        if key in covered:
            return
        found = cover(piece.indmap, pieces, keys.get(piece.full, []))
        if not isinstance(found, Gap):
            covered.add(key)
        else:
            reader = g.describe(reader) if isinstance(reader, Op) else reader
            ops = writers.get(piece.full, [])
            before = "\n".join(f"  {g.describe(w)} writes "
                               f"{', '.join(str(t) for t in w.output_tensors() if t.full is piece.full)}"
                               for w in ops[:_LISTED]) or "  (none)"
            producers = [p for p in g.producers(piece.full) if p not in ops]
            after = ("\nops that write it later (they must run before its readers): "
                     + ", ".join(f"#{p.oid}" for p in producers)) if producers else ""
            raise PlanCheckError(
                f"{reader} reads the piece {piece} of {piece.full}, but the pieces written "
                f"before it do not form it at {found}.\nWritten before:\n{before}{after}\n"
                f"Every piece an op reads must be covered by pieces that earlier op instances "
                f"write (their value parts summing to the whole): partition and replicate "
                f"the producer so that all its parts remain, or do not remove op instances."
            )

    for op in g.ops:
        for piece in op.input_tensors():
            need(piece, op)
        for piece, key in written_by(g, op):
            written.setdefault(piece.full, []).append(piece)
            keys.setdefault(piece.full, []).append(key)
            writers.setdefault(piece.full, []).append(op)
    for piece in g.output_tensors():
        need(piece, "the graph's output")
