"""``nnscaler.parallelize`` and its companions: the user-facing API of nnscaler.

- [`ComputeConfig`][nnscaler.ComputeConfig], [`ReuseType`][nnscaler.ReuseType],
  [`BroadcastGenFilesStrategy`][nnscaler.BroadcastGenFilesStrategy];
- [`parallelize`][nnscaler.parallelize]: a module (or class) in, a ``ParallelModule`` (or class)
  out, with ``gencode{rank}.py`` files under ``gen_savedir``;
- [`build_optimizer`][nnscaler.build_optimizer]: an optimizer patched to sync gradients, gather ZeRO
  shards, scale and clip gradients;
- [`broadcast_weights`][nnscaler.broadcast_weights]: initial weights from the ranks that have them;
- [`verify`][nnscaler.verify]: the plan against the single-device model, op by op;
- `map_over_ranks`, `call_on_every_rank`: work a policy hands to every rank
  while rank 0 plans (profiling, measuring collectives);
- at nnScaler's import paths: the checkpoint functions (``merge_state_dicts``,
  ``deduped_state_dict``, ``load_deduped_state_dict``, ``load_merged_state_dict``,
  ``load_sharded_state_dict``, from `nnscaler.checkpoint`) and ``sync_grad_when``
  (from `nnscaler.runtime.reducer`).

See ``docs/parallelize.md``.
"""

from __future__ import annotations

from nnscaler.checkpoint import (
    deduped_state_dict,
    load_deduped_state_dict,
    load_merged_state_dict,
    load_sharded_state_dict,
    merge_state_dicts,
)
from nnscaler.parallel.api import ParallelizeError, ReuseMismatchError, parallelize
from nnscaler.parallel.broadcast import BroadcastError, broadcast_weights
from nnscaler.parallel.config import (
    BroadcastGenFilesStrategy,
    ComputeConfig,
    ComputeConfigError,
    ReuseType,
)
from nnscaler.parallel.optimizer import OptimizerError, build_optimizer
from nnscaler.parallel.paths import GenFilesError
from nnscaler.parallel.verification import Difference, VerifyError, VerifyReport, verify
from nnscaler.parallel.workers import WorkerError, call_on_every_rank, map_over_ranks
from nnscaler.runtime.module import ParallelModule
from nnscaler.runtime.reducer import sync_grad_when

__all__ = [
    "BroadcastError",
    "BroadcastGenFilesStrategy",
    "ComputeConfig",
    "ComputeConfigError",
    "Difference",
    "GenFilesError",
    "OptimizerError",
    "ParallelModule",
    "ParallelizeError",
    "ReuseMismatchError",
    "ReuseType",
    "broadcast_weights",
    "build_optimizer",
    "VerifyError",
    "VerifyReport",
    "WorkerError",
    "call_on_every_rank",
    "deduped_state_dict",
    "load_deduped_state_dict",
    "load_merged_state_dict",
    "load_sharded_state_dict",
    "map_over_ranks",
    "merge_state_dicts",
    "parallelize",
    "sync_grad_when",
    "verify",
]

