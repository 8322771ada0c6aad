from __future__ import annotations

import pytest
import torch
from torch import nn

from nnscaler.ir import (
    CURRENT_DEVICE,
    Graph,
    GraphError,
    GraphMismatchError,
    InterpreterError,
    TensorKind,
    run_graph,
    verify_graph,
)
from nnscaler.trace import trace


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h * h + torch.ones(3, device=x.device)


@pytest.fixture
def graph() -> Graph:
    torch.manual_seed(0)
    return trace(Small(), {"x": torch.randn(2, 4)})


def test_producers_and_consumers(graph):
    linear, mul, ones, add = graph.ops
    h = linear.outputs[0]
    assert graph.producers(h) == [linear] and graph.consumers(h.full) == [mul]
    assert graph.producers(graph.inputs["x"]) == [] and graph.consumers(graph.inputs["x"]) == [linear]
    assert graph.producers(graph.outputs) == [add]
    assert [p.names for p in graph.parameters()] == [("fc.weight",), ("fc.bias",)]
    assert all(p.kind is TensorKind.PARAMETER and p.requires_grad for p in graph.parameters())
    assert ones.kwargs["device"] is CURRENT_DEVICE and len(graph) == 4


def test_validate_finds_a_read_before_any_write(graph):
    graph.ops.reverse()
    with pytest.raises(GraphError, match=r"reads t\d+, which no earlier op produces"):
        graph.validate()


def test_interpreter_errors_name_what_is_missing(graph):
    with pytest.raises(InterpreterError, match=r"traced with the forward arguments \['x'\]; missing: \['x'\]"):
        run_graph(graph, Small(), {})
    with pytest.raises(InterpreterError, match="needs the parameter fc.weight .* no entry by that name"):
        run_graph(graph, {"fc.bias": torch.zeros(3)}, {"x": torch.randn(2, 4)})
    with pytest.raises(InterpreterError, match="a tensor was traced where int 3 is given"):
        run_graph(graph, Small(), {"x": 3})


def test_verify_graph_notices_a_different_computation(graph):
    other = Small()
    verify_graph(graph, other, {"x": torch.randn(2, 4)})  # the same code, other weights: fine

    class Different(Small):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 1.5

    with pytest.raises(GraphMismatchError, match="output tensor 0 differs: max abs difference"):
        verify_graph(graph, Different(), {"x": torch.randn(2, 4)})


def test_run_ops_releases_values_after_their_last_reader(graph):
    from nnscaler.ir import leaf_values, release_schedule, run_ops

    linear, mul, ones, add = graph.ops
    env = leaf_values(graph, Small(), {"x": torch.randn(2, 4)})
    out = graph.output_tensors()[0].full
    schedule = release_schedule(graph.ops, [out])
    assert schedule[1] == [linear.outputs[0].full]  # h: last read by the mul
    run_ops(graph.ops, env, torch.device("cpu"), release=schedule)
    computed = {op.outputs[0].full for op in graph.ops}
    assert [f for f in env if f in computed] == [out]  # only what was asked to keep
    full = leaf_values(graph, Small(), {"x": torch.randn(2, 4)})
    run_ops(graph.ops, full, torch.device("cpu"))  # without a schedule: everything stays
    assert computed <= set(full)


def test_tensors_in_walks_trees_in_pytree_order(graph):
    import collections

    import torch.utils._pytree as pytree

    from nnscaler.ir import SubTensor, tensors_in

    a, b, c, d = [t for op in graph.ops for t in op.output_tensors()][:4]
    point = collections.namedtuple("point", "x y")
    tree = [a, (1, "s", None, {"k": b, "j": [c, torch.float32]}), point(d, 2.0),
            collections.OrderedDict(z=a), slice(1, 2)]
    expected = [x for x in pytree.tree_leaves(tree) if isinstance(x, SubTensor)]
    assert [id(t) for t in tensors_in(tree)] == [id(t) for t in expected]
    assert len(expected) == 5
