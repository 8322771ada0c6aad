"""Checkpoint files: written atomically, read with ``weights_only=True``, and nothing left
behind by a killed save.

`save` writes into a temporary file beside the target, ``.{name}.{pid}-{hex}.tmp``,
holding an exclusive ``flock`` on it while it writes, flushes it to disk and renames it
over the target (``os.replace`` is atomic on POSIX and Windows): a save that is killed half
way leaves the previous file intact. The temporary file it leaves is removed by the next
`save` of the same file, or by `clean_stale` on the directory: a temporary file
is stale when no process holds its lock and the process that made it is dead (a lock dies
with its process). `temporary_dir` does the same for a whole directory written in
one go (a checkpoint folder that every rank writes into, renamed into place at the end).
`load` reads with ``torch.load(weights_only=True)``: the state dicts nnscaler writes
hold only tensors and plain Python data, so no pickled code is ever run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from nnscaler.checkpoint.errors import CheckpointError

try:
    import fcntl
except ImportError:  # Windows: an open file cannot be deleted there, which is the lock
    fcntl = None  # type: ignore[assignment]

__all__ = ["clean_stale", "fsync_dir", "load", "save", "temporary_dir"]

_log = logging.getLogger("nnscaler.checkpoint")
_TMP_FILE = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)-[0-9a-f]{8}\.tmp")
_TMP_DIR = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}")
_DIR_LOCK = ".lock"


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename into it) to disk; a no-op where unsupported."""
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


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (True when it cannot be told)."""
    if pid == os.getpid():
        return True
    if os.name != "posix":
        return True  # os.kill(pid, 0) would terminate it on Windows
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


def _lock(fd: int, *, wait: bool) -> bool:
    """Take the exclusive ``flock`` of ``fd``; False if another process holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def _remove_if_stale_file(path: Path, pid: int) -> bool:
    if _pid_alive(pid):
        return False  # its writer may be between creating and locking it
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if not _lock(fd, wait=False):
            return False
        path.unlink()
        return True
    except OSError:  # Windows: open elsewhere
        return False
    finally:
        os.close(fd)


def _remove_if_stale_dir(path: Path, pid: int) -> bool:
    if _pid_alive(pid):
        return False
    lock = path / _DIR_LOCK
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        fd = -1  # killed before it took the lock
    except OSError:
        return False
    try:
        if fd >= 0 and not _lock(fd, wait=False):
            return False
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()
    finally:
        if fd >= 0:
            os.close(fd)


def clean_stale(directory: str | os.PathLike[str], name: str | None = None) -> list[Path]:
    """Remove the temporary files of killed `save` calls and the temporary
    directories of killed `temporary_dir` blocks in ``directory`` (only those of
    the file or directory ``name`` when given). One is stale when its lock is free and
    the process that made it is dead; what a live process writes is never touched.
    Returns what was removed."""
    root = Path(directory)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for path in root.iterdir():
        m = _TMP_FILE.fullmatch(path.name) or _TMP_DIR.fullmatch(path.name)
        if m is None or (name is not None and m.group("name") != name):
            continue
        pid = int(m.group("pid"))
        if path.is_dir() and not path.is_symlink():
            gone = _TMP_DIR.fullmatch(path.name) is not None and _remove_if_stale_dir(path, pid)
        else:
            gone = _TMP_FILE.fullmatch(path.name) is not None and _remove_if_stale_file(path, pid)
        if gone:
            _log.info("removed %s, left by a checkpoint save that was killed", path)
            removed.append(path)
    return removed


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, atomically: the file is either the previous one or the
    complete new one, never a partial write. Temporary files that killed saves of the
    same file left are removed first.

    The parent directory must exist. Use it for per-rank, deduped and merged state dicts
    alike (one file per rank: ``save(sd, f"ckpt/rank{rank}.pt")``).
    """
    target = Path(path)
    if not target.parent.is_dir():
        raise CheckpointError(
            f"cannot save {str(target)!r}: the directory {str(target.parent)!r} does not "
            f"exist; create it first (os.makedirs(..., exist_ok=True))"
        )
    clean_stale(target.parent, target.name)
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _lock(fd, wait=True)
        with os.fdopen(os.dup(fd), "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)  # releases the lock
    fsync_dir(target.parent)


@contextlib.contextmanager
def temporary_dir(target: str | os.PathLike[str], *, replace: bool = True) -> Iterator[Path]:
    """A temporary sibling directory of ``target`` to write a whole checkpoint into;
    renamed to ``target`` when the block ends without an exception (an existing
    ``target`` is first renamed aside and deleted when ``replace``, else
    [`CheckpointError`][nnscaler.errors.CheckpointError]), removed when it raises. This process
    holds a lock in it until then, so `clean_stale` leaves it alone while this process lives; other
    processes (ranks) may write into it meanwhile. Stale ones beside ``target`` are
    removed on entry."""
    final = Path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final.parent, final.name)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    fd = os.open(tmp / _DIR_LOCK, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        _lock(fd, wait=True)
        try:
            yield tmp
            (tmp / _DIR_LOCK).unlink()
            if final.exists():
                if not replace:
                    raise CheckpointError(
                        f"{str(final)!r} already exists; pass replace=True to replace it, or "
                        f"choose another directory"
                    )
                aside = final.with_name(f".{final.name}.tmp-{os.getpid()}-"
                                        f"{uuid.uuid4().hex[:8]}")
                os.replace(final, aside)
                os.replace(tmp, final)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(tmp, final)
            fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        os.close(fd)


def load(path: str | os.PathLike[str], *, map_location: Any = None,
         mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``: what `save` wrote (state dicts of
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
