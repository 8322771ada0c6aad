"""The runtime: what generated code calls on each rank.

Device selection and start-up (`device`), the process-group cache
(`groups`), autograd-aware collectives
(`collectives`), the adapter runner
(`adapters`) and a clean exit (`teardown`,
run at interpreter exit). See ``docs/runtime.md``.

Generated code (``gencode{rank}.py``) imports only from here: ``ParallelModule``,
``Adapter`` and ``boundary``; for pipelines ``Piece``, ``Pipeline``, ``parse_schedule``
and ``anchored``; for ZeRO stage 3 ``zero3``; and nnscaler's own op implementations
from `nnscaler.runtime.ops`.
"""

# ruff: noqa: F401  (re-exports: keep this a plain list of imports)

from nnscaler.runtime.adapters import execute_plan, plan_groups, register_step_impl
from nnscaler.runtime.collectives import (
    CollectiveError,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    chunk,
    identity_allreduce,
    reduce_scatter,
    send_recv,
)
from nnscaler.runtime.device import (
    DEVICE_ENV,
    DeviceError,
    backend_for,
    current_device,
    device_type,
    init_distributed,
    local_rank,
)
from nnscaler.runtime.groups import (
    GroupError,
    clear_groups,
    created_groups,
    ensure_groups,
    get_group,
)
from nnscaler.runtime.reducer import Bucket, Reducer, ReducerHook
from nnscaler.runtime.teardown import shutdown
from nnscaler.runtime.zero import ZeroGroups, zero_groups

# isort: split
# generated code's runtime: the module base class, the boundary functions, adapters
from nnscaler.runtime import boundary
from nnscaler.runtime.boundary import Adapter
from nnscaler.runtime.module import AttrMeta, ParallelModule, ParallelModuleError
from nnscaler.runtime.partgroup import ProcessPartGroup
from nnscaler.runtime.pipeline import Piece, Pipeline, anchored, parse_schedule

# isort: split
# ZeRO stage 3: zero3.gather / prefetch / free around the units a generated forward reads
from nnscaler.runtime import zero3
