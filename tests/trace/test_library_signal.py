"""While the tracer runs, libraries see a trace (``torch.compiler.is_compiling()``), so
they take the paths they keep for ``torch.compile``: no shortcut that reads tensor data.
Reads that do not ask are still recorded (and refused by ``parallelize``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nnscaler.ir import verify_graph
from nnscaler.trace import trace
from nnscaler.trace.tracer import library_trace_signal


class SkipsAnAllOnesMask(nn.Module):
    """The shape of transformers' mask shortcut: drop the mask when it masks nothing,
    unless compiling (where reading ``mask.all()`` would break the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask):
        h = self.fc(x)
        if not torch.compiler.is_compiling() and mask.all():
            return h.sum()
        return (h * mask).sum()


def test_a_library_shortcut_is_skipped_and_the_graph_holds_for_every_mask():
    torch.manual_seed(0)
    model = SkipsAnAllOnesMask()
    x = torch.randn(3, 4)
    graph = trace(model, {"x": x, "mask": torch.ones(3, 4)})  # the dummy masks nothing
    assert graph.data_dependent == []
    padded = torch.ones(3, 4)
    padded[0, 2:] = 0
    verify_graph(graph, model, {"x": x, "mask": padded})  # another mask, same program
    assert not torch.compiler.is_compiling()


def test_reads_that_do_not_ask_are_still_recorded():
    class Branch(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    graph = trace(Branch(), {"x": torch.ones(2)})
    assert len(graph.data_dependent) == 1 and "__bool__" in graph.data_dependent[0]


def test_the_signal_is_off_after_a_failed_trace_and_nests():
    class Fails(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        trace(Fails(), {"x": torch.ones(2)})
    assert not torch.compiler.is_compiling()
    with library_trace_signal():
        with library_trace_signal():
            assert torch.compiler.is_compiling()
        assert torch.compiler.is_compiling()
    assert not torch.compiler.is_compiling()


def test_transformers_sees_a_trace():
    utils = pytest.importorskip("transformers.utils")
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(utils.is_torchdynamo_compiling())
            return x + 1

    trace(Probe(), {"x": torch.ones(2)})
    assert seen == [True]
    assert not utils.is_torchdynamo_compiling()
