"""The built-in PAS policies, registered through ``nnscaler_register_policies``:

- ``dp``: data parallelism across scale units; one device per unit, every op on it;
- ``data``: the batch split across the ``plan_ngpus`` devices of a unit;
- ``tp``: tensor parallelism, each op split where the adapter costs say it pays;
- ``pp``: pipeline parallelism, one stage per device of the scale unit;
- ``hybrid``: pipeline stages, each split over its devices with tensor parallelism;
- ``sequence``: context parallelism, the sequence split across the devices of a unit
  (ring or Ulysses attention).

Each is a callable ``(graph, compute_config) -> graph`` that places every op instance and
checks the plan with ``graph.check(plan_ngpus)``. `adapters`
lists the adapters a plan needs and what they cost. See ``docs/builtin-policies.md``.
"""

from __future__ import annotations

from nnscaler.hookspecs import hookimpl
from nnscaler.policies.batch_split import data
from nnscaler.policies.common import PolicyError
from nnscaler.policies.costs import AdapterCost, adapters, layout_of, total_cost
from nnscaler.policies.pipeline import hybrid, pp
from nnscaler.policies.sequence import sequence
from nnscaler.policies.single_device import dp
from nnscaler.policies.tensor_parallel import tp
from nnscaler.registry import Registry

__all__ = [
    "BUILTIN_POLICIES",
    "AdapterCost",
    "PolicyError",
    "adapters",
    "data",
    "dp",
    "hybrid",
    "layout_of",
    "pp",
    "sequence",
    "total_cost",
    "tp",
]

#: The policies this plugin registers, by name.
BUILTIN_POLICIES = {"dp": dp, "data": data, "tp": tp, "pp": pp, "hybrid": hybrid,
                     "sequence": sequence}


@hookimpl
def nnscaler_register_policies(registry: Registry) -> None:
    for name, policy in BUILTIN_POLICIES.items():
        registry.register(name, policy)
