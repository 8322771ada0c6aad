"""The device mesh of ``plan_ngpus='auto'``: data-parallel replicas x unit size.

Given ``runtime_ngpus`` alone, autodist searches a plan at every unit size that divides
it (`unit_sizes`) and keeps the one with the best estimate (`rank_meshes`). Each scale
unit trains on its own batch of the traced shape, so a mesh of ``r`` replicas processes
``r`` such batches per step: meshes are compared by the estimated time per batch, the
step time divided by the replicas (the throughput of the job), then by the memory per
device, then by the smaller unit (less communication inside it when estimates tie).

The search is pruned by lower bounds (`step_bound`, `search_meshes`): a unit size whose
bound on the time per batch is already above the best mesh found is not searched, and
the sizes are visited in the order of their bounds (the most promising first). A bound
never exceeds the estimate of any plan of its unit size, so the best mesh is never
skipped (a skipped mesh is recorded with ``pruned='time'`` and its bound).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

__all__ = ["Mesh", "rank_meshes", "search_meshes", "step_bound", "unit_sizes"]

#: a bound above the best by less than this (relative) is not trusted to prune: the
#: bound and the estimate sum the same figures in different orders
SLACK = 1e-9


def unit_sizes(runtime_ngpus: int) -> list[int]:
    """Every unit size that divides ``runtime_ngpus``, ascending."""
    return [n for n in range(1, runtime_ngpus + 1) if runtime_ngpus % n == 0]


@attrs.frozen
class Mesh:
    """One factorisation of the job and the estimate of its best plan: ``replicas``
    scale units of ``unit`` devices; ``step_time`` (seconds) and ``memory`` (bytes per
    device, the most of any stage); ``stages`` pipeline stages inside the unit. A mesh
    with no plan under the memory limit has ``step_time`` None and ``memory`` the least
    any of its plans needs."""

    unit: int
    replicas: int
    step_time: float | None
    memory: float
    stages: int = 1
    #: ``'time'``: not searched, its time per batch is at least ``bound`` (above the
    #: best mesh's); ``'memory'``: not searched, it needs at least ``memory`` bytes per
    #: device, above the limit
    pruned: str | None = None
    bound: float | None = None
    #: the expert-parallel degree (`nnscaler_policy_autodist.experts`): the MoE ops'
    #: experts are split over stages of this many devices (1: not split by experts)
    experts: int = 1

    @property
    def fits(self) -> bool:
        return self.step_time is not None

    @property
    def time_per_batch(self) -> float | None:
        """The step time over the replicas: seconds per traced batch of the job."""
        return None if self.step_time is None else self.step_time / self.replicas

    @property
    def searched(self) -> bool:
        return self.pruned is None

    def describe(self) -> str:
        where = f", {self.stages} stages" if self.stages > 1 else ""
        if self.experts > 1:
            where += f", expert degree {self.experts}"
        return f"{self.replicas} replica(s) x unit of {self.unit} device(s){where}"


def rank_meshes(meshes: list[Mesh]) -> list[Mesh]:
    """The meshes best first: those that fit by time per batch, memory and unit size;
    then those skipped by their time bound, by the bound; then those that do not fit,
    by the memory they need."""
    fit = sorted((m for m in meshes if m.fits),
                 key=lambda m: (m.time_per_batch, m.memory, m.unit))
    slow = sorted((m for m in meshes if m.pruned == "time"), key=lambda m: (m.bound, m.unit))
    rest = sorted((m for m in meshes if not m.fits and m.pruned != "time"),
                  key=lambda m: (m.memory, m.unit))
    return fit + slow + rest


def step_bound(compute: float, nstages: int, nmicros: int, share: float = 1.0) -> float:
    """A lower bound on the step time of ``nstages`` stages and ``nmicros`` micro-batches
    whose ops compute at least ``compute`` seconds per micro-batch in all (the sum over
    the ops of their fastest option's computation, at the stage's degree).

    The stages' times add up to at least ``compute``, so the slowest is at least
    ``compute / nstages`` and the 1F1B step, ``sum + (m - 1) * max``, is at least
    ``compute * (1 + (m - 1) / nstages)``; one stage runs ``m * compute``. With several
    processes per core (``share > 1``) the model lets a pipeline's stages run faster,
    but never faster than every rank's computation over the cores:
    ``m * compute / nstages`` (see `nnscaler_policy_autodist.pipeline.step_time`)."""
    if nstages == 1:
        return nmicros * compute
    if share > 1.0:
        return nmicros * compute / nstages
    return compute * (1.0 + (nmicros - 1) / nstages)


def search_meshes(units: Iterable[int], runtime: int, bound: Callable[[int], float],
                  search: Callable[[int, float | None], Mesh | None]) -> list[Mesh]:
    """Branch and bound over unit sizes: ``bound(n)``, a lower bound on the time per
    batch of any plan of unit size ``n``; ``search(n, cap)`` the mesh of its best plan,
    or ``None`` when no plan of it beats ``cap`` seconds per step (the best time per
    batch so far times its replicas; ``None``: no cap). Sizes are visited by their bound;
    one whose bound is above the best time per batch found is recorded as pruned, not
    searched. The meshes, in the order visited."""
    order = sorted(units, key=lambda n: (bound(n), n))
    best: float | None = None
    out: list[Mesh] = []
    for n in order:
        b, replicas = bound(n), runtime // n
        if best is not None and b > best * (1.0 + SLACK):
            out.append(Mesh(n, replicas, None, 0.0, pruned="time", bound=b))
            continue
        mesh = search(n, None if best is None else best * replicas)
        if mesh is None:  # nothing of it beats the best: pruned inside (stage counts)
            out.append(Mesh(n, replicas, None, 0.0, pruned="time", bound=max(b, best or b)))
            continue
        out.append(mesh)
        if mesh.fits and (best is None or mesh.time_per_batch < best):
            best = mesh.time_per_batch
    return out
