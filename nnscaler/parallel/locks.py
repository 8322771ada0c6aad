"""One process at a time works on a generated folder: it holds the instance's file lock
(`instance_lock`, a sibling ``.{instance}.lock``, and beside it
``.{instance}.lock.owner``: who holds it) from deciding on reuse to the end of loading,
and cleans up what killed processes left behind (`clean_stale`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import filelock

from nnscaler.errors import GenFilesLockedError

__all__ = ["LOCK_NOTICE_S", "LOCK_TIMEOUT_S", "GenFilesLockedError", "clean_stale",
           "instance_lock", "lock_path", "owner_path"]

#: How long ``parallelize`` waits for another process's lock on an instance directory
#: before giving up (seconds), and after how long it says that it is waiting.
LOCK_TIMEOUT_S = 600.0
LOCK_NOTICE_S = 2.0

_log = logging.getLogger("nnscaler.parallel")


def lock_path(outdir: Path) -> Path:
    """The lock file of an instance directory (a sibling: the directory itself is
    replaced by a rename when it is regenerated)."""
    return outdir.parent / f".{outdir.name}.lock"


def owner_path(outdir: Path) -> Path:
    """The note beside the lock that says who holds it."""
    return outdir.parent / f".{outdir.name}.lock.owner"


def _owner_note(outdir: Path) -> str:
    try:
        owner = json.loads(owner_path(outdir).read_text())
        since = time.strftime("%H:%M:%S", time.localtime(float(owner["since"])))
        return (f"process {owner['pid']} on host {owner['host']} ({owner['argv0']}), "
                f"holding it since {since}")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


@contextlib.contextmanager
def instance_lock(outdir: Path, *, timeout: float | None = None) -> Iterator[None]:
    """Hold the file lock of the instance directory ``outdir`` (a ``filelock.FileLock``
    on `lock_path`), so that two jobs sharing one ``gen_savedir`` never generate,
    delete or load each other's files at the same time. Waits up to ``timeout`` seconds
    (default `LOCK_TIMEOUT_S`), saying after `LOCK_NOTICE_S` seconds that it
    waits and for whom; then raises `GenFilesLockedError`. On entry, removes what
    killed processes left behind (`clean_stale`).

    The lock is an ``flock``: released by the kernel when its holder dies, so a killed
    job never blocks the next one. On a network file system it works where the file
    system supports ``flock`` (NFSv4 does).
    """
    limit = LOCK_TIMEOUT_S if timeout is None else float(timeout)
    outdir.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(lock_path(outdir)))
    start = time.monotonic()
    try:
        lock.acquire(timeout=min(LOCK_NOTICE_S, limit))
    except filelock.Timeout:
        _log.warning("parallelize: waiting for the lock on %s, held by %s (another job "
                     "using the same gen_savedir and instance); waiting up to %.0f s",
                     outdir, _owner_note(outdir), limit)
        try:
            lock.acquire(timeout=max(0.0, limit - (time.monotonic() - start)))
        except filelock.Timeout:
            raise GenFilesLockedError(
                f"the generated files in {str(outdir)!r} are locked by "
                f"{_owner_note(outdir)}; this process waited {limit:.0f} s for it (jobs "
                f"that share a gen_savedir and instance_name take turns). Fix: wait for "
                f"that job to finish, or give this job its own instance_name= or "
                f"gen_savedir=; the lock file is {str(lock_path(outdir))!r}"
            ) from None
    try:
        owner_path(outdir).write_text(json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
            "argv0": os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python",
        }))
        clean_stale(outdir)
        yield
    finally:
        with contextlib.suppress(OSError):
            owner_path(outdir).unlink()
        lock.release()


_STALE = re.compile(r"\.(?:tmp|old)-(\d+)-[0-9a-f]+")


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this host (True when it cannot be told)."""
    if os.name != "posix":
        return True  # os.kill(pid, 0) would terminate the process on Windows
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists, owned by someone else
        return True
    return True


def clean_stale(outdir: Path) -> list[Path]:
    """Remove what killed processes left beside and inside ``outdir``: staging
    directories (``.{name}.tmp-{pid}-*``) and renamed-aside old directories
    (``.{name}.old-{pid}-*``) whose process is dead, and half-written ``.*.tmp`` files in
    ``outdir``. Call it holding `instance_lock` (no live process of a job that
    takes the lock is writing them then). Returns what was removed."""
    removed: list[Path] = []
    if outdir.parent.is_dir():
        prefix = f".{outdir.name}"
        for p in outdir.parent.iterdir():
            if not p.name.startswith(prefix):
                continue
            m = _STALE.fullmatch(p.name[len(prefix):])
            if m is None:
                continue
            pid = int(m.group(1))
            if pid == os.getpid() or _pid_alive(pid):
                continue  # in use (or a process that cannot be told dead)
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if outdir.is_dir():
        for p in outdir.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file():
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(p)
    for p in removed:
        _log.info("parallelize: removed %s, left by a process that was killed", p)
    return removed
