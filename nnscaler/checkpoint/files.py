"""Checkpoint files: written atomically, read with ``weights_only=True``.

:func:`save` writes into a temporary file beside the target, flushes it to disk and renames
it over the target (``os.replace`` is atomic on POSIX and Windows): a save that is killed
half way leaves the previous file intact (and at worst a stray ``.{name}.*.tmp`` beside
it). :func:`load` reads with ``torch.load(weights_only=True)``: the state dicts nnscaler
writes hold only tensors and plain Python data, so no pickled code is ever run.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from nnscaler.checkpoint.errors import CheckpointError

__all__ = ["load", "save"]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, atomically: the file is either the previous one or the
    complete new one, never a partial write.

    The parent directory must exist. Use it for per-rank, deduped and merged state dicts
    alike (one file per rank: ``save(sd, f"ckpt/rank{rank}.pt")``).
    """
    target = Path(path)
    if not target.parent.is_dir():
        raise CheckpointError(
            f"cannot save {str(target)!r}: the directory {str(target.parent)!r} does not "
            f"exist; create it first (os.makedirs(..., exist_ok=True))"
        )
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def load(path: str | os.PathLike[str], *, map_location: Any = None,
         mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``: what :func:`save` wrote (state dicts of
    modules and optimizers). ``map_location`` as in ``torch.load`` (e.g. ``'cpu'``);
    ``mmap=True`` maps the file instead of reading it all."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{str(path)!r} holds Python objects that torch.load(weights_only=True) refuses "
            f"to unpickle ({e}). nnscaler's state dicts hold only tensors and plain data; "
            f"if you trust this file and it carries your own objects, read it with "
            f"torch.load(path, weights_only=False)"
        ) from None
