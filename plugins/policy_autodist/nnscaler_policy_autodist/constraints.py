"""Partition constraints: a YAML file that limits the splits ``autodist`` may choose.

The file is a list of entries; each selects ops by ``module`` (a module path prefix or a
glob, as [`nnscaler.graph.IRGraph.select`][nnscaler.IRGraph.select] reads it) and/or ``name`` (the
op's name, full or its last part, or a glob), and lists the choices they may take in ``splits``:
``replicate``, ``"idx,dim"`` (split input ``idx`` along dim ``dim``), or ``"idx,dim x
idx,dim"`` (a two-axis split, `nnscaler_policy_autodist.twoaxis`: the data split of the
op, then the split of its parts, in every factor pair of the stage's devices)::

    - module: gpt.blocks.*.mlp.fc
      name: linear
      splits: ["1,0"]            # column split only
    - module: gpt.lm_head
      splits: [replicate]

An entry that selects no op, an unknown field, or a malformed split is an error naming
the entry. Ops selected by several entries may take what every entry allows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from nnscaler.extend import IRGraph
from nnscaler_policy_autodist.config import AutoDistError

__all__ = ["ConstraintError", "load_constraints"]

FIELDS = ("module", "name", "splits")


class ConstraintError(AutoDistError):
    """The partition constraints file is malformed or names what the model lacks."""


def _split(text: Any, where: str) -> tuple | str:
    if text == "replicate":
        return "replicate"
    try:
        halves = [tuple(int(p) for p in half.split(",")) for half in str(text).split("x")]
        if len(halves) > 2 or any(len(h) != 2 for h in halves):
            raise ValueError
    except ValueError:
        raise ConstraintError(f"{where}: the split {text!r} must be 'replicate' or "
                              f"'idx,dim' (e.g. '1,0': input 1 along dim 0), or "
                              f"'idx,dim x idx,dim' (a two-axis split: the data split, "
                              f"then its parts' split, e.g. '0,0 x 1,0')") from None
    return halves[0] if len(halves) == 1 else (halves[0], halves[1])


def load_constraints(path: Path | None, graph: IRGraph) -> dict[int, set]:
    """``{op id: allowed choices}`` from the file at ``path`` (``{}`` without one)."""
    if path is None:
        return {}
    try:
        entries = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ConstraintError(f"partition constraints {str(path)!r} is not valid YAML: "
                              f"{e}") from None
    if entries is None:
        return {}
    if not isinstance(entries, list):
        raise ConstraintError(f"partition constraints {str(path)!r} must be a list of "
                              f"entries (- module: ..., splits: [...]), got "
                              f"{type(entries).__name__}")
    allowed: dict[int, set] = {}
    for n, entry in enumerate(entries):
        where = f"partition constraints {str(path)!r}, entry {n}"
        if not isinstance(entry, dict):
            raise ConstraintError(f"{where}: an entry is a mapping with {', '.join(FIELDS)}; "
                                  f"got {entry!r}")
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            raise ConstraintError(f"{where}: unknown field(s) {unknown}; an entry has "
                                  f"{', '.join(FIELDS)}")
        if "module" not in entry and "name" not in entry:
            raise ConstraintError(f"{where}: give 'module' and/or 'name' to select ops")
        splits = entry.get("splits")
        if not isinstance(splits, list) or not splits:
            raise ConstraintError(f"{where}: 'splits' must be a non-empty list of "
                                  f"'replicate' or 'idx,dim'; got {splits!r}")
        choices = {_split(s, where) for s in splits}
        ops = graph.select(name=entry.get("name"), module=entry.get("module"))
        if not ops:
            paths = sorted({op.module_path for op in graph.nodes() if op.module_path})
            raise ConstraintError(
                f"{where}: no op of the model matches module={entry.get('module')!r} "
                f"name={entry.get('name')!r}. Module paths of this model include "
                f"{paths[:8]}{' ...' if len(paths) > 8 else ''}")
        for op in ops:
            if op.oid in allowed:
                allowed[op.oid] &= choices
            else:
                allowed[op.oid] = set(choices)
    return allowed
