"""mkdocs hooks (``hooks:`` in mkdocs.yml) for the documentation site.

A page marks a python example that the test suite must not run as ```python no-run
(tests/test_docs.py). Markdown's fence parser takes no word after the language, so the
site sees the flag removed: the block is highlighted as python like any other.
"""

from __future__ import annotations

import re
from typing import Any

_NO_RUN = re.compile(r"^(\s*```python)[ \t]+no-run[ \t]*$", re.M)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return _NO_RUN.sub(r"\1", markdown)
