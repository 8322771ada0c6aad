from __future__ import annotations

import multiprocessing
import os
import sys
import warnings

import pytest

# tests/dist_utils.py: the multi-process helper, importable from every test module
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True, scope="session")
def _private_op_check_cache(tmp_path_factory):
    """Passed custom-op checks and autodist profiles are kept on disk: keep the suite's out
    of ~/.cache."""
    os.environ.setdefault("NNSCALER_CACHE_DIR", str(tmp_path_factory.mktemp("nnscaler-cache")))
    yield


@pytest.fixture(autouse=True, scope="session")
def _no_child_outlives_the_suite():
    """A child process a failed test left running would hang the interpreter's exit
    (multiprocessing joins its children then), and CI with it: kill any at the end."""
    yield
    for child in multiprocessing.active_children():
        warnings.warn(f"killing the child process {child.name} (pid {child.pid}) that a "
                      f"test left running", stacklevel=1)
        child.kill()
        child.join(10)


@pytest.fixture
def fresh_plugins(monkeypatch):
    """A clean plugin state: user-registered ops and the loaded manager are restored after."""
    from nnscaler import plugins

    saved = list(plugins.user_ops.entries)
    plugins.reset_plugin_manager()
    yield plugins
    plugins.user_ops.entries[:] = saved
    plugins.reset_plugin_manager()
