from __future__ import annotations

import os
import sys

import pytest
import torch

# the shared helpers of this directory (pipeline_helpers.py) and of tests/ (dist_utils.py)
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread is faster (and forked ranks inherit it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
