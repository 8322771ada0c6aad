"""``docs/migrating.md`` stays true: every row of its tables has a status of ``same``,
``extended`` or ``differs`` (none missing), every nnScaler name in the first column
imports here, and every test named in the last column exists."""

from __future__ import annotations

import re
from pathlib import Path

from nnscaler.trainer.fields import resolve_object

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "migrating.md"
STATUSES = {"same", "extended", "differs"}


def _rows() -> list[list[str]]:
    rows = []
    for line in PAGE.read_text().splitlines():
        if not line.startswith("| ") or line.startswith("| ---") or line.startswith(
                "| nnScaler 0.8"):
            continue
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _test_exists(ref: str) -> bool:
    path, _, name = ref.partition("::")
    file = REPO / path
    return file.is_file() and (not name or re.search(rf"^def {name}\(", file.read_text(),
                                                     re.M) is not None)


def test_every_row_has_a_status_a_name_that_imports_and_a_test():
    rows = _rows()
    assert len(rows) > 40
    for form, status, _, checked_by in rows:
        assert status in STATUSES, (form, status)
        ref = checked_by.strip("`")
        assert _test_exists(ref), (form, ref)
        name = form.strip("`")
        if name.startswith("nnscaler."):
            assert resolve_object(name, "docs/migrating.md") is not None, name


def test_every_name_of_nnscalers_top_level_is_listed():
    text = PAGE.read_text()
    for name in ("parallelize", "build_optimizer", "ComputeConfig", "ReuseType",
                 "BroadcastGenFilesStrategy", "ParallelModule", "merge_state_dicts",
                 "load_merged_state_dict", "deduped_state_dict", "load_deduped_state_dict",
                 "load_sharded_state_dict", "broadcast_weights", "sync_grad_when",
                 "register_op", "init", "uninit", "constant_folding", "no_constant_folding",
                 "fold_constant", "anchor"):
        assert f"| `nnscaler.{name}` |" in text, name
