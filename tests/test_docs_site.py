"""The documentation site (mkdocs.yml) builds in strict mode: a broken link or anchor, a
page missing from the nav, or an API name the reference cannot find fails this test.
The pages' python examples run in tests/test_docs.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import nnscaler
from nnscaler import hookspecs

REPO = Path(__file__).resolve().parents[1]


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


def test_every_page_under_docs_is_in_the_site(site):
    pages = sorted(p.relative_to(REPO / "docs") for p in (REPO / "docs").rglob("*.md"))
    for page in pages:
        built = site / page.with_suffix("") / "index.html" if page.name != "index.md" \
            else site / page.parent / "index.html"
        assert built.is_file(), page
        # every fence was parsed as one (a ```python no-run fence too, scripts/mkdocs_hooks.py)
        assert "<p>```" not in built.read_text(), f"{page}: a code fence rendered as text"
