"""What the built-in policies share: reading the compute config, placing parts on devices.

A policy receives ``(graph, compute_config)``. The built-ins read only attributes of
``compute_config`` (``plan_ngpus``, and ``pas_config`` where a policy takes options), so
any object with those attributes works (tests pass a ``types.SimpleNamespace``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nnscaler.graph import IRGraph, PlanError
from nnscaler.ir import Graph, Op

__all__ = ["PolicyError", "as_policy_graph", "assign_parts", "get_pas_config", "get_plan_ngpus"]


class PolicyError(PlanError):
    """A built-in policy cannot plan the graph with the compute config it was given."""


def get_plan_ngpus(compute_config: Any, policy: str) -> int:
    """``compute_config.plan_ngpus``, checked: the number of devices of one scale unit."""
    if not hasattr(compute_config, "plan_ngpus"):
        raise PolicyError(
            f"policy {policy!r}: the compute config must have a 'plan_ngpus' attribute (the "
            f"number of devices of one scale unit), got {type(compute_config).__name__} "
            f"{compute_config!r}. Pass an nnscaler ComputeConfig, or an object with "
            f"plan_ngpus, runtime_ngpus and pas_config."
        )
    n = compute_config.plan_ngpus
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PolicyError(
            f"policy {policy!r}: compute_config.plan_ngpus is the number of devices of one "
            f"scale unit, a positive int; got {n!r}. Set plan_ngpus to 1, 2, 4, ..."
        )
    return n


def get_pas_config(compute_config: Any, policy: str) -> Mapping[str, Any]:
    """``compute_config.pas_config`` (``{}`` when absent or ``None``). Keys a policy does
    not know are left alone: one ``pas_config`` may carry options for several policies."""
    cfg = getattr(compute_config, "pas_config", None)
    if cfg is None:
        return {}
    if not isinstance(cfg, Mapping):
        raise PolicyError(
            f"policy {policy!r}: compute_config.pas_config must be a dict of options, got "
            f"{type(cfg).__name__} {cfg!r}. Pass pas_config={{}} or a dict."
        )
    return cfg


def as_policy_graph(graph: Graph) -> IRGraph:
    """``graph`` as an :class:`IRGraph` (itself when it is one; a copy of a traced graph)."""
    if isinstance(graph, IRGraph):
        return graph
    if isinstance(graph, Graph):
        return IRGraph.from_graph(graph)
    raise TypeError(f"a policy takes the traced graph (an nnscaler IRGraph), got "
                    f"{type(graph).__name__} {graph!r}")


def assign_parts(graph: IRGraph, parts: Sequence[Op]) -> None:
    """Part (or replica) ``p`` of an op runs on device ``p`` of the scale unit."""
    for device, part in enumerate(parts):
        graph.assign(part, device)
