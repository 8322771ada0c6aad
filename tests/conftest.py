from __future__ import annotations

import pytest


@pytest.fixture
def fresh_plugins(monkeypatch):
    """A clean plugin state: user-registered ops and the loaded manager are restored after."""
    from nnscaler import plugins

    saved = list(plugins.user_ops.entries)
    plugins.reset_plugin_manager()
    yield plugins
    plugins.user_ops.entries[:] = saved
    plugins.reset_plugin_manager()
