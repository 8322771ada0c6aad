"""No function of ``nnscaler`` or of a plugin runs over 80 lines (decorators and docstring
included) unless a one-line ``# long: <reason>`` comment sits on the line above its
``def`` (or above its decorators), saying why it reads better whole; and no module of
``nnscaler`` runs over 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT = 80


def _long_functions(source: str) -> list[tuple[int, str, int]]:
    """(line of the ``def``, name, length) of every function over LIMIT lines in
    ``source`` without a ``# long:`` reason."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - start + 1
            reason = lines[start - 2].strip() if start >= 2 else ""
            if length > LIMIT and not (reason.startswith("# long:") and reason[7:].strip()):
                found.append((node.lineno, node.name, length))
    return found


def test_the_finder_counts_lines_and_reads_reasons():
    body = "    x = 1\n" * LIMIT
    source = (f"def short():\n{body[:-10]}\n"
              f"def long():\n{body}\n"
              f"# long: a table of cases\n@staticmethod\ndef explained():\n{body}\n"
              f"# long:\ndef no_reason():\n{body}")
    assert [(name, n) for _, name, n in _long_functions(source)] == [
        ("long", LIMIT + 1), ("no_reason", LIMIT + 1)]


def test_no_function_over_80_lines_without_a_reason():
    files = [*(REPO / "nnscaler").rglob("*.py"), *(REPO / "plugins").glob("*/nnscaler_*/**/*.py")]
    assert len(files) > 100
    long = [f"{f.relative_to(REPO)}:{line} {name} ({n} lines)" for f in sorted(files)
            for line, name, n in _long_functions(f.read_text())]
    assert not long, (f"functions over {LIMIT} lines: split them into named helpers, or put "
                      f"'# long: <why it reads better whole>' on the line above the def:\n"
                      + "\n".join(long))



MODULE_LIMIT = 600


def _long_modules(root: Path) -> list[str]:
    """``path (n lines)`` of every ``.py`` file under ``root`` over MODULE_LIMIT lines."""
    found = []
    for f in sorted(root.rglob("*.py")):
        n = len(f.read_text().splitlines())
        if n > MODULE_LIMIT:
            found.append(f"{f.relative_to(root).as_posix()} ({n} lines)")
    return found


def test_the_module_finder_counts_lines(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * MODULE_LIMIT)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * (MODULE_LIMIT + 1))
    assert _long_modules(tmp_path) == [f"sub/long.py ({MODULE_LIMIT + 1} lines)"]


def test_no_kernel_module_over_600_lines():
    long = _long_modules(REPO / "nnscaler")
    assert not long, (f"modules of nnscaler over {MODULE_LIMIT} lines: split them by role (one "
                      f"concern per module, named for it; keep an import path that users or "
                      f"plugins use working by re-export):\n" + "\n".join(long))
