"""The import path of the Trainer's checkpoint folders before they moved to
`nnscaler.trainer.ckpt_layout` (atomic writes, ``last`` / ``best``, rotation,
finding what to resume from, the RNG states)."""

from __future__ import annotations

from nnscaler.trainer.ckpt_layout import (
    CHECKPOINT_NAME,
    MERGED_FILE,
    META_FILE,
    TrainerCheckpointError,
    checkpoint_name,
    complete_checkpoints,
    get_rng_states,
    partial_dir,
    point,
    publish,
    rank_file,
    read_meta,
    resolve_resume,
    rotate,
    set_rng_states,
)

__all__ = [
    "CHECKPOINT_NAME",
    "MERGED_FILE",
    "META_FILE",
    "TrainerCheckpointError",
    "checkpoint_name",
    "complete_checkpoints",
    "get_rng_states",
    "partial_dir",
    "point",
    "publish",
    "rank_file",
    "read_meta",
    "resolve_resume",
    "rotate",
    "set_rng_states",
]
