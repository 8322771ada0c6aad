"""The generated folder's format: its file names, the ``config.json`` schema and the
digests of its files. One writer (`new_config`, `write_config`) and one reader
(`read_config`), used by code generation (which writes the code and weights),
``parallelize`` (which writes ``config.json`` and decides on reuse) and the runtime (which
reads the module's state from it). This module is on the ground floor: it imports no
other part of nnscaler.

A generated folder (one per parallelized module instance)::

    gencode{rank}.py   one per runtime rank          (nnscaler.codegen)
    fullmodel.pt       the traced module's state     (nnscaler.codegen)
    graph.pkl          the traced graph, for ReuseType.GRAPH (nnscaler.parallel.graph_pickle)
    config.json        written LAST: a folder without it is incomplete (nnscaler.parallel)

``config.json`` (format `FORMAT_VERSION`) holds:

- ``format``: `FORMAT_VERSION`;
- ``match``: what ``ReuseType.MATCH`` compares: ``compute_config`` (its JSON form),
  ``policy``, ``module`` (``class``, ``source_sha256``, ``training``, and the rows
  ``parameters`` ``[name, shape, dtype, requires_grad]`` and ``buffers``
  ``[name, shape, dtype, persistent]``, which the runtime reads back with
  `saved_state_rows`), ``inputs``, ``nnscaler_version``;
- ``module_class``, ``instance_name``;
- ``files``: every other file of the folder; ``sha256``: the digest of each
  (`changed_files` compares them);
- ``versions``: of nnscaler, torch and python; and what the caller adds.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CONFIG_FILE",
    "FORMAT_VERSION",
    "FULLMODEL",
    "GRAPH_FILE",
    "changed_files",
    "code_digests",
    "file_digest",
    "gencode_name",
    "is_gencode",
    "new_config",
    "read_config",
    "saved_state_rows",
    "write_config",
]

#: The initial weights of the traced module (every parameter and buffer by name).
FULLMODEL = "fullmodel.pt"
#: What the folder was made from, the list of its files and their digests; written last.
CONFIG_FILE = "config.json"
#: The traced graph (``ReuseType.GRAPH``).
GRAPH_FILE = "graph.pkl"
#: The version of the ``config.json`` schema (2: it records the sha256 of every file).
FORMAT_VERSION = 2

_GENCODE_PREFIX, _GENCODE_SUFFIX = "gencode", ".py"


def gencode_name(rank: int) -> str:
    """The file name of rank ``rank``'s generated code: ``gencode{rank}.py``."""
    return f"{_GENCODE_PREFIX}{rank}{_GENCODE_SUFFIX}"


def is_gencode(name: str) -> bool:
    """Whether ``name`` is the file name of some rank's generated code."""
    middle = name[len(_GENCODE_PREFIX):-len(_GENCODE_SUFFIX)]
    return (name.startswith(_GENCODE_PREFIX) and name.endswith(_GENCODE_SUFFIX)
            and middle.isdigit())


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes, as hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# -- the writer ------------------------------------------------------------------------------
def new_config(outdir: Path, match: Mapping[str, Any], *, module_class: str,
               instance_name: str | None, versions: Mapping[str, str],
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``outdir`` as it is now: every other file in it, listed with
    its digest, under ``match`` and the other fields of the schema."""
    names = sorted(p.name for p in Path(outdir).iterdir()
                   if p.is_file() and p.name != CONFIG_FILE)
    return {
        "format": FORMAT_VERSION,
        "match": dict(match),
        "module_class": module_class,
        "instance_name": instance_name,
        "files": names,
        "sha256": {name: file_digest(Path(outdir) / name) for name in names},
        "versions": dict(versions),
        **dict(extra or {}),
    }


def write_config(outdir: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` as ``outdir``'s ``config.json``, atomically (a temporary file renamed
    into place): a reader sees the old file or the new one, never half of one."""
    tmp = Path(outdir) / f".{CONFIG_FILE}.tmp"
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, Path(outdir) / CONFIG_FILE)


# -- the reader ------------------------------------------------------------------------------
def read_config(outdir: Path, *, complete: bool = True) -> dict[str, Any] | None:
    """``outdir``'s ``config.json``, or None when there is none that can be read. With
    ``complete`` (the default), also None unless it is of `FORMAT_VERSION` and every
    file it lists is there: a folder that is not a finished generation."""
    outdir = Path(outdir)
    try:
        data = json.loads((outdir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if not complete:
        return data
    if data.get("format") != FORMAT_VERSION:
        return None
    names = data.get("files")
    if not isinstance(names, list) or not all((outdir / f).is_file() for f in names):
        return None
    if not isinstance(data.get("sha256"), dict):
        return None
    return data


def saved_state_rows(data: Mapping[str, Any]) -> tuple[list[Any], list[Any]] | None:
    """The ``(parameters, buffers)`` rows of the module that a ``config.json`` describes
    (``[name, shape, dtype, requires_grad | persistent]``), or None when it has none."""
    try:
        module = data["match"]["module"]
        params, buffers = module["parameters"], module["buffers"]
    except (KeyError, TypeError):
        return None
    if not isinstance(params, list) or not isinstance(buffers, list):
        return None
    return params, buffers


def changed_files(outdir: Path, data: Mapping[str, Any],
                  names: Sequence[str] | None = None) -> list[str]:
    """The files of ``outdir`` (all those ``data`` lists, or ``names``) whose sha256 is
    not the one ``config.json`` recorded when they were generated (or that are missing)."""
    recorded = data.get("sha256") or {}
    out = []
    for name in (data.get("files", []) if names is None else names):
        path = Path(outdir) / name
        if recorded.get(name) is None or not path.is_file() or file_digest(path) != recorded[name]:
            out.append(name)
    return out


def code_digests(data: Mapping[str, Any] | None) -> dict[str, str]:
    """The recorded sha256 of every ``gencode{rank}.py`` of a ``config.json``."""
    recorded = (data or {}).get("sha256") or {}
    return {n: d for n, d in recorded.items() if is_gencode(n)}
