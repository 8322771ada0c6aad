"""Adapters of a plan and what they cost, from the pieces each device holds.

A planned graph says, for every op instance, the device it runs on and the pieces
(`SubTensor`) it reads and writes. Gathered over the instances of one
op, the pieces of one tensor on the devices form an RVD `Layout`
(`layout_of`). Following ``docs/internals/parallel-runtime.md``, an *adapter* runs
where an op's instances need a tensor in another layout than the one it is held in:

- an activation is held as its producer's instances wrote it;
- a forward input is replicated on every device of the scale unit (``R(n)``);
- a parameter, buffer or constant is held in its *canonical* layout: the layout its
  first consumer needs, value parts folded into replicas;
- every graph output must end replicated on every device.

The cost of an adapter is `nnscaler.layout.plan`'s estimate (elements the busiest
device sends or receives) in bytes, plus the same for its adjoint (the gradient's way
back) when the tensor requires grad and the op records gradients. `adapters` lists
the adapters of a planned graph; the ``tp`` policy uses the same arithmetic to choose.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import attrs

from nnscaler.anno import Placement, Reduce, Split, Transform, ValuePartial
from nnscaler.graph import IRGraph
from nnscaler.ir import FullTensor, Op, SubTensor, TensorKind, tensors_in
from nnscaler.layout import Layout, Plan, plan
from nnscaler.layout.layout import ravel

__all__ = [
    "AdapterCost",
    "adapter_cost",
    "adapters",
    "default_bytes_per_mac",
    "layout_of",
    "op_layouts",
    "op_work",
    "part_piece",
    "redundant_bytes",
    "replicated",
    "total_cost",
    "transform_pieces",
]


def replicated(full: FullTensor, ndevices: int) -> Layout:
    """``full`` whole on devices ``0 .. ndevices-1``: ``R(n)``."""
    return Layout(shape=full.shape, r=ndevices)


def layout_of(pieces: Iterable[tuple[int, SubTensor]]) -> Layout | None:
    """The RVD layout of one tensor held as ``(device, piece)`` pairs; ``None`` when the
    pieces do not form one (a device holding two different pieces, unequal chunks, chunks
    that do not cover a dim, value parts that are not ``0..v-1`` of ``v``, or chunks held by
    different numbers of devices).

    Replicas are numbered by device id, so ``R(2)`` over devices 1 and 0 lists ``[0, 1]``.
    """
    held: dict[int, SubTensor] = {}
    for device, piece in pieces:
        if held.setdefault(device, piece) != piece:
            return None
    if not held:
        return None
    full = next(iter(held.values())).full
    shape = full.shape
    d: list[int] = []
    chunk_of: list[dict[tuple[int, int], int]] = []
    for i, size in enumerate(shape):
        ranges = sorted({p.indmap[i] for p in held.values()})
        k = len(ranges)
        if size % k:
            return None
        step = size // k
        if ranges != [(j * step, (j + 1) * step) for j in range(k)]:
            return None
        d.append(k)
        chunk_of.append({r: j for j, r in enumerate(ranges)})
    values = {p.valmap for p in held.values()}
    v = next(iter(values))[1]
    if values != {(j, v) for j in range(v)}:
        return None
    groups: dict[tuple[int, ...], list[int]] = {}
    for device in sorted(held):
        p = held[device]
        key = (p.valmap[0], *(chunk_of[i][p.indmap[i]] for i in range(len(shape))))
        groups.setdefault(key, []).append(device)
    if len(groups) != v * math.prod(d):
        return None
    sizes = {len(devices) for devices in groups.values()}
    if len(sizes) != 1:
        return None
    r = sizes.pop()
    counts = (r, v, *d)
    order = [0] * (r * len(groups))
    for key, devices in groups.items():
        for replica, device in enumerate(devices):
            order[ravel((replica, *key), counts)] = device
    return Layout(shape=shape, r=r, v=v, d=tuple(d), devices=tuple(order))


def part_piece(x: SubTensor, layout: Placement | None, num: int, part: int) -> SubTensor:
    """The piece of ``x`` that part ``part`` of a ``num``-way split reads or writes, as
    [`IRGraph.partition`][nnscaler.IRGraph.partition] cuts it."""
    if isinstance(layout, Split):
        return x.split(layout.dim, num)[part]
    if isinstance(layout, ValuePartial):
        return x.value_split(num)[part]
    return x


def _itemsize(full: FullTensor) -> int:
    return full.dtype.itemsize


def adapter_cost(full: FullTensor, src: Layout | None, dst: Layout | None, *,
                 grad: bool) -> tuple[float, Plan | None]:
    """Bytes moved by the busiest device to bring ``full`` from ``src`` to ``dst``
    (forward, plus the adjoint when ``grad``), and the plan.

    Without a layout on one side (pieces that form no RVD layout) the estimate is the
    bytes of the whole tensor, each way, and the plan is ``None``.
    """
    if src is None or dst is None:
        once = full.numel * _itemsize(full)
        return (2 * once if grad else once), None
    if src == dst:
        return 0.0, Plan(src=src, dst=dst)
    return _planned_cost(src, dst, _itemsize(full), grad)


#: What one communicating step costs beyond its bytes (start-up latency, a kernel
#: launch), in bytes: so that one all-reduce beats a reduce-scatter + all-gather pair that
#: moves the same bytes.
STEP_LATENCY_BYTES = 1024 * 1024


def _plan_bytes(p: Plan, itemsize: int) -> float:
    talking = sum(1 for step in p.steps if step.cost > 0)
    return p.cost_bytes(itemsize) + talking * STEP_LATENCY_BYTES


@functools.lru_cache(maxsize=65536)
def _planned_cost(src: Layout, dst: Layout, itemsize: int, grad: bool) -> tuple[float, Plan]:
    # policies ask for the same (layout, layout) pairs many times (the tp lookahead)
    p = plan(src, dst)
    cost = _plan_bytes(p, itemsize)
    if grad and p.steps:
        cost += _plan_bytes(p.adjoint(), itemsize)
    return cost, p


#: What one multiply-accumulate costs, in bytes moved by a collective, on each kind of
#: device: a core of this project's CPU machines does ~45 G MAC/s while gloo moves ~2 GB/s
#: (cost bytes, latency included); a GPU does ~300 T MAC/s while NCCL over NVLink moves
#: ~300 GB/s. ``pas_config['tp_bytes_per_mac']`` overrides it.
BYTES_PER_MAC = {"cpu": 0.04, "cuda": 0.001}


def default_bytes_per_mac() -> float:
    """`BYTES_PER_MAC` of the device type the run will use
    (`nnscaler.runtime.device.device_type`)."""
    from nnscaler.runtime.device import device_type

    return BYTES_PER_MAC[device_type()]


def op_work(op: Op) -> float:
    """The multiply-accumulates of one forward call of ``op``, from its bound annotation:
    for a contraction (linear, matmul, einsum, conv: an input dim that the output does not
    keep and that two inputs share, or that is marked ``+``), the product of the output
    dims and the contracted ones; at least the numel of its biggest tensor (all there is
    to elementwise ops, norms, softmax, lookups and losses). An estimate: attention counts ``l*s*e*f`` per head
    where it does ``l*s*(e+f)``. 0 without an annotation."""
    anno = op.anno
    if anno is None:
        return 0.0
    return _work(anno.expanded, tuple(sorted(anno.sizes.items())), anno.input_shapes,
                 anno.output_shapes)


@functools.lru_cache(maxsize=4096)
def _work(expanded, sizes, input_shapes, output_shapes) -> float:  # noqa: ANN001
    size = dict(sizes)
    out_ids = {i.name for t in expanded.outputs for i in t.idents}
    readers: dict[str, int] = {}  # identifier -> how many inputs carry it
    contracted: set[str] = set()
    for t in expanded.inputs:
        for name in {i.name for i in t.idents}:
            readers[name] = readers.get(name, 0) + 1
        contracted |= {i.name for i in t.idents if i.reduce is Reduce.SUM}
    contracted |= {name for name, k in readers.items() if k >= 2}
    contracted -= out_ids
    shapes = [s for s in (*input_shapes, *output_shapes) if s is not None]
    biggest = max((math.prod(s) for s in shapes), default=0)
    if contracted:
        return float(max(biggest, math.prod(size.get(i, 1) for i in out_ids | contracted)))
    return float(biggest)


def redundant_bytes(full: FullTensor, layout: Layout) -> float:
    """Bytes of ``full`` held beyond one copy when every device holds its piece of
    ``layout`` (value parts count as whole pieces): 0 when sharded, ``(n-1)`` copies
    when replicated on ``n`` devices."""
    return float((layout.piece_numel * layout.ndevices - full.numel) * _itemsize(full))


@attrs.frozen(eq=False)
class AdapterCost:
    """Where the instances of ``op`` (``None``: the graph's output) read ``tensor`` in
    layout ``dst`` but it is held in ``src``. ``plan`` is ``None`` when the pieces form no
    RVD layout (then ``cost`` is the whole tensor's bytes, an estimate). ``cost`` is in
    bytes for the busiest device, forward plus backward when gradients flow."""

    op: Op | None
    tensor: FullTensor
    src: Layout | None
    dst: Layout | None
    plan: Plan | None
    cost: float

    @property
    def primitives(self) -> tuple[str, ...]:
        return () if self.plan is None else self.plan.names

    def __str__(self) -> str:
        where = "output" if self.op is None else f"op #{self.op.oid} {self.op.name}"
        how = "+".join(self.primitives) or "irregular move"
        return f"{where}: {self.tensor} {self.src} -> {self.dst} via {how} ({self.cost:g} B)"


def _groups(graph: IRGraph) -> list[tuple[Op, list[Op]]]:
    """The instances of each op (by origin), in program order of their first instance."""
    by_origin: dict[Op, list[Op]] = {}
    for op in graph.ops:
        by_origin.setdefault(graph.origin(op), []).append(op)
    return list(by_origin.items())


def adapters(graph: IRGraph, ndevices: int) -> list[AdapterCost]:
    """Every adapter a planned graph needs on a scale unit of ``ndevices`` devices, in
    program order (see the module docstring). Every op instance must be assigned."""
    held: dict[FullTensor, Layout | None] = {}
    written: dict[FullTensor, list[tuple[int, SubTensor]]] = {}
    for op in graph.ops:
        if op.device is None:
            raise ValueError(f"adapters: {graph.describe(op)} is not assigned to a device; "
                             f"cost a complete plan (graph.check(ndevices) passes)")
        for piece in op.output_tensors():
            written.setdefault(piece.full, []).append((op.device, piece))
    found: list[AdapterCost] = []
    seen: set[tuple[int, int, Layout | None]] = set()

    def source(full: FullTensor, need: Layout | None) -> Layout | None:
        if full not in held:
            if full.kind is TensorKind.INPUT:
                held[full] = replicated(full, ndevices)
            elif full.is_leaf:  # canonical: the first consumer's layout
                held[full] = None if need is None else need.replicated()
            else:
                held[full] = layout_of(written.get(full, []))
        return held[full]

    def read(op: Op | None, full: FullTensor, need: Layout | None, grad: bool) -> None:
        key = (-1 if op is None else op.oid, full.tid, need)
        if key in seen:
            return
        seen.add(key)
        src = source(full, need)
        cost, p = adapter_cost(full, src, need, grad=grad)
        if p is None or p.steps:
            found.append(AdapterCost(op, full, src, need, p, cost))

    for origin, instances in _groups(graph):
        reads = [inst.input_tensors() for inst in instances]
        for j in range(len(reads[0])):
            pieces = [(inst.device, r[j]) for inst, r in zip(instances, reads) if j < len(r)]
            full = pieces[0][1].full
            grad = full.requires_grad and not origin.no_grad
            read(origin, full, layout_of(pieces), grad)
    for piece in graph.output_tensors():
        if not piece.full.is_leaf:
            read(None, piece.full, replicated(piece.full, ndevices), piece.full.requires_grad)
    return found


def total_cost(found: Sequence[AdapterCost]) -> float:
    """The bytes all ``found`` adapters move (busiest device, summed)."""
    return float(sum(a.cost for a in found))


def transform_pieces(op: Op, t: Transform | None, num: int, part: int) -> list[SubTensor]:
    """The pieces part ``part`` of ``op`` reads, in `Op.input_tensors` order, when
    ``op`` is split by ``t`` in ``num`` parts (``None``: replicated). Tensors nested in a
    list or passed as keyword arguments are read whole, as ``partition`` leaves them."""
    out: list[SubTensor] = []
    for k, x in enumerate(op.inputs):
        if isinstance(x, SubTensor):
            out.append(x if t is None else part_piece(x, t.inputs[k], num, part))
        else:
            out.extend(tensors_in(x))
    out.extend(tensors_in(dict(op.kwargs)))
    return out


#: What a split op reads: (tensor, layout it needs, whether a gradient flows back).
Reads = tuple[tuple[FullTensor, Layout | None, bool], ...]
#: What a split op writes: (tensor, layout it leaves), outputs then in-place writes.
Writes = tuple[tuple[FullTensor, Layout | None], ...]


def _parts(x: SubTensor, layout: Placement | None, num: int) -> tuple[SubTensor, ...]:
    """`part_piece` of every part at once: ``x`` split once, not once per part."""
    if isinstance(layout, Split):
        return x.split(layout.dim, num)
    if isinstance(layout, ValuePartial):
        return x.value_split(num)
    return (x,) * num


def op_layouts(op: Op, t: Transform | None, num: int) -> tuple[Reads, Writes]:
    """The layouts ``op`` reads and writes when split by ``t`` in ``num`` parts (``None``:
    replicated): every input tensor with the layout its parts need, every output and every
    tensor written in place (a new version of an input) with the layout its parts leave.
    (The pieces of `transform_pieces` and `part_piece`, each tensor split once.)"""
    columns: list[tuple[SubTensor, ...]] = []  # per input tensor, its piece in each part
    for k, x in enumerate(op.inputs):
        if isinstance(x, SubTensor):
            columns.append((x,) * num if t is None else _parts(x, t.inputs[k], num))
        else:
            columns.extend((y,) * num for y in tensors_in(x))
    columns.extend((y,) * num for y in tensors_in(dict(op.kwargs)))
    reads = tuple(
        (x.full, layout_of(enumerate(columns[j])), x.full.requires_grad and not op.no_grad)
        for j, x in enumerate(op.input_tensors())
    )
    outs = list(tensors_in(op.outputs))
    placements = [None] * len(outs) if t is None else list(t.outputs)
    writes = [(x.full, layout_of(enumerate(_parts(x, lay, num))))
              for x, lay in zip(outs, placements)]
    written = {w[0] for w in writes}
    positions = {x: k for k, x in enumerate(op.inputs) if isinstance(x, SubTensor)}
    for before, after in op.mutations:
        if after.full in written:
            continue
        k = positions.get(before)
        lay = None if t is None or k is None else t.inputs[k]
        writes.append((after.full, layout_of(
            (p, SubTensor(full=after.full, indmap=b.indmap, valmap=b.valmap))
            for p, b in enumerate(_parts(before, lay, num)))))
    return reads, tuple(writes)
