"""``autodist``: nnscaler's searching policy, as a plugin.

A measured cost model (`profile`, `comm`, `model`) and exact solvers
(`spmd` within a stage, `pipeline` across stages) choose data, tensor and
pipeline parallelism. Installing the package registers the policy ``autodist``::

    parallelize(Model, dummy_args, "autodist", ComputeConfig(plan_ngpus=2, runtime_ngpus=4,
                pas_config={"mem_constraint": 16}))

See ``docs/plugins/policy_autodist.md``.
"""

from nnscaler_policy_autodist.comm import DEVICE_SPECS, DeviceSpec, measure_comm
from nnscaler_policy_autodist.config import KEYS, AutoDistConfig, AutoDistError, parse_config
from nnscaler_policy_autodist.constraints import ConstraintError
from nnscaler_policy_autodist.planfile import PlanFileError
from nnscaler_policy_autodist.policy import AutoDistResult, autodist, plan_graph
from nnscaler_policy_autodist.spmd import NoPlanFits

__all__ = [
    "DEVICE_SPECS",
    "KEYS",
    "AutoDistConfig",
    "AutoDistError",
    "AutoDistResult",
    "ConstraintError",
    "DeviceSpec",
    "NoPlanFits",
    "PlanFileError",
    "autodist",
    "measure_comm",
    "parse_config",
    "plan_graph",
]
