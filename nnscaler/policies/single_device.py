"""``dp``: data parallelism across scale units; the plan of one unit is one device.

Every op runs whole on device 0. The replicas come from the compute config: with
``runtime_ngpus`` devices there are ``runtime_ngpus / plan_ngpus`` scale units, each
running the whole model on its own samples, their gradients summed by the reducer.
"""

from __future__ import annotations

from nnscaler.config import ComputeConfig
from nnscaler.graph import IRGraph
from nnscaler.ir import Graph
from nnscaler.policies.common import PolicyError, as_policy_graph, policy_config

__all__ = ["dp"]


def dp(graph: Graph, compute_config: ComputeConfig) -> IRGraph:
    """Every op on device 0 of a one-device scale unit (``plan_ngpus`` must be 1)."""
    config = policy_config(compute_config, "dp")
    n = config.plan_ngpus
    if n != 1:
        runtime = config.runtime_ngpus
        raise PolicyError(
            f"policy 'dp' plans a scale unit of one device (each replica runs the whole "
            f"model; the replicas are the runtime_ngpus / plan_ngpus scale units), but "
            f"compute_config.plan_ngpus is {n} (runtime_ngpus {runtime}). Set plan_ngpus=1 "
            f"and runtime_ngpus to the number of replicas, or use the 'data' policy to "
            f"split the batch across the {n} devices of a scale unit."
        )
    g = as_policy_graph(graph)
    for op in g.nodes():
        g.assign(op, 0)
    g.check(1)
    return g
