"""What a plugin imports: the one module that op, policy, schedule and adapter packages
take kernel names from (docs/plugins.md, "What a plugin imports").

A plugin package imports from here and from the public names of ``nnscaler`` (and
``nnscaler.errors``), never from the kernel's modules, so the kernel can move code between
its modules without breaking a plugin; `tests/test_plugins.py` checks the in-tree plugins
under ``plugins/``. The names, by what a plugin does with them:

- hooks: `hookimpl`, `get_plugin_manager`, `Registry`, `OpRegistry`;
- ops: `make_recording_wrapper` (a library's kernel recorded as one op), the partition
  vocabulary (`Transform`, `Split`, `Replicate`, `ValuePartial`, `PartGroup`,
  `check_reduce_op`), ring attention's block-kernel interface (`BlockKernel`, `Packed`);
- policies: the graph (`IRGraph`, `Graph`, `Op`, `SubTensor`, `FullTensor`,
  `TensorKind`, `tensors_in`, `layer_path`, `repeated_blocks`), the configuration
  (`ComputeConfig`, `PipelineConfig`, `as_compute_config`, `policy_config`,
  `as_policy_graph`, `AUTO`, `DEFAULT_SCHEDULER`, `DEFAULT_BUCKET_CAP_MB`), the costs a
  search weighs (`op_work`, `op_layouts`, `layout_of`, `part_piece`, `replicated`), work handed to
  every rank (`call_on_every_rank`, `map_over_ranks`), the schedules (`get_schedule`),
  experts (`is_moe`, `require_moe_layers`, `expert_transform`, `ffn_transform`), the
  sequence split of context parallelism (`split_sequence`; `token_split` offers a mean
  loss's token split, and the part ops `CONTEXT_PARALLEL_ATTENTION` and
  `TOKEN_PARALLEL_CE` name the splits whose parts talk) and running ops for profiling
  (`run_ops`, `release_schedule`);
- adapters and devices: `Layout`, `Plan`, `plan`, `Primitive`, `execute_plan`,
  `plan_groups`, `ensure_groups`, `device_type`, `current_device`, and
  `ProcessPartGroup` (the parts of a split across processes, as generated code passes
  them to a part op: a cost model times a part op's collectives through it);
- errors a plugin raises or refines: `NNScalerError`, `PolicyError`, `PartitionError`,
  `ComputeConfigError`, `RegistrationError`.
"""

from __future__ import annotations

from nnscaler.anno import Replicate, Split, Transform, ValuePartial
from nnscaler.anno.partgroup import PartGroup, check_reduce_op
from nnscaler.config import (
    AUTO,
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_SCHEDULER,
    ComputeConfig,
    PipelineConfig,
    as_compute_config,
)
from nnscaler.errors import (
    ComputeConfigError,
    NNScalerError,
    PartitionError,
    PolicyError,
    RegistrationError,
)
from nnscaler.graph import IRGraph
from nnscaler.graph.blocks import layer_path, repeated_blocks
from nnscaler.hookspecs import hookimpl
from nnscaler.ir import (
    FullTensor,
    Graph,
    Op,
    SubTensor,
    TensorKind,
    release_schedule,
    run_ops,
    tensors_in,
)
from nnscaler.layout import Layout, Plan, Primitive, plan
from nnscaler.ops.builtin.attention_kernels import BlockKernel, Packed
from nnscaler.ops.builtin.context_parallel import CONTEXT_PARALLEL_ATTENTION
from nnscaler.ops.builtin.token_loss import TOKEN_PARALLEL_CE, token_split
from nnscaler.ops.registry import OpRegistry
from nnscaler.ops.user_ops import make_recording_wrapper
from nnscaler.parallel import call_on_every_rank, map_over_ranks
from nnscaler.plugins import get_plugin_manager
from nnscaler.policies.common import as_policy_graph, policy_config
from nnscaler.policies.costs import layout_of, op_layouts, op_work, part_piece, replicated
from nnscaler.policies.experts import (
    expert_transform,
    ffn_transform,
    is_moe,
    require_moe_layers,
)
from nnscaler.policies.sequence import split_sequence, split_sequence_within
from nnscaler.registry import Registry
from nnscaler.runtime import ProcessPartGroup, ensure_groups, execute_plan, plan_groups
from nnscaler.runtime.device import current_device, device_type
from nnscaler.schedule import get_schedule

__all__ = [
    "AUTO",
    "BlockKernel",
    "CONTEXT_PARALLEL_ATTENTION",
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_SCHEDULER",
    "ComputeConfig",
    "ComputeConfigError",
    "FullTensor",
    "Graph",
    "IRGraph",
    "Layout",
    "NNScalerError",
    "Op",
    "OpRegistry",
    "Packed",
    "PartGroup",
    "PartitionError",
    "PipelineConfig",
    "Plan",
    "PolicyError",
    "Primitive",
    "ProcessPartGroup",
    "Registry",
    "RegistrationError",
    "Replicate",
    "Split",
    "SubTensor",
    "TOKEN_PARALLEL_CE",
    "TensorKind",
    "Transform",
    "ValuePartial",
    "as_compute_config",
    "as_policy_graph",
    "call_on_every_rank",
    "check_reduce_op",
    "current_device",
    "device_type",
    "ensure_groups",
    "execute_plan",
    "expert_transform",
    "ffn_transform",
    "get_plugin_manager",
    "hookimpl",
    "is_moe",
    "get_schedule",
    "layer_path",
    "make_recording_wrapper",
    "map_over_ranks",
    "layout_of",
    "op_layouts",
    "op_work",
    "part_piece",
    "plan",
    "plan_groups",
    "policy_config",
    "release_schedule",
    "repeated_blocks",
    "replicated",
    "require_moe_layers",
    "run_ops",
    "split_sequence",
    "split_sequence_within",
    "tensors_in",
    "token_split",
]
