"""From the pieces op instances hold to RVD layouts (`nnscaler.layout.Layout`).

A set of pieces of one full tensor, one per device, forms a layout when it is a grid:

- every device holds at most one piece;
- along each dim, the pieces' index ranges are ``d`` equal chunks that tile the dim;
- every piece has the same number of value parts ``v``, and every (chunk, part) cell is
  held by the same number ``r`` of devices (the replicas).

Devices are then listed in the layout's coordinate order ``(r, v, d_0, ...)``. Value parts
carry a *value key* (which splits made them, see `nnscaler.graph.pieces`); the parts
that one replica sums must come from the same splits.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import attrs

from nnscaler.codegen.errors import CodegenError
from nnscaler.ir import FullTensor, SubTensor
from nnscaler.layout import Layout, Plan
from nnscaler.layout import plan as make_plan
from nnscaler.layout.layout import ravel
from nnscaler.layout.steps import Group
from nnscaler.registry import active_registry

Box = tuple[tuple[int, int], ...]
ValueKey = tuple[tuple[Hashable, int], ...]


@attrs.frozen
class Placed:
    """One piece on one device: its box, its value part ``(p, n)`` and value key."""

    device: int
    box: Box
    valmap: tuple[int, int] = (0, 1)
    key: ValueKey = ()

    @classmethod
    def of(cls, device: int, piece: SubTensor, key: ValueKey = ()) -> Placed:
        return cls(device, tuple(piece.indmap), tuple(piece.valmap), tuple(key))

    def text(self) -> str:
        box = "[" + ", ".join(f"{a}:{b}" for a, b in self.box) + "]"
        part = f" part {self.valmap[0]}/{self.valmap[1]}" if self.valmap[1] > 1 else ""
        return f"device {self.device}: {box}{part}"


def _listing(placed: Sequence[Placed]) -> str:
    return "; ".join(p.text() for p in sorted(placed, key=lambda p: p.device))


def _grid(shape: tuple[int, ...], placed: Sequence[Placed]) -> Layout | str:
    """The layout of ``placed`` or the reason it is not a grid."""
    if not placed:
        return "no device holds a piece"
    by_dev: dict[int, Placed] = {}
    for p in placed:
        if p.device in by_dev:
            return (f"device {p.device} holds two pieces ({by_dev[p.device].text()} and "
                    f"{p.text()}), but a device holds at most one piece of a tensor")
        by_dev[p.device] = p
    d: list[int] = []
    step: list[int] = []
    for i, size in enumerate(shape):
        ranges = sorted({p.box[i] for p in placed})
        m = len(ranges)
        chunk = size // m if m else 0
        expected = [(k * chunk, (k + 1) * chunk) for k in range(m)]
        if size % m or ranges != expected:
            shown = ", ".join(f"{a}:{b}" for a, b in ranges)
            return (f"along dim {i} (size {size}) the pieces hold the ranges [{shown}], which "
                    f"are not equal chunks that tile the dim (uneven splits have no RVD "
                    f"layout: split the dim in a number of parts that divides {size})")
        d.append(m)
        step.append(chunk)
    nparts = sorted({p.valmap[1] for p in placed})
    if len(nparts) != 1:
        return (f"the pieces are split into different numbers of value parts {nparts}; every "
                f"piece of a layout is one of the same number of parts")
    v = nparts[0]
    cells: dict[tuple[tuple[int, ...], int], list[Placed]] = {}
    for p in placed:
        chunk_of = tuple(a // s if s else 0 for (a, _), s in zip(p.box, step, strict=True))
        cells.setdefault((chunk_of, p.valmap[0]), []).append(p)
    want = math.prod(d) * v
    counts = sorted({len(ps) for ps in cells.values()})
    if len(cells) != want or len(counts) != 1:
        held = ", ".join(
            f"chunk {list(c)}{f' part {part}' if v > 1 else ''} x{len(ps)}"
            for (c, part), ps in sorted(cells.items())
        )
        return (f"the pieces do not form a grid: {want} (chunk, value part) cells are needed, "
                f"each held by the same number of devices; held: {held}")
    r = counts[0]
    counts_rvd = (r, v, *d)
    devices = [0] * (r * v * math.prod(d))
    groups: dict[tuple[int, tuple[int, ...]], set[str]] = {}
    for (chunk_of, part), ps in cells.items():
        ordered = sorted(ps, key=lambda p: (repr(tuple(s for s, _ in p.key)), p.device))
        for rep, p in enumerate(ordered):
            devices[ravel((rep, part, *chunk_of), counts_rvd)] = p.device
            groups.setdefault((rep, chunk_of), set()).add(repr(tuple(s for s, _ in p.key)))
    if v > 1 and any(len(sigs) > 1 for sigs in groups.values()):
        return ("the value parts come from different splits of the producing op (along "
                "different identifiers), which do not sum to the value")
    return Layout(shape=shape, r=r, v=v, d=tuple(d), devices=tuple(devices))


def to_layout(full: FullTensor, placed: Sequence[Placed], *, what: str) -> Layout:
    """The layout of ``placed`` pieces of ``full``; a `CodegenError` that names
    ``what`` (e.g. which op writes them) when they are not a grid."""
    found = _grid(full.shape, placed)
    if isinstance(found, str):
        raise CodegenError(
            f"{what}: the pieces of {full} ({_listing(placed)}) have no RVD layout: {found}. "
            f"Every tensor must be spread over devices as replicas x value parts x equal "
            f"chunks per dim. Fix the plan: run one instance of each op per device "
            f"(graph.assign each instance to its own device) and split dims evenly."
        )
    return found


def placed_of(layout: Layout) -> list[Placed]:
    """The piece each device of ``layout`` holds."""
    out = []
    for dev in layout.devices:
        coords = layout.coords(dev)
        out.append(Placed(dev, layout.box(dev), (coords[1], layout.v)))
    return out


def restrict(layout: Layout, devices: Sequence[int]) -> Layout | None:
    """``layout`` on the devices of ``devices`` only, when those pieces are a layout by
    themselves (e.g. one replica of several); else None."""
    keep = set(devices)
    sub = [p for p in placed_of(layout) if p.device in keep]
    if len(sub) == layout.ndevices:
        return layout
    found = _grid(layout.shape, sub)
    return None if isinstance(found, str) else found


def fold_values(layout: Layout) -> Layout:
    """Value parts counted as replicas: the layout a parameter is *held* in when its first
    consumer reads it value-split (the split happens in an adapter)."""
    if layout.v == 1:
        return layout
    return Layout(shape=layout.shape, r=layout.r * layout.v, v=1, d=layout.d,
                  devices=layout.devices)


def shifted(layout: Layout, offset: int) -> Layout:
    """``layout`` over the devices ``d + offset`` (a scale unit's runtime ranks)."""
    if not offset:
        return layout
    return Layout(shape=layout.shape, r=layout.r, v=layout.v, d=layout.d,
                  devices=tuple(d + offset for d in layout.devices))


def shifted_plan(plan: Plan, offset: int) -> Plan:
    """``plan`` with every device ``d`` renamed ``d + offset``: its layouts, and the
    groups of its steps (parameters name group members by position, not by device)."""
    if not offset:
        return plan

    def group(g: Group) -> Group:
        return Group(tuple(d + offset for d in g.src), tuple(d + offset for d in g.dst))

    steps = tuple(attrs.evolve(step, groups=tuple(group(g) for g in step.groups),
                               before=shifted(step.before, offset),
                               after=shifted(step.after, offset)) for step in plan.steps)
    return Plan(src=shifted(plan.src, offset), dst=shifted(plan.dst, offset), steps=steps)


#: the module of nnscaler's own primitives: their costs read devices only to compare them
_BUILTIN_PRIMITIVES = "nnscaler.layout.primitives"


def relabel_invariant(registry: object = None) -> bool:
    """Whether the planner's plans do not depend on device numbers, only on their order:
    every primitive of ``registry`` (default: the active adapters) is one of nnscaler's
    own. The planner itself compares devices and orders them; the primitives' costs may
    read the devices of a group, and nnscaler's own only test them for equality. Then
    the plan between layouts shifted by ``k`` devices is `shifted_plan` of the
    plan between the layouts themselves (``tests/codegen/test_unit_plans.py``)."""
    reg = active_registry("adapters") if registry is None else registry
    return all(type(prim).__module__ == _BUILTIN_PRIMITIVES for _, prim in reg.items())


def unit_plan(plan: Plan, offset: int, *, invariant: bool | None = None) -> Plan:
    """The plan between ``plan``'s layouts shifted by ``offset`` devices (the same layout
    change in the scale unit that starts at runtime rank ``offset``): ``plan`` renamed
    where the planner is `relabel_invariant` (``invariant``: that, when the caller
    knows it), else planned anew. Planning costs milliseconds per adapter, and a program
    has ``adapters x scale units`` of them."""
    if not offset:
        return plan
    if invariant is None:
        invariant = relabel_invariant()
    if invariant:
        return shifted_plan(plan, offset)
    return make_plan(shifted(plan.src, offset), shifted(plan.dst, offset))


def replicated(shape: tuple[int, ...], devices: Sequence[int]) -> Layout:
    """``R(n)`` over ``devices``: every device holds the whole tensor."""
    return Layout(shape=shape, r=len(devices), v=1, d=(1,) * len(shape),
                  devices=tuple(devices))


_BIG_PARAMS = frozenset({"transfers", "in_shapes", "out_shapes"})


def describe_plan(plan: Plan, offset: int = 0) -> str:
    """``all_gather(dim=0) over [0, 1]; chunk(dim=1) over [0, 1]``; ``offset``: the
    description of `shifted_plan` ``(plan, offset)`` (its groups' devices renamed
    ``d + offset``, the rest alike), without making that plan."""

    def ranks(devices: tuple[int, ...]) -> str:
        return ", ".join(str(d + offset) for d in devices)

    parts = []
    for step in plan.steps:
        args = ", ".join(f"{k}={v!r}" for k, v in step.params if k not in _BIG_PARAMS)
        groups = ", ".join(
            f"[{ranks(g.src)}]" if g.src == g.dst else f"[{ranks(g.src)}] -> [{ranks(g.dst)}]"
            for g in step.groups
        )
        parts.append(f"{step.name}({args}) over {groups}")
    return "; ".join(parts)
