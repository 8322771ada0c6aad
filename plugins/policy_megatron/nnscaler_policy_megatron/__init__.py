"""The ``megatron`` policy for nnscaler: Megatron-LM's parallelism by its own names.

``parallelize(model, dummy, "megatron", compute_config)`` with ``pas_config`` keys
``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
``virtual_pipeline_model_parallel_size`` (or ``num_layers_per_virtual_pipeline_stage``),
``sequence_parallel``, ``data_parallel`` and ``use_distributed_optimizer``;
`megatron_compute_config` builds the matching [`ComputeConfig`][nnscaler.ComputeConfig].
Transformer blocks are recognised by structure (`structure`), so Hugging Face
models work as written. See docs/plugins/policy_megatron.md.
"""

from nnscaler_policy_megatron.config import (
    MegatronConfig,
    MegatronConfigError,
    megatron_compute_config,
    read_config,
)
from nnscaler_policy_megatron.policy import MegatronPlan, megatron, plan
from nnscaler_policy_megatron.structure import Region, find_regions

__all__ = [
    "MegatronConfig",
    "MegatronConfigError",
    "MegatronPlan",
    "Region",
    "find_regions",
    "megatron",
    "megatron_compute_config",
    "plan",
    "read_config",
]
