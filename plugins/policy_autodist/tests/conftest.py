from __future__ import annotations

import os
import sys

import pytest

# the repository's multi-process helper (tests/dist_utils.py) when run from the repository
_REPO_TESTS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests")
if os.path.isdir(_REPO_TESTS):
    sys.path.insert(0, os.path.abspath(_REPO_TESTS))


@pytest.fixture
def profile_dir(tmp_path):
    """A private profile cache, so that tests never read or write ~/.cache."""
    return str(tmp_path / "profile")
