"""Errors of the policy writer's API.

The classes live in `nnscaler.errors`, the one home of every error class; this module
keeps the import path ``nnscaler.graph.errors`` that the room's modules and users take.
"""

from __future__ import annotations

from nnscaler.errors import PartitionError, PlanCheckError, PlanError, RunPlanError, StagingError

__all__ = ["PartitionError", "PlanCheckError", "PlanError", "RunPlanError", "StagingError"]
