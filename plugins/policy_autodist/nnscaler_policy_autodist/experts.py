"""autodist's expert axis: how the ``moe_experts`` ops of a stage are split, costed and
searched.

A stage of ``k`` devices may split an MoE layer's experts (`nnscaler.extend.is_moe`) three
ways, as any op, by its transform space: by tokens (every device holds every expert), by
every expert's intermediate units (the ffn split: ``down_proj`` sharded, and
``gate_up_proj`` when the tracer holds it as its ``[E, 2, F, H]`` view, else replicated
and sliced), or by experts (expert parallelism: device ``p`` holds ``E / k`` of
them and exchanges tokens with an all-to-all). The model costs each from its profile and
the collectives its part op records (`CostModel.part_comm`; the all-to-alls by
`DeviceSpec.alltoall_time`, measured per group size on this machine). The expert split's
part is profiled as the op itself on one device's tokens and experts (`expert_part`).
Routing is not known when planning, so the profile routes evenly; ``pas_config['expert_imbalance']`` (``f >= 1``,
default 1.0) is the busiest device's token-expert pairs over the mean that the plan assumes:
under expert parallelism the busiest device receives and returns ``f`` times the mean
tokens (the all-to-alls move ``f`` times the even bytes) and runs ``f`` times the even
expert work, and a step waits for it. The other splits run the same pairs on every device
whatever the routing.

**The expert degree is an axis of the mesh** (`ExpertAxis`). A point of the mesh search is
a unit size ``n`` and an expert degree ``e``: ``e = 1`` plans with no MoE op split by its
experts (every stage count of the unit), ``e > 1`` with every MoE op whose expert count
``e`` divides split by experts over a stage of ``e`` devices, so the unit has ``n / e``
stages (a stage splits every op in as many parts as it has devices: the expert degree is
the stage's degree). Each point has its own lower bounds (`ExpertAxis.compute_floor`,
`ExpertAxis.memory_floor`): with ``e = 1`` every device of a stage holds each of its MoE
layers' ``gate_up_proj [E, 2F, H]`` whole (no other split shards it; one held as its
``[E, 2, F, H]`` view is sharded by the ffn split and not counted), which rules that point
out by memory when such experts dominate; with ``e > 1`` only the expert split's time counts. The
best plan of a unit is the best of its points, so the bounds of the points bound the unit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import attrs

from nnscaler.extend import Op, Transform, is_moe
from nnscaler_policy_autodist.twoaxis import part_call

__all__ = ["ExpertAxis", "Point", "best_point", "chosen_degree", "expert_degrees",
           "expert_part", "expert_split", "held_to_degree", "imbalanced", "search_axis"]

#: the registered names of the MoE op and of its ffn split's part op
MOE_EXPERTS = "nnscaler.ops.builtin.moe.moe_experts"
FFN_PARALLEL = "nnscaler.ops.builtin.moe.ffn_parallel_moe"

#: the expert dim of ``gate_up_proj`` and of ``down_proj`` as ``(input index, dim)`` (the
#: names ``allowed`` constraints use): either names the expert-parallel split
EXPERT_DIMS = frozenset({(3, 0), (4, 0)})


def expert_split(t: Transform | None) -> bool:
    """Whether ``t`` splits an MoE op by its experts (its part op exchanges tokens)."""
    return (t is not None and t.part_op is not None
            and (getattr(t, "idx", None), getattr(t, "dim", None)) in EXPERT_DIMS)


def expert_part(op: Op, t: Transform | None, num: int) -> tuple[list, dict] | None:
    """The work of one device of an expert split of ``op`` in ``num`` as a call of the
    op itself, which runs alone: its ``E / num`` experts and its ``T / num`` tokens, whose
    ``k`` pairs each, routed evenly (the profiler's made-up routing), are as many rows per
    expert as the device receives from every part under even routing; the routing's
    bookkeeping is its own tokens' too. ``(inputs, kwargs)``, or ``None`` for any other
    split. (The whole op's time over ``num`` would divide the call's fixed costs too.)"""
    if not is_moe(op) or not expert_split(t):
        return None
    inputs, kwargs = part_call(op, t, num, 0)
    return inputs, {k: v for k, v in kwargs.items() if k != "expert_counts"}


def imbalanced(op: Op, t: Transform | None, fw: float, bw: float,
               imbalance: float) -> tuple[float, float]:
    """The part's forward and backward seconds on the busiest device: an expert split's
    even-routing times times ``imbalance``; any other option's as profiled."""
    if imbalance == 1.0 or not is_moe(op) or not expert_split(t):
        return fw, bw
    return fw * imbalance, bw * imbalance


def held_to_degree(op: Op, options: list, e: int) -> list:
    """The options of ``op`` at a point of degree ``e`` of the expert axis: for an MoE
    op, none split by its experts when ``e = 1``; only those when ``e > 1`` and ``e``
    divides its experts (else its options as they are). Other ops keep theirs."""
    if not is_moe(op) or op.anno is None:
        return options
    if e == 1:
        return [t for t in options if not expert_split(t)]
    if experts_of(op) % e:
        return options
    return [t for t in options if expert_split(t)]


def experts_of(op: Op) -> int:
    """The expert count of an MoE op (``gate_up_proj``'s first dim)."""
    return int(op.anno.input_shapes[3][0])


def expert_degrees(ops: Sequence[Op], n: int, stage_counts: Sequence[int]) -> list[int]:
    """The expert degrees a unit of ``n`` devices can take: 1 (no expert split), and each
    stage degree ``n / s`` (``s`` an allowed stage count) above 1 that divides the expert
    count of some MoE op."""
    counts = {experts_of(op) for op in ops if is_moe(op) and op.anno is not None}
    out = [1]
    for s in stage_counts:
        k = n // s
        if k > 1 and any(c % k == 0 for c in counts) and k not in out:
            out.append(k)
    return out


def _gate_up_bytes(ops: Sequence[Op]) -> list[int]:
    """Bytes of each trained ``gate_up_proj [E, 2F, H]`` an MoE op reads: held whole by
    every split but the expert split. (One the tracer holds as the view ``[E, 2, F, H]``,
    `nnscaler.ops.builtin.moe.gate_up_view`, is split by the ffn split too: not counted.)"""
    seen: set = set()
    out = []
    for op in ops:
        if not is_moe(op):
            continue
        full = op.input_tensors()[3].full
        if full in seen or not full.requires_grad or len(op.anno.input_shapes[3]) != 3:
            continue
        seen.add(full)
        out.append(full.numel * full.dtype.itemsize)
    return out


class ExpertAxis:
    """The expert degrees of the mesh search: per degree, the cost model restricted to it
    (`restrict`) and its lower bounds."""

    def __init__(self, ops: Sequence[Op]) -> None:
        self.ops = list(ops)
        self.moe = [op for op in self.ops if is_moe(op) and op.anno is not None]
        self._gate_up = _gate_up_bytes(self.moe)

    @property
    def active(self) -> bool:
        """Whether the model has an MoE op (else the axis is the single degree 1)."""
        return bool(self.moe)

    def degrees(self, n: int, stage_counts: Sequence[int]) -> list[int]:
        return expert_degrees(self.moe, n, stage_counts) if self.active else [1]

    def stage_counts(self, n: int, e: int, counts: Sequence[int]) -> list[int]:
        """The stage counts of point ``(n, e)``: all of ``counts`` for ``e = 1``, else
        the one giving stages of ``e`` devices."""
        return list(counts) if e == 1 else [s for s in counts if n // s == e]

    def restrict(self, model, e: int):
        """``model`` (a `CostModel`) with its MoE ops held to degree ``e``'s splits
        (`held_to_degree`)."""
        if not self.active:
            return model
        out = copy.copy(model)
        out.expert_degree = e
        return out

    def memory_floor(self, weight_bytes, n: int, e: int, counts: Sequence[int]) -> float:
        """Extra bytes over the unit's ``n`` devices that point ``(n, e)`` holds at least,
        beyond every weight held once: with ``e = 1`` a stage of ``k = n / s`` devices
        holds ``k`` copies of each of its MoE layers' ``gate_up_proj`` (no split but the
        expert split shards it), so at least ``k - 1`` more of each, ``k`` the least stage
        degree of the allowed stage counts; ``weight_bytes(b)`` the bytes the model holds
        for a trained piece of ``b`` bytes."""
        if e != 1 or not self._gate_up:
            return 0.0
        k = min(n // s for s in counts) if counts else 1
        return (k - 1) * sum(weight_bytes(b) for b in self._gate_up)


@attrs.frozen
class Point:
    """What the search of one expert degree ``e`` of a unit found: ``plan`` (the
    pipeline search's ``(pipeline, problems, solutions)``), or ``need`` (the least bytes
    per device, when nothing fits), or neither (pruned by ``bound``)."""

    e: int
    plan: tuple | None = None
    need: float | None = None
    bound: float | None = None
    floor: bool = False  # ``need`` is the degree's memory floor (it was not searched)


def search_axis(degrees: Sequence[int], bound: Callable[[int], float],
                least: Callable[[int], float], limit: float | None, cap: float | None,
                search: Callable[[int, float | None], tuple | None]) -> list[Point]:
    """Branch and bound over the expert degrees of a unit: ``bound(e)`` a lower bound on
    the step of any plan of degree ``e``, ``least(e)`` on its bytes per device;
    ``search(e, cap)`` its best plan (``None`` when none beats ``cap`` seconds; raises
    `NoPlanFits`). Degrees are visited by their bound; one whose memory floor is above
    ``limit``, or whose bound is above ``cap`` or the best step found, is not searched.
    Every degree's `Point`, in the order visited."""
    from nnscaler_policy_autodist.mesh import SLACK
    from nnscaler_policy_autodist.spmd import NoPlanFits

    best: float | None = None
    out: list[Point] = []
    for e in sorted(degrees, key=lambda d: (bound(d), d)):
        if limit is not None and least(e) > limit:
            out.append(Point(e, need=least(e), floor=True))
            continue
        above = min((x for x in (cap, best) if x is not None), default=None)
        if above is not None and bound(e) > above * (1.0 + SLACK):
            out.append(Point(e, bound=bound(e)))
            continue
        try:
            plan = search(e, above)
        except NoPlanFits as err:
            out.append(Point(e, need=err.need))
            continue
        if plan is None:
            out.append(Point(e, bound=max(bound(e), above or 0.0)))
            continue
        out.append(Point(e, plan=plan))
        if best is None or plan[0].step_time < best:
            best = plan[0].step_time
    return out


def best_point(points: Sequence[Point]) -> Point | None:
    """The point of the fastest plan (ties: the lower degree), or ``None``."""
    found = [p for p in points if p.plan is not None]
    return min(found, key=lambda p: (p.plan[0].step_time, p.e), default=None)


def chosen_degree(problems: Sequence, solutions: Sequence) -> int:
    """The expert degree of a plan: its stages' degree when an MoE op is split by its
    experts, else 1."""
    for problem, sol in zip(problems, solutions):
        for op, opts, c in zip(problem.ops, problem.options, sol.choice):
            if is_moe(op) and expert_split(opts[c].transform):
                return problem.k
    return 1


# long: one unit's branch and bound over the axis, with the four outcomes a unit can have
def search_unit(axis: ExpertAxis, ops: Sequence[Op], n: int, model, cfg, limit: float | None,
                nmicros: int, outputs: Sequence, bounds, runtime: int, cap: float | None,
                memory_floor: bool = True, search_pipeline: Callable | None = None):
    """The best mesh of unit size ``n`` over its expert degrees (`search_axis`), as
    ``policy._search_meshes`` wants it: ``(mesh, plan)``; ``mesh`` is ``None`` when every
    degree that fits was pruned by ``cap``; a mesh that does not fit carries the least
    memory any degree needs (``pruned='memory'`` when that is only its floor).
    ``bounds`` is the policy's ``_Bounds`` (the computation and memory floors);
    ``search_pipeline`` the pipeline search of one point (default
    `pipeline.search_pipeline_bounded`)."""
    from nnscaler_policy_autodist.mesh import Mesh
    from nnscaler_policy_autodist.pipeline import search_pipeline_bounded, stage_counts

    search_pipeline = search_pipeline or search_pipeline_bounded
    replicas = runtime // n
    counts = stage_counts(n, cfg, len(ops), bounds.layers)
    degrees = axis.degrees(n, counts)
    models = {e: axis.restrict(model, e) for e in degrees}
    base = bounds.weights(model)

    def least(e: int) -> float:
        extra = axis.memory_floor(lambda b: model._weight_bytes(b)[0], n, e,
                                  axis.stage_counts(n, e, counts))
        return (base + extra) / n

    def key(e: int) -> int:  # the floors' cache: the unrestricted model's is key 0
        return e if axis.active else 0

    def bound(e: int) -> float:
        return min(bounds.step(models[e], n, s, key=key(e))
                   for s in axis.stage_counts(n, e, counts))

    def run(e: int, above: float | None) -> tuple | None:
        c = cfg if e == 1 else attrs.evolve(cfg, pipeline_nstages=n // e)
        return search_pipeline(ops, n, models[e], c, limit, nmicros, outputs,
                               bound=lambda s: bounds.step(models[e], n, s, key(e)), cap=above)

    points = search_axis(degrees, bound, least, limit if memory_floor else None, cap, run)
    best = best_point(points)
    if best is not None:
        pipe, _, sols = best.plan
        mesh = Mesh(n, replicas, pipe.step_time, max(s.mem for s in sols), pipe.nstages,
                    experts=best.e)
        return mesh, best.plan
    if any(p.bound is not None for p in points):
        return None, None
    floor_only = all(p.floor for p in points)
    need = min(p.need for p in points)
    return Mesh(n, replicas, None, need, pruned="memory" if floor_only else None), None
