"""Refusing graphs that depend on tensor data.

The tracer runs ``forward`` once. A Python value read from tensor data (``x.item()``,
``if x.sum() > 0:``) or a size that depends on data (``torch.nonzero(x)``, ``x[mask]``,
``torch.where(cond)``) is fixed in the graph at what the dummy inputs gave: another batch
would take the other branch or have another size, and the generated code would not. The
tracer lists each such read in ``graph.data_dependent``; `check_data_dependent` turns
the list into one error naming every model line, unless the user accepted it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from nnscaler.trace.errors import DataDependentError
from nnscaler.trace.source import code_line

#: How a user accepts the traced values explicitly (named in the error).
ALLOW = "ComputeConfig(..., allow_data_dependent=True)"


def _split(entry: str) -> tuple[str, str, str, int]:
    """``'torch.nonzero -> size [4, 2] at /m.py:24'`` -> (call, what, file, line)."""
    head, _, where = entry.rpartition(" at ")
    call, _, what = head.partition(" -> ")
    filename, _, line = where.rpartition(":")
    try:
        return call, what, filename, int(line)
    except ValueError:
        return call, what, where, 0


def describe(entries: Sequence[str]) -> list[str]:
    """One line per model line that read data: where, the code, what was read (with a
    count when a loop read it several times)."""
    grouped: dict[tuple[str, int, str, str], list[str]] = {}
    for entry in entries:
        call, what, filename, line = _split(entry)
        kind = "size" if what.startswith("size ") else "value"
        grouped.setdefault((filename, line, call, kind), []).append(what.removeprefix("size "))
    lines = []
    for (filename, line, call, kind), seen in grouped.items():
        where = f"{os.path.basename(filename)}:{line}" if filename else "<unknown>"
        shown = ", ".join(dict.fromkeys(seen))
        if len(shown) > 60:
            shown = shown[:57] + "..."
        times = f" ({len(seen)} times)" if len(seen) > 1 else ""
        lines.append(f"{where} {code_line(filename, line)!r}: {call} gave the {kind} "
                     f"{shown}{times}; in {filename}")
    return lines


def check_data_dependent(entries: Sequence[str], *, allow: bool) -> None:
    """Raise `DataDependentError` naming every read in ``entries`` (the traced
    graph's ``data_dependent``) unless ``allow``."""
    if allow or not entries:
        return
    listed = "\n  ".join(describe(entries))
    raise DataDependentError(
        f"the model reads values or sizes from tensor data while it runs, and the traced "
        f"graph keeps what the dummy inputs gave for every batch (another batch could take "
        f"another branch, or have another size, and the generated code would not follow):"
        f"\n  {listed}\n"
        f"Fix, for each line: compute it with tensor ops (torch.where(cond, a, b) instead "
        f"of an if on a tensor; a mask multiply instead of boolean indexing or "
        f"torch.nonzero); or move the code into a function registered with "
        f"nnscaler.register_op, which runs whole at run time; or, if the traced values hold "
        f"for every batch, accept them explicitly with {ALLOW}."
    )
