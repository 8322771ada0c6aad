"""The Trainer's checkpoint folders: atomic writes, ``last`` / ``best``, rotation, and
finding what to resume from.

A checkpoint is a folder ``save_dir/EEEE-SSSS`` (epoch, global step) holding one file
per rank (``{rank}.ckpt``, sharded or deduped) or one ``merged.ckpt``, and
``meta.json`` (what was saved, by how many ranks, with which plan). It is written into
``save_dir/.EEEE-SSSS.partial`` and renamed into place by rank 0 only after every rank
reported its file written, so a folder with a checkpoint name is always complete: a
crash leaves at most a ``.partial`` folder, which the next save of that name removes
and which resuming never reads. ``last`` and ``best`` are symbolic links to checkpoint
folders (or copies, ``symlink_best_and_last=False``), replaced atomically.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from nnscaler.checkpoint.files import fsync_dir
from nnscaler.errors import TrainerCheckpointError

__all__ = [
    "CHECKPOINT_NAME",
    "MERGED_FILE",
    "META_FILE",
    "TrainerCheckpointError",
    "complete_checkpoints",
    "get_rng_states",
    "is_merged_file",
    "rank_file",
    "resolve_resume",
    "set_rng_states",
]

CHECKPOINT_NAME = re.compile(r"^(\d{4,})-(\d{4,})$")
META_FILE = "meta.json"
MERGED_FILE = "merged.ckpt"


def checkpoint_name(epoch: int, step: int) -> str:
    """``'0000-0010'``: the folder name of the checkpoint after global ``step``."""
    return f"{epoch:04d}-{step:04d}"


def rank_file(folder: str | os.PathLike[str], rank: int) -> Path:
    return Path(folder) / f"{rank}.ckpt"


def complete_checkpoints(save_dir: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoint folders of ``save_dir``, oldest (lowest step) first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = CHECKPOINT_NAME.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and (p / META_FILE).is_file():
            found.append((int(m.group(2)), int(m.group(1)), p))
    return [p for _, _, p in sorted(found)]


def read_meta(folder: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise TrainerCheckpointError(
            f"{str(folder)!r} is not a complete Trainer checkpoint: it has no {META_FILE}. "
            f"Fix: resume from a folder named like '0000-0010' under the save_dir, or from "
            f"'last' / 'best'."
        )
    return json.loads(path.read_text())


def resolve_resume(resume_from: str | None, save_dir: str | os.PathLike[str]) -> Path | None:
    """The checkpoint folder to resume from, or None to start from scratch.

    ``'last'`` is the ``last`` link (or, if it is missing, the newest complete folder);
    ``'best'`` the ``best`` link; either one missing means a fresh start. A path must
    be a complete checkpoint folder.
    """
    if resume_from is None:
        return None
    root = Path(save_dir)
    if resume_from in ("last", "best"):
        link = root / resume_from
        if link.exists() and (link / META_FILE).is_file():
            return link.resolve()
        if resume_from == "last":
            done = complete_checkpoints(root)
            return done[-1] if done else None
        return None
    path = Path(resume_from)
    if path.is_file() and path.name == MERGED_FILE:
        path = path.parent
    read_meta(path)
    return path


def is_merged_file(resume_from: str | os.PathLike[str]) -> bool:
    """Whether ``resume_from`` is a single merged file (``Trainer.merge_checkpoint``'s
    output) rather than a checkpoint folder or the merged file inside one."""
    path = Path(resume_from)
    if str(resume_from) in ("last", "best") or not path.is_file():
        return False
    return not (path.name == MERGED_FILE and (path.parent / META_FILE).is_file())


# -- writing ---------------------------------------------------------------------------

def partial_dir(save_dir: Path, name: str) -> Path:
    return save_dir / f".{name}.partial"


def publish(save_dir: Path, name: str, meta: dict[str, Any]) -> Path:
    """Rank 0, after every rank wrote into the partial folder: write ``meta.json`` last
    and rename the folder into place (replacing an older one of the same name)."""
    tmp = partial_dir(save_dir, name)
    meta_tmp = tmp / (META_FILE + ".tmp")
    meta_tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
    os.replace(meta_tmp, tmp / META_FILE)
    final = save_dir / name
    if final.exists():
        old = save_dir / f".{name}.old"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(save_dir)
    return final


def point(save_dir: Path, alias: str, target: Path, *, symlink: bool) -> None:
    """Make ``save_dir/alias`` (``last`` or ``best``) name ``target``, atomically."""
    link = save_dir / alias
    if symlink:
        tmp = save_dir / f".{alias}.link"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(target.name, tmp)
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)
        os.replace(tmp, link)
    else:
        tmp = save_dir / f".{alias}.partial"
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(target, tmp)
        old = save_dir / f".{alias}.old"
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(link, old)
        os.replace(tmp, link)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(save_dir)


def rotate(save_dir: Path, keep: int | None) -> list[Path]:
    """Keep the newest ``keep`` complete checkpoints (and the ones ``last`` and ``best``
    link to); remove the others. Returns the removed folders."""
    if keep is None:
        return []
    done = complete_checkpoints(save_dir)
    protected = set()
    for alias in ("last", "best"):
        link = save_dir / alias
        if link.is_symlink():
            protected.add((save_dir / os.readlink(link)).resolve())
    removed = []
    for p in done[: max(len(done) - keep, 0)]:  # all but the newest `keep`
        if p.resolve() in protected:
            continue
        shutil.rmtree(p)
        removed.append(p)
    return removed


# -- random number generators ----------------------------------------------------------

def get_rng_states() -> dict[str, Any]:
    """Every RNG a training step may draw from: torch (CPU and CUDA), numpy, Python;
    as tensors and plain data (loadable with ``weights_only=True``)."""
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _python_state(random.getstate()),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": None,
    }
    try:
        import numpy as np
    except ImportError:
        return states
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    states["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")),
                       "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return states


def _python_state(state: Any) -> Any:
    version, internal, gauss = state
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss}


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `get_rng_states` returned."""
    torch.set_rng_state(states["torch"])
    py = states["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["internal"].tolist()),
                     py["gauss"]))
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if states.get("numpy") is not None:
        try:
            import numpy as np
        except ImportError:
            return
        st = states["numpy"]
        np.random.set_state((st["name"], st["keys"].numpy().astype("uint32"), st["pos"],
                             st["has_gauss"], st["gauss"]))
