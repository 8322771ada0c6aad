"""What the built-in policies share: reading the compute config, placing parts on devices.

A policy receives ``(graph, compute_config)``, a [`ComputeConfig`][nnscaler.ComputeConfig]
(validated when it was built). The built-ins read it through `policy_config`, which
also takes any object with its fields (tests pass a ``types.SimpleNamespace``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nnscaler.config import AUTO, ComputeConfig, ComputeConfigError, as_compute_config
from nnscaler.errors import PolicyError
from nnscaler.graph import IRGraph
from nnscaler.ir import Graph, Op

__all__ = ["PolicyError", "as_policy_graph", "assign_parts", "policy_config"]


def policy_config(compute_config: Any, policy: str) -> ComputeConfig:
    """``compute_config`` as a [`ComputeConfig`][nnscaler.ComputeConfig] (itself, or one built
    from the fields of another object, e.g. a test's ``SimpleNamespace``); a config that
    cannot be one raises `PolicyError` naming the policy."""
    try:
        config = as_compute_config(compute_config)
    except ComputeConfigError as e:
        raise PolicyError(f"policy {policy!r}: {e}") from None
    if config.plan_ngpus == AUTO and policy != "autodist":
        raise PolicyError(f"policy {policy!r} needs the unit size: plan_ngpus='auto' is "
                          f"chosen by the autodist policy only; give plan_ngpus (a divisor of "
                          f"runtime_ngpus={config.runtime_ngpus}) or use 'autodist'")
    if config.zero_stage == AUTO and policy != "autodist":
        raise PolicyError(f"policy {policy!r} needs the ZeRO stage: zero_stage='auto' is "
                          f"chosen by the autodist policy only; give zero_stage (one of "
                          f"{list(config.zero_stages)}) or use 'autodist'")
    return config


def as_policy_graph(graph: Graph) -> IRGraph:
    """``graph`` as an [`IRGraph`][nnscaler.IRGraph] (itself when it is one; a copy of a traced
    graph)."""
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
