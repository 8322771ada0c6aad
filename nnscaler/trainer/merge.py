"""``Trainer.merge_checkpoint``: the per-rank files of one Trainer checkpoint merged into
one file, offline (one process, no process group).

The merged file holds what a checkpoint folder's ``merged.ckpt`` holds: the original
module's state dict (``model``), the optimizer's (``optimizer``), the LR scheduler's and
loss scaler's (rank 0's: every rank holds the same), the training position
(``train_status``) and the hooks' data (``user``); the RNG states are dropped, as in
nnScaler, since a merged checkpoint is meant for another world size. The original model
and optimizer load it directly; ``checkpoint.resume_from`` accepts it for any plan.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nnscaler.trainer import ckpt_layout as layout
from nnscaler.trainer.errors import TrainerError

__all__ = ["merge_checkpoint_files"]


def _check_complete(files: list[Path]) -> None:
    """The files must be every rank's of one checkpoint folder (when the folder says)."""
    folders = {f.parent.resolve() for f in files}
    if len(folders) != 1:
        raise TrainerError(f"Trainer.merge_checkpoint takes the files of one checkpoint, got "
                           f"files from {len(folders)} folders: {sorted(map(str, folders))}.")
    folder = folders.pop()
    if not (folder / layout.META_FILE).is_file():
        return
    meta = layout.read_meta(folder)
    if meta["save_type"] == "merged":
        raise TrainerError(f"{folder} is already merged ({layout.MERGED_FILE}); resume from "
                           f"it or copy that file instead.")
    expected = {layout.rank_file(folder, r).resolve() for r in range(meta["world_size"])}
    given = {f.resolve() for f in files}
    if given != expected:
        missing = sorted(p.name for p in expected - given)
        raise TrainerError(
            f"Trainer.merge_checkpoint needs the files of all {meta['world_size']} ranks of "
            f"{folder}; missing {missing}. Fix: pass "
            f"sorted(Path('{folder}').glob('*.ckpt')) minus {layout.MERGED_FILE}.")


def merge_checkpoint_files(checkpoint_files: list[str | os.PathLike[str]],
                           output_file: str | os.PathLike[str]) -> None:
    """Merge ``checkpoint_files`` (every rank's file of one checkpoint, in any order) into
    ``output_file``, written atomically (see the module doc)."""
    from nnscaler import checkpoint as ck

    files = [Path(f) for f in checkpoint_files]
    if not files:
        raise TrainerError("Trainer.merge_checkpoint got no checkpoint files; pass every "
                           "rank's file of one checkpoint folder.")
    for f in files:
        if not f.is_file():
            raise TrainerError(f"Trainer.merge_checkpoint: {f} is not a file.")
    _check_complete(files)
    states: list[dict[str, Any]] = [ck.load(f, map_location="cpu") for f in files]
    model, optimizer = ck.merge_state_dicts([s["model"] for s in states],
                                            [s["optimizer"] for s in states])
    first = states[0]
    merged = {
        "model": model,
        "optimizer": optimizer,
        "lr_scheduler": first.get("lr_scheduler"),
        "loss_scaler": first.get("loss_scaler"),
        "train_status": first["train_status"],
        "user": first.get("user", {}),
    }
    Path(output_file).parent.mkdir(parents=True, exist_ok=True)
    ck.save(merged, output_file)
