"""The layout planner: ``plan(src, dst)`` returns the cheapest plan it finds, as steps.

Pure and cached: the result depends only on the two layouts and the registered
primitives. How it searches:

1. *Count graph.* A node is a tuple of counts ``(r, v, d_0, ...)`` of the same shape.
   An edge moves a factor ``k`` of the device grid from one axis to another (``V->R``,
   ``V->D``, ``D->R``, ``D->D``, ``R->D``, ``R->V``, ``D->V``); it is labelled with the
   cheapest registered primitive that declares that transition, and costs what that
   primitive says for the piece size at the node. Dijkstra runs forward from ``src``'s
   counts over ``src``'s devices and backward from ``dst``'s counts over ``dst``'s.
2. *Canonical realization.* An edge acts on the low digit of the source axis: devices
   that differ only there form a group, ordered by that digit, and member ``m`` gets
   digit ``m`` as the new low digit of the target axis. This fixes the device order
   after each step (forward from ``src``) and the device order each step needs (backward
   from ``dst``).
3. *Bridge.* A candidate plan runs forward to some counts ``C_s``, bridges to counts
   ``C_t`` on the destination devices, and runs backward-realized steps to ``dst``.
   With equal counts the bridge is free when both descriptions are equivalent (same piece
   on every device, same part groups), otherwise a ``move`` that permutes whole pieces.
   Between different device sets the bridge may also be a ``move`` that fetches boxes
   (from a layout without value parts), or a ``broadcast`` of each chunk. The general
   fallback is one ``move`` from ``src`` straight to ``dst`` (it sums value parts).
4. Candidates are tried in order of a lower bound on their cost; the cheapest plan wins.
   A ``move`` often moves as few elements as the collective it could replace, so ties go
   to plans with fewer ``move`` steps, then to fewer steps.

Costs are elements sent or received by the busiest device (see ``Primitive.cost``).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from nnscaler.layout.layout import Box, Layout, LayoutError, ravel, unravel
from nnscaler.layout.primitives import validate_primitive
from nnscaler.layout.steps import Group, Plan, Primitive, Step
from nnscaler.registry import Registry, active_registry

__all__ = ["plan"]

Counts = tuple[int, ...]
_R, _V = 0, 1  # axis indices in counts / coordinates; D dims follow from 2


def _kind(axis: int) -> str:
    return "R" if axis == _R else "V" if axis == _V else "D"


def _edge_params(a: int, b: int) -> dict[str, int]:
    if a >= 2 and b >= 2:
        return {"src_dim": a - 2, "dst_dim": b - 2}
    if a >= 2:
        return {"dim": a - 2}
    if b >= 2:
        return {"dim": b - 2}
    return {}


def _divisors(n: int) -> list[int]:
    return [k for k in range(2, n + 1) if n % k == 0]


def _piece_numel(shape: tuple[int, ...], counts: Counts) -> int:
    return math.prod(s // c for s, c in zip(shape, counts[2:]))


def _key(cost: float, steps: int) -> tuple[float, int]:
    return (round(cost, 6), steps)


@attrs.frozen
class _Edge:
    """Move a factor ``k`` from axis ``a`` to axis ``b`` with primitive ``prim``."""

    a: int
    b: int
    k: int
    prim: Primitive
    cost: float

    @property
    def params(self) -> dict[str, int]:
        return _edge_params(self.a, self.b)


class _Registry:
    """A snapshot of the registered primitives, indexed for the search."""

    def __init__(self, items: tuple[tuple[str, Primitive], ...]) -> None:
        self.items = items
        self.by_name = dict(items)
        self.by_transition: dict[str, list[Primitive]] = defaultdict(list)
        for name, prim in items:
            if prim.name != name:
                raise LayoutError(
                    f"primitive {prim!r} is registered as {name!r} but its name is "
                    f"{prim.name!r}; steps and adjoints refer to primitives by name. Fix: "
                    f"registry.register(prim.name, prim)."
                )
            if prim.transition is not None:
                self.by_transition[prim.transition].append(prim)

    def adjoint_of(self, prim: Primitive) -> Primitive:
        try:
            return self.by_name[prim.adjoint]
        except KeyError:
            raise LayoutError(
                f"primitive {prim.name!r} names {prim.adjoint!r} as its adjoint, but no "
                f"primitive of that name is registered (registered: "
                f"{sorted(self.by_name)}). Fix: register {prim.adjoint!r} too."
            ) from None

    def cheapest(self, transition: str, group: Group, numel: int, **params: Any):
        best: tuple[float, Primitive] | None = None
        for prim in self.by_transition.get(transition, ()):
            cost = prim.cost(group, numel, **params)
            if best is None or round(cost, 6) < round(best[0], 6):
                best = (cost, prim)
        return best


# ---------------------------------------------------------------------------------------
# The count graph
# ---------------------------------------------------------------------------------------


def _edges_from(
    counts: Counts, shape: tuple[int, ...], prims: _Registry
) -> Iterable[tuple[_Edge, Counts]]:
    numel = _piece_numel(shape, counts)
    for a, b in itertools.permutations(range(len(counts)), 2):
        if counts[a] == 1:
            continue
        transition = f"{_kind(a)}->{_kind(b)}"
        if transition not in prims.by_transition:
            continue
        for k in _divisors(counts[a]):
            if b >= 2 and shape[b - 2] % (counts[b] * k):
                continue
            found = prims.cheapest(transition, Group.of(range(k)), numel, **_edge_params(a, b))
            if found is None:
                continue
            new = list(counts)
            new[a] //= k
            new[b] *= k
            yield _Edge(a, b, k, found[1], found[0]), tuple(new)


def _edges_into(
    counts: Counts, shape: tuple[int, ...], prims: _Registry
) -> Iterable[tuple[_Edge, Counts]]:
    for a, b in itertools.permutations(range(len(counts)), 2):
        transition = f"{_kind(a)}->{_kind(b)}"
        if counts[b] == 1 or transition not in prims.by_transition:
            continue
        for k in _divisors(counts[b]):
            prev = list(counts)
            prev[a] *= k
            prev[b] //= k
            if a >= 2 and shape[a - 2] % prev[a]:
                continue
            numel = _piece_numel(shape, tuple(prev))
            found = prims.cheapest(transition, Group.of(range(k)), numel, **_edge_params(a, b))
            if found is not None:
                yield _Edge(a, b, k, found[1], found[0]), tuple(prev)


def _dijkstra(
    start: Counts, neighbours: Callable[[Counts], Iterable[tuple[_Edge, Counts]]]
) -> tuple[dict[Counts, tuple[float, int]], dict[Counts, tuple[Counts, _Edge] | None]]:
    dist: dict[Counts, tuple[float, int]] = {start: (0.0, 0)}
    via: dict[Counts, tuple[Counts, _Edge] | None] = {start: None}
    tie = itertools.count()
    heap = [(_key(0.0, 0), next(tie), start)]
    done: set[Counts] = set()
    while heap:
        _, _, node = heapq.heappop(heap)
        if node in done:
            continue
        done.add(node)
        cost, steps = dist[node]
        for edge, nxt in neighbours(node):
            cand = (cost + edge.cost, steps + 1)
            if nxt not in dist or _key(*cand) < _key(*dist[nxt]):
                dist[nxt] = cand
                via[nxt] = (node, edge)
                heapq.heappush(heap, (_key(*cand), next(tie), nxt))
    return dist, via


@functools.lru_cache(maxsize=4096)
def _paths(start: Counts, shape: tuple[int, ...], forward: bool, items: tuple) -> tuple:
    """`_dijkstra` from ``start`` forward (or backward): of counts, shape, primitives only."""
    step, prims = (_edges_from if forward else _edges_into), _Registry(items)
    return _dijkstra(start, lambda c: step(c, shape, prims))


# ---------------------------------------------------------------------------------------
# Realization: device groups and device orders
# ---------------------------------------------------------------------------------------


def _with(layout: Layout, counts: Counts, devices: Iterable[int]) -> Layout:
    return Layout(
        shape=layout.shape, r=counts[0], v=counts[1], d=counts[2:], devices=tuple(devices)
    )


def _moved(x: tuple[int, ...], edge: _Edge) -> tuple[int, ...]:
    hi, lo = divmod(x[edge.a], edge.k)
    y = list(x)
    y[edge.a] = hi
    y[edge.b] = x[edge.b] * edge.k + lo
    return tuple(y)


def _after_counts(counts: Counts, edge: _Edge) -> Counts:
    new = list(counts)
    new[edge.a] //= edge.k
    new[edge.b] *= edge.k
    return tuple(new)


def _apply(layout: Layout, edge: _Edge) -> tuple[tuple[Group, ...], Layout]:
    """The groups of ``edge`` on ``layout`` and the layout after it."""
    counts = layout.counts
    new_counts = _after_counts(counts, edge)
    members: dict[tuple[int, ...], list[int]] = {}
    devices = [0] * layout.ndevices
    for i, dev in enumerate(layout.devices):
        x = unravel(i, counts)
        hi, lo = divmod(x[edge.a], edge.k)
        members.setdefault(x[: edge.a] + (hi,) + x[edge.a + 1 :], [0] * edge.k)[lo] = dev
        devices[ravel(_moved(x, edge), new_counts)] = dev
    groups = tuple(Group.of(m) for _, m in sorted(members.items()))
    return groups, _with(layout, new_counts, devices)


def _unapply(after: Layout, edge: _Edge) -> Layout:
    """The layout that ``edge`` turns into exactly ``after``."""
    counts = list(after.counts)
    counts[edge.a] *= edge.k
    counts[edge.b] //= edge.k
    before = tuple(counts)
    devices = [
        after.devices[ravel(_moved(unravel(i, before), edge), after.counts)]
        for i in range(after.ndevices)
    ]
    return _with(after, before, devices)


def _rows(layout: Layout) -> dict[tuple[int, ...], list[tuple[int, ...]]]:
    """Part groups by chunk: ``chunk -> [devices of replica r over v, for each r]``."""
    rows: dict[tuple[int, ...], list[tuple[int, ...]]] = defaultdict(list)
    per_row: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, dev in enumerate(layout.devices):
        x = unravel(i, layout.counts)
        per_row[(x[0], *x[2:])].append(dev)
    for key in sorted(per_row):
        rows[key[1:]].append(tuple(per_row[key]))
    return rows


def _equivalent(p: Layout, q: Layout) -> bool:
    """Same piece on every device and the same part groups: a free relabelling."""
    if p.counts != q.counts or set(p.devices) != set(q.devices):
        return False
    rp, rq = _rows(p), _rows(q)
    return all({frozenset(r) for r in rp[c]} == {frozenset(r) for r in rq[c]} for c in rq)


def _step(
    prims: _Registry,
    prim: Primitive,
    groups: tuple[Group, ...],
    params: Mapping[str, Any],
    before: Layout,
    after: Layout,
) -> Step:
    cost = max((prim.cost(g, before.piece_numel, **params) for g in groups), default=0.0)
    return Step(
        primitive=prim,
        adjoint=prims.adjoint_of(prim),
        groups=groups,
        params=tuple(params.items()),
        before=before,
        after=after,
        cost=cost,
    )


def _forward_steps(src: Layout, edges: list[_Edge], prims: _Registry) -> tuple[list[Step], Layout]:
    steps, layout = [], src
    for edge in edges:
        groups, after = _apply(layout, edge)
        steps.append(_step(prims, edge.prim, groups, edge.params, layout, after))
        layout = after
    return steps, layout


def _backward_steps(dst: Layout, edges: list[_Edge], prims: _Registry) -> tuple[list[Step], Layout]:
    layouts = [dst]
    for edge in reversed(edges):
        layouts.append(_unapply(layouts[-1], edge))
    layouts.reverse()
    steps = []
    for edge, before, after in zip(edges, layouts, layouts[1:]):
        groups, _ = _apply(before, edge)
        steps.append(_step(prims, edge.prim, groups, edge.params, before, after))
    return steps, layouts[0]


# ---------------------------------------------------------------------------------------
# Bridges
# ---------------------------------------------------------------------------------------


def _full_box(shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((0, s) for s in shape)


def _move_step(
    prims: _Registry,
    move: Primitive,
    src: tuple[int, ...],
    dst: tuple[int, ...],
    transfers: list[tuple[int, Box, int, Box]],
    before: Layout,
    after: Layout,
) -> Step:
    params = {
        "transfers": tuple(transfers),
        "in_shapes": (before.piece_shape,) * len(src),
        "out_shapes": (after.piece_shape,) * len(dst),
    }
    return _step(prims, move, (Group(src, dst),), params, before, after)


def _permute_bridge(p: Layout, q: Layout, move: Primitive, prims: _Registry) -> Step | None:
    """Whole pieces from ``p`` to ``q`` (equal counts): each part group of ``q`` gets the
    parts of one part group of ``p`` with the same chunk; devices keep what they can."""
    source: dict[int, int] = {}
    prow = _rows(p)
    for chunk, qrows in _rows(q).items():
        free = list(prow[chunk])
        for qrow in qrows:
            best = max(range(len(free)), key=lambda j: (len(set(free[j]) & set(qrow)), -j))
            prow_sel = free.pop(best)
            common = set(prow_sel) & set(qrow)
            rest = iter([x for x in prow_sel if x not in common])
            for dev in qrow:
                source[dev] = dev if dev in common else next(rest)
    fixed = {dev for dev, src in source.items() if dev == src}
    dst = tuple(dev for dev in q.devices if dev not in fixed)
    if not dst:
        return None
    src = tuple(dev for dev in p.devices if dev not in fixed)
    spos = {dev: i for i, dev in enumerate(src)}
    box = _full_box(p.piece_shape)
    transfers = [(spos[source[dev]], box, j, box) for j, dev in enumerate(dst)]
    return _move_step(prims, move, src, dst, transfers, p, q)


def _overlap(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(x0 < x1 for x0, x1 in out) else None


def _local(box: Box, origin: Box) -> Box:
    return tuple((x0 - o0, x1 - o0) for (x0, x1), (o0, _) in zip(box, origin))


def _numel(box: Box) -> int:
    return math.prod(x1 - x0 for x0, x1 in box)


def _reshard_bridge(p: Layout, q: Layout, move: Primitive, prims: _Registry) -> Step:
    """Any ``p`` to any ``q``: every device of ``q`` that owes its value (part 0 when ``q``
    has value parts) receives, from one replica of ``p``, every overlapping box of every
    part and sums them; other parts of ``q`` start at zero. The replica: the fewest
    elements from others, the least load on the busiest sender, the first from ``j``."""
    src, dst, size, stride = p.devices, q.devices, p.piece_shape, p.ndevices // p.r
    spos = {dev: i for i, dev in enumerate(src)}  # replica r: positions r * stride + ...
    load, transfers = defaultdict(int), []  # elements each device sent; the transfers
    for j, dev in enumerate(dst):
        if q.coords(dev)[1] != 0 or 0 in size:
            continue
        want = q.box(dev)
        chunks = itertools.product(*(range(a // n, -(-b // n)) for (a, b), n in zip(want, size)))
        pieces = []  # (position in a replica, box, overlap, elements): alike in replicas
        for v, chunk in itertools.product(range(p.v), list(chunks)):
            box = tuple((c * n, (c + 1) * n) for c, n in zip(chunk, size))
            if (ov := _overlap(box, want)) is not None:
                pieces.append((ravel((v, *chunk), p.counts[1:]), box, ov, _numel(ov)))
        # a replica without ``dev`` sends all, its busiest sender at least the largest piece
        floor = (sum(x[3] for x in pieces), max((x[3] for x in pieces), default=0))
        own = [spos[dev] // stride] if dev in spos else []
        best = None
        for r in own + [(j + t) % p.r for t in range(p.r) if [(j + t) % p.r] != own]:
            if best is not None and r not in own and best[0] < (*floor, (r - j) % p.r):
                break
            senders = [src[r * stride + x[0]] for x in pieces]
            sent = [(s, x[3]) for s, x in zip(senders, pieces) if s != dev]
            key = (sum(n for _, n in sent), max((load[s] + n for s, n in sent), default=0),
                   (r - j) % p.r)
            if best is None or key < best[0]:
                best = (key, senders)
        for s, (_, box, ov, n) in zip(best[1] if best else (), pieces):
            transfers.append((spos[s], _local(ov, box), j, _local(ov, want)))
            load[s] += n if s != dev else 0
    return _move_step(prims, move, src, dst, transfers, p, q)


def _broadcast_bridge(p: Layout, q: Layout, bcast: Primitive, prims: _Registry) -> Step:
    """Disjoint device sets, no value parts, same chunks: each chunk goes from one
    device of ``p`` to all devices of ``q`` that hold it (the others of ``p`` drop it)."""
    prow, qrow = _rows(p), _rows(q)
    groups = tuple(
        Group(tuple(d for row in prow[c] for d in row), tuple(d for row in qrow[c] for d in row))
        for c in sorted(qrow)
    )
    return _step(prims, bcast, groups, {}, p, q)


# ---------------------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------------------


def _walk(via: Mapping[Counts, tuple[Counts, _Edge] | None], node: Counts) -> list[_Edge]:
    """The edges met following ``via`` from ``node`` to the search's start."""
    edges = []
    while (entry := via[node]) is not None:
        node, edge = entry
        edges.append(edge)
    return edges


@attrs.frozen
class _Candidate:
    bound: float
    order: int
    kind: str  # "same", "reshard", "broadcast"
    c_src: Counts
    c_dst: Counts


def _search(src: Layout, dst: Layout, prims: _Registry) -> Plan:
    shape = src.shape
    fdist, fvia = _paths(src.counts, shape, True, prims.items)
    bdist, bvia = _paths(dst.counts, shape, False, prims.items)
    same_set = set(src.devices) == set(dst.devices)
    fresh = bool(set(dst.devices) - set(src.devices))  # some device must receive data
    moves = prims.by_transition.get("move", [])
    bcasts = prims.by_transition.get("broadcast", [])

    order = itertools.count()
    cands: list[_Candidate] = []
    if src.ndevices == dst.ndevices:
        for c in sorted(fdist.keys() & bdist.keys()):
            lower = _piece_numel(shape, c) if fresh else 0
            cands.append(_Candidate(fdist[c][0] + bdist[c][0] + lower, next(order), "same", c, c))
    if not same_set and (moves or bcasts):
        flat_src = [c for c in fdist if c[_V] == 1]
        flat_dst = [c for c in bdist if c[_V] == 1]
        disjoint = not set(src.devices) & set(dst.devices)
        for cs, ct in itertools.product(flat_src, flat_dst):
            base = fdist[cs][0] + bdist[ct][0] + (_piece_numel(shape, ct) if fresh else 0)
            if moves and cs != ct:
                cands.append(_Candidate(base, next(order), "reshard", cs, ct))
            if bcasts and disjoint and cs[2:] == ct[2:] and ct[_R] > cs[_R]:
                cands.append(_Candidate(base, next(order), "broadcast", cs, ct))

    best: Plan | None = None
    best_key: tuple[float, int, int] | None = None

    def consider(steps: list[Step]) -> None:
        # Ties go to collectives over point-to-point moves (fewer, larger messages),
        # then to fewer steps.
        nonlocal best, best_key
        p2p = sum(1 for s in steps if s.primitive.transition == "move")
        key = (*_key(sum(s.cost for s in steps), p2p), len(steps))
        if best_key is None or key < best_key:
            best, best_key = Plan(src=src, dst=dst, steps=tuple(steps)), key

    if moves:  # the general fallback: one move from src to dst
        consider([_cheapest_bridge(moves, _reshard_bridge, src, dst, prims)])

    heads: dict[Counts, tuple[list[Step], Layout]] = {}
    tails: dict[Counts, tuple[list[Step], Layout]] = {}
    for cand in sorted(cands, key=lambda c: (round(c.bound, 6), c.order)):
        if best_key is not None and round(cand.bound, 6) > best_key[0]:
            break
        if cand.c_src not in heads:
            heads[cand.c_src] = _forward_steps(src, _walk(fvia, cand.c_src)[::-1], prims)
        if cand.c_dst not in tails:
            tails[cand.c_dst] = _backward_steps(dst, _walk(bvia, cand.c_dst), prims)
        (head, p), (tail, q) = heads[cand.c_src], tails[cand.c_dst]
        if cand.kind == "same":
            if _equivalent(p, q):
                consider(head + tail)
                continue
            if not moves:
                continue
            bridge = _cheapest_bridge(moves, _permute_bridge, p, q, prims)
        elif cand.kind == "reshard":
            bridge = _cheapest_bridge(moves, _reshard_bridge, p, q, prims)
        else:
            bridge = _cheapest_bridge(bcasts, _broadcast_bridge, p, q, prims)
        consider(head + ([bridge] if bridge is not None else []) + tail)

    if best is None:
        if not prims.by_name:
            raise LayoutError(
                f"plan(): no communication primitive is registered, and {src} -> {dst} needs "
                f"communication. Fix: load the built-in plugin nnscaler.layout.primitives "
                f"(one of BUILTIN_PLUGINS), or pass a registry that holds primitives."
            )
        raise LayoutError(
            f"no plan moves a tensor from {src} to {dst} (shape {shape}) with the registered "
            f"primitives {sorted(prims.by_name)}: a change of device set or an unaligned "
            f"device order needs a primitive with transition 'move'. Fix: load the built-in "
            f"plugin nnscaler.layout.primitives, or register a primitive that declares the "
            f"missing transition."
        )
    return best


def _cheapest_bridge(
    candidates: list[Primitive],
    build: Callable[[Layout, Layout, Primitive, _Registry], Step | None],
    p: Layout,
    q: Layout,
    prims: _Registry,
) -> Step | None:
    best: Step | None = None
    for prim in candidates:
        step = build(p, q, prim, prims)
        if step is None:
            return None
        if best is None or round(step.cost, 6) < round(best.cost, 6):
            best = step
    return best


@functools.lru_cache(maxsize=2048)
def _plan_cached(src: Layout, dst: Layout, items: tuple[tuple[str, Primitive], ...]) -> Plan:
    return _search(src, dst, _Registry(items))


def _snapshot(registry: Any) -> tuple[tuple[str, Primitive], ...]:
    if registry is None:
        registry = active_registry("adapters")
    try:
        items = tuple(registry.items())
    except AttributeError:
        raise LayoutError(
            f"plan(): registry must be a nnscaler Registry or a mapping of name -> "
            f"Primitive, got {type(registry).__name__}. Fix: pass "
            f"get_plugin_manager().adapters or leave registry out."
        ) from None
    if not isinstance(registry, Registry):  # a plain mapping: nothing validated it yet
        for name, obj in items:
            try:
                validate_primitive(name, obj)
            except (TypeError, ValueError) as e:
                raise LayoutError(f"plan(): the registry's entry {name!r} ({obj!r}): {e}.") from None
    return items


def plan(src: Layout, dst: Layout, registry: Any = None) -> Plan:
    """The cheapest plan found that turns a tensor in layout ``src`` into layout ``dst``.

    ``registry`` holds the primitives the planner may compose: a
    `nnscaler.registry.Registry` (default: the plugin manager's adapter registry,
    whose entries were validated at registration) or a mapping ``name -> Primitive``
    (validated here: anything else is a `LayoutError`). The result is cached on
    the layouts and the registered primitives.
    """
    for name, layout in (("src", src), ("dst", dst)):
        if not isinstance(layout, Layout):
            raise LayoutError(
                f"plan(): {name} must be a Layout, got {type(layout).__name__} ({layout!r})."
            )
    if src.shape != dst.shape:
        raise LayoutError(
            f"plan(): src and dst describe tensors of different shapes: src {src!r}, dst "
            f"{dst!r}. A layout change keeps the full shape. Fix: build both layouts with "
            f"the same shape (a reshape is an op, not a layout change)."
        )
    return _plan_cached(src, dst, _snapshot(registry))
