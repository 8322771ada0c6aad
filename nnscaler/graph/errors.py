"""Errors of the policy writer's API: each names the op (name, annotation, model source line),
states the rule that was broken and what to do instead."""

from __future__ import annotations

from nnscaler.errors import NNScalerError


class PlanError(NNScalerError, ValueError):
    """A policy asked the graph for something it cannot do."""


class PartitionError(PlanError):
    """An op cannot be split as asked: opaque, or not a split of its transform space."""


class StagingError(PlanError):
    """Pipeline stages that do not start at the first op, overlap, or repeat an op."""


class PlanCheckError(PlanError):
    """A planned graph that is incomplete or inconsistent (found by ``check``)."""


class RunPlanError(PlanError):
    """The plan simulator cannot run a planned graph."""
