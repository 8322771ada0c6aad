from __future__ import annotations

import pytest

from nnscaler.layout import primitives
from nnscaler.plugins import NNScalerPluginManager


@pytest.fixture(scope="session")
def adapters():
    """The adapter registry with the built-in primitives loaded."""
    return NNScalerPluginManager(autoload=False, plugins=[primitives]).adapters
