"""Pipeline stages in code generation: which devices run which stage, and what crosses.

A policy cuts the graph into stages with
[`nnscaler.graph.IRGraph.staging`][nnscaler.IRGraph.staging] and places each stage's op instances on
a set of devices. Code generation then needs:

- the *pipeline devices*: the device sets of the stages. With ``p`` pipeline devices and
  ``S = p * v`` stages, stage ``s`` runs on device set ``s % p`` (the layout of
  ``docs/schedules.md``: ``v`` virtual stages per pipeline device). The sets are
  disjoint and of one size ``k`` (tensor parallelism inside a stage runs on ``k``
  devices);
- *lanes*: device ``i`` of one set (in sorted order) corresponds to device ``i`` of every
  other set. A tensor crossing a stage boundary keeps its layout and moves lane by lane
  (each device sends its piece to the device of the same lane of the next stage), and a
  parameter read by several stages is held in the layout of its first reader on every
  set that reads it, lane by lane, so that the copies hold the same pieces and their
  gradients sum (tied weights);
- the boundary tensors: every activation produced in a stage ``a`` and read in a later
  stage ``b`` (graph outputs are read by the last stage) is sent by stages ``a .. b-1``
  and received by ``a+1 .. b`` (a stage in between passes it on);
- the schedule: ``compute_config.pipeline`` (`nnscaler.config.PipelineConfig`:
  the scheduler's name over ``nmicros`` micro-batches), checked with
  `nnscaler.schedule.simulate`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from nnscaler.codegen.errors import CodegenError
from nnscaler.config import ComputeConfig, ComputeConfigError, PipelineConfig
from nnscaler.graph import IRGraph
from nnscaler.ir import FullTensor, Op
from nnscaler.layout import Layout
from nnscaler.schedule import Action, ScheduleError, get_schedule, simulate

if TYPE_CHECKING:
    from nnscaler.codegen.program_types import OpStep

__all__ = [
    "PipelinePlan",
    "StagePlan",
    "find_stages",
    "map_layout",
    "pipeline_settings",
]

def pipeline_settings(compute_config: ComputeConfig,
                      pipeline: PipelineConfig | Mapping[str, Any] | None = None
                      ) -> PipelineConfig:
    """The schedule of a staged graph: ``pipeline`` (a `PipelineConfig`, or a
    mapping with ``pipeline_nmicros`` / ``pipeline_scheduler`` over the compute config's
    ``pas_config``) or else ``compute_config.pipeline``; the micro-batch count is required."""
    if isinstance(pipeline, Mapping):
        try:
            pipeline = PipelineConfig.from_pas_config({**compute_config.pas_config, **pipeline})
        except ComputeConfigError as e:
            raise CodegenError(str(e)) from None
    elif pipeline is None:
        pipeline = compute_config.pipeline
    elif not isinstance(pipeline, PipelineConfig):
        raise CodegenError(f"pipeline must be a PipelineConfig or a dict with "
                           f"pipeline_nmicros and pipeline_scheduler, got {pipeline!r}")
    if pipeline.nmicros is None:
        raise CodegenError(
            "the plan cuts the graph into pipeline stages, but pas_config has no "
            "'pipeline_nmicros' (the number of micro-batches of each train_step); set "
            "ComputeConfig(pas_config={'pipeline_nmicros': m, ...})"
        )
    return pipeline


def map_layout(layout: Layout, src: Sequence[int], dst: Sequence[int]) -> Layout:
    """``layout`` (over devices of ``src``) moved lane by lane onto ``dst``."""
    if tuple(src) == tuple(dst):
        return layout
    lanes = {d: i for i, d in enumerate(src)}
    try:
        devices = tuple(dst[lanes[d]] for d in layout.devices)
    except KeyError:
        raise CodegenError(f"internal error: the layout {layout} is not on the devices "
                           f"{list(src)} of its stage") from None
    return Layout(shape=layout.shape, r=layout.r, v=layout.v, d=layout.d, devices=devices)


@attrs.define(eq=False)
class StagePlan:
    """One stage: its ``steps`` (in program order), the pipeline device (``group``) whose
    ``devices`` run it, the boundary tensors it receives from stage ``index - 1``
    (``inputs``) and sends to ``index + 1`` (``outputs``)."""

    index: int
    group: int
    devices: tuple[int, ...]
    steps: list[OpStep] = attrs.field(factory=list)
    inputs: list[FullTensor] = attrs.field(factory=list)
    outputs: list[FullTensor] = attrs.field(factory=list)


@attrs.define(eq=False)
class PipelinePlan:
    """The stages of a program, their device sets, the boundary tensors and the schedule
    (one action list per pipeline device)."""

    settings: PipelineConfig
    groups: list[tuple[int, ...]]
    stages: list[StagePlan]
    schedule: list[list[Action]] = attrs.field(factory=list)
    produced: dict[FullTensor, tuple[int, Layout]] = attrs.field(factory=dict)

    @property
    def nstages(self) -> int:
        """Pipeline devices (the schedule's ``nstages``)."""
        return len(self.groups)

    @property
    def nvirtual(self) -> int:
        return len(self.stages) // len(self.groups)

    @property
    def last(self) -> int:
        return len(self.stages) - 1

    def group_of(self, device: int) -> int | None:
        for g, devices in enumerate(self.groups):
            if device in devices:
                return g
        return None

    def lane_of(self, device: int) -> int:
        g = self.group_of(device)
        if g is None:
            raise CodegenError(f"internal error: device {device} runs no stage")
        return self.groups[g].index(device)

    def view(self, full: FullTensor, stage: int) -> Layout:
        """The layout of the boundary tensor ``full`` on ``stage``'s devices."""
        at, layout = self.produced[full]
        return map_layout(layout, self.stages[at].devices, self.stages[stage].devices)


def _stage_of(g: IRGraph, op: Op) -> int:
    stage = op.plan.stage
    if stage is None:
        raise CodegenError(
            f"{g.describe(op)} has no pipeline stage while other ops have one; cut the "
            f"whole graph with graph.staging(...) (ops added afterwards inherit the stage)"
        )
    return stage


def find_stages(g: IRGraph, plan_ngpus: int) -> PipelinePlan | None:
    """The stages of a staged graph and their device sets; None when the graph has no
    stage marks or a single stage (it then runs as one program)."""
    if all(op.plan.stage is None for op in g.ops):
        return None
    stage_of = [_stage_of(g, op) for op in g.ops]
    nstages = max(stage_of) + 1
    if nstages == 1:
        return None
    for k in range(1, len(stage_of)):
        if stage_of[k] < stage_of[k - 1]:
            raise CodegenError(
                f"pipeline stages must follow program order, but {g.describe(g.ops[k])} is "
                f"in stage {stage_of[k]} after an op of stage {stage_of[k - 1]}; cut the "
                f"graph with graph.staging(...), which numbers stages in program order"
            )
    missing = sorted(set(range(nstages)) - set(stage_of))
    if missing:
        raise CodegenError(f"pipeline stages {missing} have no ops (stages are numbered 0 .. "
                           f"{nstages - 1}); cut the graph with graph.staging(...)")
    devices: list[set[int]] = [set() for _ in range(nstages)]
    for op, s in zip(g.ops, stage_of, strict=True):
        devices[s].add(op.plan.device)  # type: ignore[arg-type]
    sets = [tuple(sorted(d)) for d in devices]
    p = next((s for s in range(1, nstages) if sets[s] == sets[0]), nstages)
    layout_rule = (
        f"stage s must run on the devices of stage s % p, where p is the number of "
        f"pipeline devices (the stages run on {', '.join(f's{s}: {list(d)}' for s, d in enumerate(sets))})"
    )
    if nstages % p:
        raise CodegenError(
            f"the {nstages} pipeline stages cannot be laid out on {p} pipeline devices: "
            f"{layout_rule}; with virtual stages the number of stages must be a multiple "
            f"of the number of device sets. Place stage s on the devices of stage s % p"
        )
    for s in range(nstages):
        if sets[s] != sets[s % p]:
            raise CodegenError(
                f"stage {s} runs on devices {list(sets[s])}, but {layout_rule}. Assign "
                f"stage {s}'s ops to devices {list(sets[s % p])}"
            )
    groups = sets[:p]
    seen: dict[int, int] = {}
    for gi, devs in enumerate(groups):
        for d in devs:
            if d in seen:
                raise CodegenError(
                    f"device {d} runs stages of two pipeline devices ({seen[d]} and {gi}): "
                    f"{layout_rule}, and the device sets of different pipeline devices must "
                    f"not overlap. Give every stage devices of its own"
                )
            seen[d] = gi
    sizes = sorted({len(d) for d in groups})
    if len(sizes) > 1:
        raise CodegenError(
            f"the stages run on device sets of different sizes ({', '.join(f's{s}: {list(d)}' for s, d in enumerate(groups))}); "
            f"tensors cross stage boundaries device by device, so every stage needs the same "
            f"number of devices. Give each stage {sizes[-1]} devices (or {sizes[0]})"
        )
    idle = sorted(set(range(plan_ngpus)) - set(seen))
    if idle:
        raise CodegenError(
            f"devices {idle} of the {plan_ngpus}-device scale unit run no pipeline stage; "
            f"every device of a pipelined plan runs a stage. Use plan_ngpus={len(seen)} or "
            f"place stages on devices {idle}"
        )
    stages = [StagePlan(index=s, group=s % p, devices=groups[s % p]) for s in range(nstages)]
    return PipelinePlan(settings=PipelineConfig(nmicros=1), groups=groups, stages=stages)


def make_schedule(plan: PipelinePlan) -> list[list[Action]]:
    """The registered schedule's action lists for ``plan``, checked by the simulator."""
    settings = plan.settings
    fn = get_schedule(settings.scheduler)  # an unknown name lists the registered ones
    p, m, v = plan.nstages, settings.nmicros, plan.nvirtual
    try:
        lists = fn(p, m, v)
        simulate(lists, p, m, v)
    except ScheduleError as e:
        raise CodegenError(
            f"the schedule {settings.scheduler!r} for {p} pipeline devices, {m} micro-batches "
            f"and {v} stages per device cannot run: {e}"
        ) from e
    return [list(actions) for actions in lists]
