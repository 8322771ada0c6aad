"""Every ```python block in docs/ runs: the documentation cannot drift from the code.

Blocks of one page run top to bottom in one namespace, in a temporary working directory.
A block fenced as ```python no-run is shown but not run (for snippets that need several
processes; those are covered by the tests they name).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"^```python[ \t]*(?P<flags>[^\n]*)\n(?P<code>.*?)^```", re.S | re.M)
PAGES = sorted(DOCS.rglob("*.md"))


def python_blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    out = []
    for m in BLOCK.finditer(text):
        if "no-run" in m.group("flags"):
            continue
        line = text.count("\n", 0, m.start()) + 2
        out.append((line, m.group("code")))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_examples_run(page, tmp_path, monkeypatch, fresh_plugins):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for line, code in python_blocks(page):
        padded = "\n" * (line - 1) + code  # tracebacks point at the page's own lines
        exec(compile(padded, str(page), "exec"), namespace)
