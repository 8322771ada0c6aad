"""Checkpoints of parallel modules: per rank, deduped, or merged into the original
module's state dict; loaded into a parallel module of the same or any other plan.

- ``model.state_dict()`` / ``model.load_state_dict(sd)`` on each rank: the rank's own
  pieces, with the metadata needed to merge them (`nnscaler.runtime.state`);
- [`merge_state_dicts`][nnscaler.merge_state_dicts]: every rank's state dicts (module and optimizer)
  into the ones the single-device module and optimizer load;
- [`load_merged_state_dicts`][nnscaler.load_merged_state_dicts]: a full state dict into a parallel
  module of any plan;
- [`deduped_state_dict`][nnscaler.deduped_state_dict] /
  [`load_deduped_state_dict`][nnscaler.load_deduped_state_dict]: each distinct piece saved once
  across the ranks, and every rank restored from them;
- `rank_state_dict`: what a rank saves; with ZeRO
  stage 3 its shards, never a gathered unit;
- `save` / `load`: atomic writes, ``weights_only=True`` reads;
- `track_optimizer`: optimizer state dicts that say which tensor each entry is;
- [`load_pretrained`][nnscaler.load_pretrained] / [`save_pretrained`][nnscaler.save_pretrained]:
  Hugging Face Hub-format safetensors folders in and out, each rank reading only its slices
  (``docs/pretrained.md``);
- [`load_resharded`][nnscaler.load_resharded]: per-rank files of one plan (module and optimizer)
  into another plan, each rank reading only the pieces it needs.

See ``docs/checkpoint.md``.
"""

from nnscaler.checkpoint.dedup import deduped_state_dict, load_deduped_state_dict
from nnscaler.checkpoint.errors import (
    CheckpointError,
    OptimizerStateError,
    StateDictMismatchError,
)
from nnscaler.checkpoint.files import load, save
from nnscaler.checkpoint.hub import (
    load_pretrained,
    load_resharded,
    meta_parameters,
    save_pretrained,
)
from nnscaler.checkpoint.merge import merge_state_dicts
from nnscaler.checkpoint.optimizer import track_optimizer
from nnscaler.checkpoint.reshard import (
    load_merged_state_dict,
    load_merged_state_dicts,
    load_sharded_state_dict,
)
from nnscaler.checkpoint.shards import rank_state_dict

__all__ = [
    "CheckpointError",
    "OptimizerStateError",
    "StateDictMismatchError",
    "deduped_state_dict",
    "load",
    "load_deduped_state_dict",
    "load_merged_state_dict",
    "load_merged_state_dicts",
    "load_pretrained",
    "load_resharded",
    "load_sharded_state_dict",
    "merge_state_dicts",
    "meta_parameters",
    "rank_state_dict",
    "save",
    "save_pretrained",
    "track_optimizer",
]
