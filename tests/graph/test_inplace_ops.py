"""In-place ops: parts write their own pieces of the new version; a write through a view
cannot be split, and the simulator follows it only where the view aliases its base."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plan_helpers import replicate_rest
from torch import nn

from nnscaler.graph import IRGraph, PartitionError, RunPlanError, check_plan, run_plan
from nnscaler.trace import trace


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.add_(1.0)
        h = F.relu(h, inplace=True)
        v = h.view(2, 2, 6)
        v.mul_(2.0)  # writes h too, through the view
        return (h * 3).sum()


@pytest.fixture
def setup():
    torch.manual_seed(0)
    module, args = InPlace(), {"x": torch.randn(4, 4)}
    graph = IRGraph.from_graph(trace(module, args))
    with torch.no_grad():
        expected = module(**args)
    return graph, module, args, expected


def split_batch(graph: IRGraph, names: list[str]) -> None:
    for name in names:
        for device, part in enumerate(graph.partition(graph.select(name=name)[0], idx=0, dim=0, num=2)):
            graph.assign(part, device)


def test_parts_of_in_place_ops_write_their_pieces(setup):
    graph, module, args, expected = setup
    split_batch(graph, ["linear", "add_", "relu"])
    add = graph.select(name="add_")
    assert [(b.indmap, a.indmap) for op in add for b, a in op.mutations] == [
        (((0, 2), (0, 6)), ((0, 2), (0, 6))), (((2, 4), (0, 6)), ((2, 4), (0, 6)))]
    assert add[1].mutations[0][1].full.version == 1
    replicate_rest(graph, 2)  # the view, the write through it, and the rest: whole, twice
    check_plan(graph, 2)
    with torch.no_grad():
        torch.testing.assert_close(run_plan(graph, module, args), expected)


def test_a_write_through_a_view_cannot_be_split(setup):
    graph, *_ = setup
    mul_ = graph.select(name="mul_")[0]
    with pytest.raises(PartitionError, match=r"(?s)torch.Tensor.mul_.*test_inplace_ops.py:\d+ "
                                             r"`v.mul_\(2.0\).*writes t\d+@v2 in place through "
                                             r"a view.*replicate the op instead"):
        graph.partition(mul_, idx=0, dim=0, num=2)


def test_the_simulator_refuses_a_write_through_an_assembled_view(setup):
    graph, module, args, _ = setup
    split_batch(graph, ["linear", "view"])  # the view's value is assembled from two parts
    replicate_rest(graph, 2)
    check_plan(graph, 2)
    with torch.no_grad(), pytest.raises(RunPlanError, match="cannot reach its base"):
        run_plan(graph, module, args)
