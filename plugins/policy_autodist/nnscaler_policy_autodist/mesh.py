"""The device mesh of ``plan_ngpus='auto'``: data-parallel replicas x unit size.

Given ``runtime_ngpus`` alone, autodist searches a plan at every unit size that divides
it (`unit_sizes`) and keeps the one with the best estimate (`rank_meshes`). Each scale
unit trains on its own batch of the traced shape, so a mesh of ``r`` replicas processes
``r`` such batches per step: meshes are compared by the estimated time per batch, the
step time divided by the replicas (the throughput of the job), then by the memory per
device, then by the smaller unit (less communication inside it when estimates tie).
"""

from __future__ import annotations

import attrs

__all__ = ["Mesh", "rank_meshes", "unit_sizes"]


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

    @property
    def fits(self) -> bool:
        return self.step_time is not None

    @property
    def time_per_batch(self) -> float | None:
        """The step time over the replicas: seconds per traced batch of the job."""
        return None if self.step_time is None else self.step_time / self.replicas

    def describe(self) -> str:
        where = f", {self.stages} stages" if self.stages > 1 else ""
        return f"{self.replicas} replica(s) x unit of {self.unit} device(s){where}"


def rank_meshes(meshes: list[Mesh]) -> list[Mesh]:
    """The meshes best first: those that fit by time per batch, memory and unit size;
    then those that do not, by the memory they need."""
    fit = sorted((m for m in meshes if m.fits),
                 key=lambda m: (m.time_per_batch, m.memory, m.unit))
    rest = sorted((m for m in meshes if not m.fits), key=lambda m: (m.memory, m.unit))
    return fit + rest
