"""The documentation site (mkdocs.yml) builds in strict mode: a broken link or anchor, a
page missing from the nav, or an API name the reference cannot find fails this test.
The pages' python examples run in tests/test_docs.py.

Docstrings cross-reference in the site's own syntax, mkdocstrings' autorefs:
``[`ParallelModule`][nnscaler.ParallelModule]`` for an object the reference renders (a
target it does not render is an autorefs warning, so the strict build fails), plain
``ParallelModule`` in backticks for the rest. A Sphinx role (``:class:`X` ``) would show
as raw text on the site: one left in a docstring of ``nnscaler`` or of a plugin fails
``test_no_sphinx_role_in_a_docstring``."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nnscaler
from nnscaler import hookspecs

REPO = Path(__file__).resolve().parents[1]

#: a Sphinx role: ``:class:`X` ``, ``:py:meth:`X` ``, ``:ref:`x <y>` ``...
SPHINX_ROLE = re.compile(r"(?<![\w`]):(?:[a-z]+:)?[a-z]+:`[^`]+`")


def _sources() -> list[Path]:
    """The python files of the package and of every plugin (their tests included)."""
    files = [*(REPO / "nnscaler").rglob("*.py"), *(REPO / "plugins").glob("*/**/*.py")]
    return sorted(f for f in files if ".venv" not in f.parts and "build" not in f.parts)


def _docstrings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of the module's, classes' and functions' docstrings and of the
    attribute docstrings (a string statement after an assignment) in ``tree``."""
    found = []
    for node in ast.walk(tree):
        for child in getattr(node, "body", []) if isinstance(getattr(node, "body", None),
                                                             list) else []:
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant) \
                    and isinstance(child.value.value, str):
                found.append((child.lineno, child.value.value))
    return found


def _raw_roles(source: str) -> list[tuple[int, str]]:
    """The Sphinx roles in the docstrings and ``#:`` comments of ``source``."""
    hits = [(line, m.group(0)) for line, text in _docstrings(ast.parse(source))
            for m in SPHINX_ROLE.finditer(text)]
    hits += [(n, m.group(0)) for n, line in enumerate(source.splitlines(), 1)
             if line.lstrip().startswith("#:") for m in SPHINX_ROLE.finditer(line)]
    return hits


def test_the_role_finder_sees_roles_and_only_them():
    source = ('''"""Module :mod:`a.b`, see [`C`][nnscaler.C] and ``x``."""\n'''
              '''#: a :py:func:`f` here\n'''
              '''def f():\n    """Uses :class:`~a.C` and :meth:`C.m\n    <a.C.m>`."""\n'''
              '''x = ":class:`not a docstring`"\n'''
              '''def g():\n    """A dict: `d` and `a`:`b`: no role."""\n''')
    assert [role for _, role in _raw_roles(source)] == [
        ":mod:`a.b`", ":class:`~a.C`", ":meth:`C.m\n    <a.C.m>`", ":py:func:`f`"]


def test_no_sphinx_role_in_a_docstring():
    sources = _sources()
    assert len(sources) > 100 and any("plugins" in f.parts for f in sources)
    raw = [f"{f.relative_to(REPO)}:{line}: {role}" for f in sources
           for line, role in _raw_roles(f.read_text())]
    assert not raw, ("Sphinx roles show as raw text on the site; write "
                     "[`Name`][nnscaler.Name] for an object the reference renders, else "
                     "`Name`:\n" + "\n".join(raw))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    try:
        import mkdocstrings  # noqa: F401
    except ImportError:
        pytest.fail("the docs extra is not installed: pip install -e .[docs] (scripts/test.sh "
                    "installs it)")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    problems = [line for line in done.stderr.splitlines()
                if "WARNING" in line or "ERROR" in line or line.startswith("  - ")]
    hint = ("\n(a new page under docs/ needs one line in mkdocs.yml's nav)"
            if any("not included in the \"nav\"" in p for p in problems) else "")
    assert done.returncode == 0, "\n".join(problems or done.stderr.splitlines()[-20:]) + hint
    return out


def test_the_hook_reference_is_generated_from_hookspecs(site):
    page = (site / "plugins" / "index.html").read_text()
    hooks = [name for name in dir(hookspecs) if name.startswith("nnscaler_")]
    assert len(hooks) >= 5
    for name in hooks:
        assert f'id="nnscaler.hookspecs.{name}"' in page, name
        first_line = getattr(hookspecs, name).__doc__.strip().splitlines()[0]
        assert first_line.split(":")[0].rstrip(".") in page, name


def test_the_api_reference_covers_the_public_api(site):
    page = (site / "reference" / "api" / "index.html").read_text()
    documented = {"parallelize", "ComputeConfig", "ReuseType", "build_optimizer",
                  "ParallelModule", "merge_state_dicts", "load_merged_state_dicts",
                  "deduped_state_dict", "load_deduped_state_dict", "register_op", "verify",
                  "VerifyReport", "TransformRule", "IRGraph", "NNScalerError"}
    assert documented <= set(nnscaler.__all__)
    for name in sorted(documented):
        assert f'id="nnscaler.{name}"' in page or f'id="nnscaler.errors.{name}"' in page, name
    # text from the docstrings themselves, not only the names
    assert "Turn a module (or module class) into a" in page
    # their cross-references are links, not raw roles (which render as :class:<code>X</code>)
    assert 'href="#nnscaler.ParallelModule"' in page
    assert not re.search(r":[a-z]+:(`|<code>)", page)


def test_every_page_under_docs_is_in_the_site(site):
    pages = sorted(p.relative_to(REPO / "docs") for p in (REPO / "docs").rglob("*.md"))
    for page in pages:
        built = site / page.with_suffix("") / "index.html" if page.name != "index.md" \
            else site / page.parent / "index.html"
        assert built.is_file(), page
        # every fence was parsed as one (a ```python no-run fence too, scripts/mkdocs_hooks.py)
        assert "<p>```" not in built.read_text(), f"{page}: a code fence rendered as text"
