"""``ComputeConfig(zero_stage='auto')``: autodist chooses the ZeRO stage.

A stage changes what each weight piece costs, not the ops: the bytes it holds (docs/zero.md's
table) and the communication of its gradient and, at stage 3, of its gathers
(`CostModel._weight_bytes`, `CostModel._zero_comm`). The profile, the traced graph and
the constraints are shared; each stage the config allows (`ComputeConfig.zero_stages`) gets
its own cost model and its own search, because a stage that frees memory can make a plan
with less splitting fit (a cheaper plan, not the same plan re-costed). With
``plan_ngpus='auto'`` every unit size is searched at every stage.

Stages are compared like meshes (`mesh`): by the estimated time per batch (the step time
over the data-parallel replicas), then by the memory per device, then the lower stage;
a stage with no plan under the limit ranks after every stage with one, by the memory it
would need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from nnscaler_policy_autodist.spmd import NoPlanFits

__all__ = ["StageEstimate", "choose_stage", "rank_stages"]


@attrs.frozen
class StageEstimate:
    """The best plan found at one ZeRO ``stage``: ``step_time`` (seconds; None when no
    plan fits the limit), ``time_per_batch`` (over the ``replicas``) and ``memory``
    (bytes per device, the most of any pipeline stage; or the least any plan needs)."""

    stage: int
    step_time: float | None
    memory: float
    replicas: int = 1
    unit: int | None = None

    @property
    def fits(self) -> bool:
        return self.step_time is not None

    @property
    def time_per_batch(self) -> float | None:
        return None if self.step_time is None else self.step_time / self.replicas

    def describe(self, limit: float | None) -> str:
        gb = self.memory / 1024**3
        if not self.fits:
            over = "" if limit is None else f" (limit {limit / 1024**3:.4f} GB)"
            return f"stage {self.stage}: no plan fits, needs {gb:.4f} GB per device{over}"
        unit = "" if self.unit is None else f", unit of {self.unit}"
        return (f"stage {self.stage}: {self.step_time * 1e3:.3f} ms per step"
                f"{unit}, {gb:.4f} GB per device")


def rank_stages(estimates: Sequence[StageEstimate]) -> list[StageEstimate]:
    """Best first: those that fit by time per batch, memory and stage; then the rest by
    the memory they need."""
    fit = sorted((e for e in estimates if e.fits),
                 key=lambda e: (e.time_per_batch, e.memory, e.stage))
    rest = sorted((e for e in estimates if not e.fits), key=lambda e: (e.memory, e.stage))
    return fit + rest


def choose_stage(stages: Sequence[int], search: Callable[[int], tuple[Any, ...]],
                 runtime: int, limit: float | None) -> tuple[int, tuple[Any, ...],
                                                             tuple[StageEstimate, ...]]:
    """Search at each of ``stages``; ``search(stage)`` returns ``(unit, pipe, problems,
    solutions, meshes)`` or raises `NoPlanFits`. Returns the best stage, its search's
    result and every stage's estimate, best first."""
    found: dict[int, tuple[Any, ...]] = {}
    estimates = []
    for z in stages:
        try:
            found[z] = search(z)
        except NoPlanFits as e:
            estimates.append(StageEstimate(z, None, e.need))
            continue
        n, pipe, _, sols, _ = found[z]
        estimates.append(StageEstimate(z, pipe.step_time, max(s.mem for s in sols),
                                       runtime // n, n))
    ranked = tuple(rank_stages(estimates))
    if not ranked[0].fits:
        e = NoPlanFits(ranked[0].memory, limit or 0.0)
        e.add_note(f"zero_stage='auto': no ZeRO stage of {list(stages)} fits; the least "
                   f"memory is needed at stage {ranked[0].stage}")
        raise e
    return ranked[0].stage, found[ranked[0].stage], ranked
