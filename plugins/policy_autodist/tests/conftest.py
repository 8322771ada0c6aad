from __future__ import annotations

import pytest


@pytest.fixture
def profile_dir(tmp_path):
    """A private profile cache, so that tests never read or write ~/.cache."""
    return str(tmp_path / "profile")
