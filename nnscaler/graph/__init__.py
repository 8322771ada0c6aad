"""The policy writer's API: partition, replicate, assign, multiref, staging, recompute.

A policy is a callable ``(graph, compute_config) -> graph`` that receives an
[`IRGraph`][nnscaler.IRGraph] and places every op of it on the devices of a scale unit:

- [`IRGraph.select`][nnscaler.IRGraph.select] / [`IRGraph.nodes`][nnscaler.IRGraph.nodes] find ops;
- [`IRGraph.partition`][nnscaler.IRGraph.partition] splits an op through its transform space,
  [`IRGraph.replicate`][nnscaler.IRGraph.replicate] copies it,
  [`IRGraph.assign`][nnscaler.IRGraph.assign] places an instance;
- [`IRGraph.multiref`][nnscaler.IRGraph.multiref], [`IRGraph.staging`][nnscaler.IRGraph.staging],
  [`IRGraph.recompute`][nnscaler.IRGraph.recompute];
- `check_plan` (or [`IRGraph.check`][nnscaler.IRGraph.check]) says whether a plan is complete, and
  `run_plan` runs it on one process, the reference that plans are tested against.

See ``docs/policies.md``.
"""

from nnscaler.graph.check import check_plan
from nnscaler.graph.errors import (
    PartitionError,
    PlanCheckError,
    PlanError,
    RunPlanError,
    StagingError,
)
from nnscaler.graph.graph import IRGraph
from nnscaler.graph.simulate import run_plan

__all__ = [
    "IRGraph",
    "PartitionError",
    "PlanCheckError",
    "PlanError",
    "RunPlanError",
    "StagingError",
    "check_plan",
    "run_plan",
]
