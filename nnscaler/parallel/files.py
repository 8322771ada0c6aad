"""Generated files that were edited after generation: ``config.json`` records the sha256 of
every file (`nnscaler.gendir`), files that differ are never reused or run
(`GenFilesChangedError`, `changed_message`), unless their new digests are
recorded on purpose (`accept_edited_files`).

The rest of what ``parallelize`` keeps under ``gen_savedir`` is split by concern: the
folder's format in `nnscaler.gendir`; where it lives in `paths`; what is
compared for reuse in `fingerprint`; writing it whole in `staging`; the
instance lock in `locks`; the traced graph in `graph_pickle`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from nnscaler import gendir
from nnscaler.errors import GenFilesChangedError
from nnscaler.parallel.locks import instance_lock

__all__ = ["GenFilesChangedError", "accept_edited_files", "changed_message"]


def changed_message(outdir: Path, names: Sequence[str], *, reuse: str) -> str:
    """The error text for files that changed after generation."""
    listed = ", ".join(str(outdir / n) for n in names)
    return (
        f"reuse={reuse!r}: {listed} differ(s) from what nnscaler generated (the sha256 "
        f"recorded in {gendir.CONFIG_FILE} does not match), so it is not reused and its code is "
        f"not run. Fix: regenerate with reuse='override' (your change is lost); or, if you "
        f"edited the file on purpose, record its new hash with "
        f"nnscaler.parallel.files.accept_edited_files({str(outdir)!r})"
    )


def accept_edited_files(outdir: str | os.PathLike[str]) -> list[str]:
    """Record the current sha256 of every file listed in ``outdir``'s ``config.json``
    (for files you edited on purpose); returns the names whose hash changed. Holds the
    instance's lock while it writes."""
    outdir = Path(outdir)
    with instance_lock(outdir):
        data = gendir.read_config(outdir, complete=False)
        if data is None:
            raise FileNotFoundError(
                f"{str(outdir / gendir.CONFIG_FILE)!r} is missing or not JSON: "
                f"accept_edited_files takes the folder of a finished generation"
            )
        digests = {n: gendir.file_digest(outdir / n) for n in data.get("files", [])}
        changed = sorted(n for n, d in digests.items() if data.get("sha256", {}).get(n) != d)
        data["sha256"] = digests
        gendir.write_config(outdir, data)
    return changed
