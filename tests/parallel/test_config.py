"""ReuseType and BroadcastGenFilesStrategy (ComputeConfig: tests/test_config.py)."""

from __future__ import annotations

import pytest

from nnscaler import BroadcastGenFilesStrategy, ReuseType


def test_enums_accept_strings():
    assert ReuseType("match") is ReuseType.MATCH
    assert ReuseType("OVERRIDE") is ReuseType.OVERRIDE
    assert ReuseType.parse("Moo", "reuse") is ReuseType.MOO
    assert ReuseType.parse(ReuseType.GRAPH, "reuse") is ReuseType.GRAPH
    assert [s.value for s in BroadcastGenFilesStrategy] == ["none", "all", "no_weights", "code"]
    assert BroadcastGenFilesStrategy("NO_WEIGHTS") is BroadcastGenFilesStrategy.NO_WEIGHTS
    assert ReuseType.MATCH == "match" and str(ReuseType.MATCH) == "match"
    with pytest.raises(ValueError, match="'match', 'override', 'moo', 'graph', got 'reuse'"):
        ReuseType.parse("reuse", "reuse")
