"""Finding Megatron's tensor-parallel regions in a traced graph by structure.

A *region* is a set of ops that split together over the tensor-parallel devices with no
communication inside: it starts at *column* linears (weight split on its output
features; the activation read whole) and ends where the split is summed away, at a
*row* linear (weight split on its reduction dim, value-partial output) or at the
class-parallel cross-entropy. Nothing here looks at module names:

- a **seed** is an op that reads a 2-D parameter (``linear``, ``addmm``, ``matmul``, ...);
- its *column* split is grown: every op that reads a split tensor must take it split
  along the same dim (forward), and every split tensor an op reads must be written
  split by its producer (backward). Each op's split comes from its transform space, so
  a ``view`` into heads splits by whole heads, ``scaled_dot_product_attention`` by heads
  (grouped-query attention: by key/value groups), and the q, k and v projections join
  the region of the first one because attention reads all three split by heads;
- an op that cannot take a split tensor it reads (a norm over the hidden dim, a residual
  add whose other input is whole) makes the seed fail: the ops stay as they were;
- where backward growth reaches an op that cannot write the split (GPT-2's fused
  ``c_attn`` output cut by ``split``), the region starts there instead: the tensor is
  cut locally from its whole value, and the op stays outside;
- a seed whose column split fails is tried as a *row* seed (its activation split on the
  reduction dim), accepted when its backward growth splits attention or another
  parameter's matmul, i.e. when it closes a block (GPT-2's ``c_proj``).

Embeddings whose indices come from the forward's inputs are split by vocabulary
(Megatron's vocabulary-parallel embedding: value-partial output); an LM head is a column
seed whose region ends in the class-parallel cross-entropy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

from nnscaler.extend import (
    FullTensor,
    IRGraph,
    Op,
    Replicate,
    Split,
    SubTensor,
    TensorKind,
    Transform,
    ValuePartial,
)

__all__ = ["Region", "find_regions", "input_derived", "transforms", "track_sequence"]


@attrs.define(eq=False)
class Region:
    """Ops split together: ``choices`` maps each op to its transform; ``kind`` is
    ``'column'`` (a column seed closed by a row linear or the loss), ``'row'`` (grown
    back from a row linear) or ``'vocab'`` (an embedding split by vocabulary);
    ``cut``: tensors read split from a producer outside, cut from their whole value."""

    seed: Op
    kind: str
    choices: dict[Op, Transform]
    cut: list[FullTensor] = attrs.field(factory=list)


def transforms(op: Op, n: int) -> list[Transform]:
    """The legal splits of ``op`` in ``n`` parts (annotation and transform rules)."""
    if op.anno is None or op.opdef is None or op.is_opaque or op.opdef.collective:
        return []
    try:
        return list(op.anno.transform_space(n, rules=op.opdef.rules_for(op.anno)))
    except Exception:  # noqa: BLE001 - an op whose space cannot be listed is not split
        return []


def in_layouts(op: Op, t: Transform) -> Iterator[tuple[SubTensor, Any]]:
    """(tensor, layout) for every tensor argument ``t`` splits or replicates."""
    for k, x in enumerate(op.inputs):
        if isinstance(x, SubTensor) and k < len(t.inputs):
            yield x, t.inputs[k]


def out_layouts(op: Op, t: Transform) -> Iterator[tuple[SubTensor, Any]]:
    outs = op.output_tensors()
    yield from zip(outs, t.outputs)


def _is_weight(full: FullTensor) -> bool:
    return full.is_leaf and full.kind is not TensorKind.INPUT


def _param_2d(op: Op) -> FullTensor | None:
    for x in op.input_tensors():
        if x.full.is_leaf and x.full.kind is TensorKind.PARAMETER and x.full.ndim == 2:
            return x.full
    return None


def input_derived(graph: IRGraph) -> set[FullTensor]:
    """The tensors computed from the forward's inputs (token ids, labels), as opposed to
    constants and tensors made inside the model (positions from ``arange``)."""
    derived = {x.full for x in graph.input_tensors()}
    for op in graph.nodes():
        if any(x.full in derived for x in op.input_tensors()):
            derived.update(x.full for x in op.output_tensors())
    return derived


def _ident(tensor_anno: Any, dim: int) -> str | None:
    """The identifier of dim ``dim`` of an annotated tensor, when it is a single one."""
    dims = getattr(tensor_anno, "dims", None)
    if not dims or dim >= len(dims):
        return None
    idents = getattr(dims[dim], "idents", ())
    if len(idents) != 1 or idents[0].is_number:
        return None
    return idents[0].name


def track_sequence(graph: IRGraph, n: int, seq_dim: int = 1) -> tuple[
        dict[FullTensor, int], dict[Op, Transform]]:
    """Follow the sequence dim from the forward's inputs (dim ``seq_dim`` of each input
    with two or more dims) through the graph by the annotations' identifiers, as the
    ``data`` policy follows the batch: an output carries the sequence where it carries
    the identifier the input had there (attention's query length included, though it is
    never split inside attention).

    Returns the sequence dim of each tensor that carries it and, for each op that can be
    split along it, the transform that does (a ``view`` that merges batch and sequence
    cannot).
    """
    dims: dict[FullTensor, int] = {x.full: seq_dim for x in graph.input_tensors()
                                   if x.full.ndim > seq_dim}
    along: dict[Op, Transform] = {}
    for op in graph.nodes():
        reads = [(k, x) for k, x in enumerate(op.inputs)
                 if isinstance(x, SubTensor) and x.full in dims]
        if not reads or op.anno is None:
            continue
        expanded = op.anno.expanded
        names = {name for k, x in reads if k < len(expanded.inputs)
                 if (name := _ident(expanded.inputs[k], dims[x.full])) is not None}
        for x, t_anno in zip(op.output_tensors(), expanded.outputs):
            for d in range(x.full.ndim):
                if _ident(t_anno, d) in names:
                    dims[x.full] = d
                    break
        for t in transforms(op, n):
            if any(t.idx == k and t.dim == dims[x.full] for k, x in reads) and all(
                    not isinstance(lay, Split) or dims.get(x.full, lay.dim) == lay.dim
                    for x, lay in in_layouts(op, t)):
                along[op] = t
                break
    return dims, along


class _Grower:
    """Grows one region from a seed; ``fail`` ends it (the seed is not split)."""

    class Fail(Exception):
        pass

    def __init__(self, graph: IRGraph, n: int, taken: dict[Op, Transform]) -> None:
        self.graph = graph
        self.n = n
        self.taken = taken  # ops already in a region
        self.choices: dict[Op, Transform] = {}
        self.fixed: dict[FullTensor, Any] = {}  # activation -> layout in this region
        self.cut: list[FullTensor] = []

    def _consistent(self, op: Op, t: Transform) -> bool:
        for x, lay in (*in_layouts(op, t), *out_layouts(op, t)):
            if _is_weight(x.full):
                continue
            want = self.fixed.get(x.full)
            if want is not None and want != lay:
                return False
        return True

    def add(self, op: Op, t: Transform) -> None:
        if op in self.taken:
            if self.taken[op] != t:
                raise self.Fail(op)
            return
        self.choices[op] = t
        for x, lay in (*in_layouts(op, t), *out_layouts(op, t)):
            if not _is_weight(x.full) and x.full not in self.fixed:
                self.fixed[x.full] = lay

    def require(self, op: Op, full: FullTensor, lay: Any, backward: bool) -> None:
        """``op`` must read (forward) or write (backward) ``full`` as ``lay``."""
        if op in self.choices or op in self.taken:
            t = self.choices.get(op) or self.taken[op]
            pairs = out_layouts(op, t) if backward else in_layouts(op, t)
            if any(x.full is full and got != lay for x, got in pairs):
                raise self.Fail(op)
            return
        self.fixed.setdefault(full, lay)
        for t in transforms(op, self.n):
            pairs = out_layouts(op, t) if backward else in_layouts(op, t)
            if any(x.full is full and got == lay for x, got in pairs) and self._consistent(op, t):
                self.add(op, t)
                self.queue.append(op)
                return
        if backward:
            self.cut.append(full)  # cut from the producer's whole value
            return
        raise self.Fail(op)

    def grow(self, seed: Op, t: Transform) -> dict[Op, Transform]:
        self.queue: list[Op] = []
        self.add(seed, t)
        self.queue.append(seed)
        while self.queue:
            op = self.queue.pop()
            t = self.choices[op]
            for x, lay in in_layouts(op, t):
                if isinstance(lay, Split) and not x.full.is_leaf:
                    for producer in self.graph.producers(x):
                        self.require(producer, x.full, lay, backward=True)
            for x, lay in out_layouts(op, t):
                if isinstance(lay, Split):
                    for consumer in self.graph.consumers(x):
                        self.require(consumer, x.full, lay, backward=False)
        return self.choices


def _column(op: Op, t: Transform, weight: FullTensor) -> bool:
    ins = list(in_layouts(op, t))
    return (any(x.full is weight and isinstance(lay, Split) for x, lay in ins)
            and all(isinstance(lay, (Replicate, type(None))) for x, lay in ins
                    if not _is_weight(x.full))
            and all(isinstance(lay, Split) for _, lay in out_layouts(op, t)))


def _row(op: Op, t: Transform, weight: FullTensor) -> bool:
    ins = list(in_layouts(op, t))
    return (any(x.full is weight and isinstance(lay, Split) for x, lay in ins)
            and any(isinstance(lay, Split) for x, lay in ins if not _is_weight(x.full))
            and all(isinstance(lay, ValuePartial) for _, lay in out_layouts(op, t)))


def _closes_block(graph: IRGraph, choices: dict[Op, Transform], seed: Op) -> bool:
    """A row region is worth it when it splits attention (an op reading two split
    activations) or another parameter's matmul, not only reshapes."""
    for op, t in choices.items():
        if op is seed:
            continue
        if _param_2d(op) is not None:
            return True
        split_acts = [x for x, lay in in_layouts(op, t)
                      if isinstance(lay, Split) and not _is_weight(x.full)]
        if len(split_acts) >= 2:
            return True
    return False


def find_regions(graph: IRGraph, n: int) -> list[Region]:
    """The tensor-parallel regions of ``graph`` on ``n`` devices, in program order of
    their seeds (see the module docstring)."""
    regions: list[Region] = []
    taken: dict[Op, Transform] = {}
    derived = input_derived(graph)
    for op in graph.nodes():
        if op in taken:
            continue
        if op.name.endswith("embedding") and len(op.input_tensors()) >= 2:
            ids, table = op.input_tensors()[:2]
            if ids.full in derived and _is_weight(table.full):
                for t in transforms(op, n):
                    if (t.idx == 1 and t.dim == 0
                            and all(isinstance(lay, ValuePartial) for _, lay in out_layouts(op, t))):
                        taken[op] = t
                        regions.append(Region(op, "vocab", {op: t}))
                        break
            continue
        weight = _param_2d(op)
        if weight is None:
            continue
        for kind, test in (("column", _column), ("row", _row)):
            found = None
            for t in transforms(op, n):
                if not test(op, t, weight):
                    continue
                grower = _Grower(graph, n, taken)
                try:
                    choices = grower.grow(op, t)
                except _Grower.Fail:
                    continue
                if kind == "row" and not _closes_block(graph, choices, op):
                    continue
                found = Region(op, kind, choices, grower.cut)
                break
            if found is not None:
                taken.update(found.choices)
                regions.append(found)
                break
    return regions
