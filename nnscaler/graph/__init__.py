"""The policy writer's API: partition, replicate, assign, multiref, staging, recompute.

A policy is a callable ``(graph, compute_config) -> graph`` that receives an
:class:`IRGraph` and places every op of it on the devices of a scale unit:

- :meth:`IRGraph.select` / :meth:`IRGraph.nodes` find ops;
- :meth:`IRGraph.partition` splits an op through its transform space,
  :meth:`IRGraph.replicate` copies it, :meth:`IRGraph.assign` places an instance;
- :meth:`IRGraph.multiref`, :meth:`IRGraph.staging`, :meth:`IRGraph.recompute`;
- :func:`check_plan` (or :meth:`IRGraph.check`) says whether a plan is complete, and
  :func:`run_plan` runs it on one process, the reference that plans are tested against.

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
