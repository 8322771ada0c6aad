"""Generated folders appear whole or not at all: generation writes into a temporary
sibling that is renamed into place (`staging_dir`), and a folder is removed by
renaming it aside first (`remove_dir`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from nnscaler.parallel.locks import lock_path, owner_path

__all__ = ["leftover_dirs", "remove_dir", "staging_dir"]


def remove_dir(path: Path) -> None:
    """Remove ``path`` so that no later call sees a partial directory: rename it aside
    first (one atomic step), then delete it."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    trash = path.with_name(f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def staging_dir(outdir: Path) -> Iterator[Path]:
    """A temporary sibling of ``outdir`` to write into; on success it replaces ``outdir``
    (renamed into place), on failure it is removed and ``outdir`` is left absent."""
    outdir.parent.mkdir(parents=True, exist_ok=True)
    tmp = outdir.with_name(f".{outdir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    remove_dir(outdir)
    os.replace(tmp, outdir)


def leftover_dirs(outdir: Path) -> list[Path]:
    """Temporary siblings of ``outdir`` (for tests: a failure must leave none). The lock
    file and its owner note are not leftovers."""
    if not outdir.parent.exists():
        return []
    keep = {lock_path(outdir).name, owner_path(outdir).name}
    return sorted(p for p in outdir.parent.iterdir()
                  if p.name.startswith(f".{outdir.name}.") and p.name not in keep)
