"""Dummy arguments that alias each other (the same tensor twice, a view of another
argument, a parameter or buffer given as an argument): each argument leaf must still be a
graph input of its own, because at run time the arguments can differ. Before, the second
occurrence was read as the first and the graph silently computed something else."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nnscaler.ir import Graph, TensorKind, run_graph, verify_graph
from nnscaler.trace import trace

STRATEGIES = ("real", "meta")


class Sub(nn.Module):
    """The issue's repro: ``(x * w - y).sum()``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * self.w - y).sum()


def check_distinct(graph: Graph, names: list[str]) -> None:
    """One INPUT tensor per named leaf, no two the same."""
    fulls = [leaf.full for leaf in graph.input_tensors()]
    assert sorted(n for f in fulls for n in f.names) == sorted(names)
    assert len({id(f) for f in fulls}) == len(fulls)
    assert all(f.kind is TensorKind.INPUT for f in fulls)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_same_tensor_twice_is_two_inputs(strategy):
    t = torch.ones(3)
    model = Sub()
    graph = trace(model, {"x": t, "y": t}, strategy=strategy)
    check_distinct(graph, ["x", "y"])
    x, y = torch.ones(3), torch.zeros(3)
    got = run_graph(graph, model, {"x": x, "y": y})
    assert float(got.detach()) == float(model(x, y).detach()) == 6.0
    verify_graph(graph, model, {"x": torch.randn(3), "y": torch.randn(3)})


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, batch: dict, pair: list) -> torch.Tensor:
        return (self.fc(batch["a"]) * batch["b"] - pair[0] + 2 * pair[1]).sum()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_same_tensor_inside_containers_is_one_input_per_position(strategy):
    t = torch.randn(2, 3)
    model = Nested()
    graph = trace(model, {"batch": {"a": t, "b": t}, "pair": [t, t]}, strategy=strategy)
    check_distinct(graph, ["batch['a']", "batch['b']", "pair[0]", "pair[1]"])
    args = {"batch": {"a": torch.randn(2, 3), "b": torch.randn(2, 3)},
            "pair": [torch.randn(2, 3), torch.randn(2, 3)]}
    verify_graph(graph, model, args)


class Views(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor, row: torch.Tensor, xt: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x.mul_(2)  # a write to (a copy of) x: never reaches row or xt
        return ((x @ self.w) * row + xt).sum()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_views_of_another_argument_are_not_linked(strategy):
    x = torch.randn(3, 3)
    model = Views()
    graph = trace(model, {"x": x, "row": x[0], "xt": x.t()}, strategy=strategy)
    check_distinct(graph, ["x", "row", "xt"])
    verify_graph(graph, model, {"x": torch.randn(3, 3), "row": torch.randn(3),
                                "xt": torch.randn(3, 3)})


class Writes(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.add_(1)  # the model writes its argument x in place
        return x * y


def test_an_in_place_write_does_not_reach_an_aliased_argument():
    """While tracing, x and y hold the same memory; the graph must not record y as x's
    new version (at run time they are separate tensors)."""
    x = torch.ones(3)
    graph = trace(Writes(), {"x": x, "y": x[:]}, strategy="real")
    check_distinct(graph, ["x", "y"])
    got = run_graph(graph, Writes(), {"x": torch.ones(3), "y": torch.full((3,), 5.0)})
    assert got.tolist() == [10.0, 10.0, 10.0]


class State(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.register_buffer("b", torch.randn(3))
        self.const = torch.randn(3)  # a plain attribute: a constant of the graph

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (x * self.w + y * self.b + z * self.const).sum()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameters_buffers_and_constants_given_as_arguments_stay_apart(strategy):
    model = State()
    graph = trace(model, {"x": model.w, "y": model.b, "z": model.const}, strategy=strategy)
    check_distinct(graph, ["x", "y", "z"])
    assert len(graph.parameters()) == len(graph.buffers()) == len(graph.constants()) == 1
    assert len(graph.input_tensors()) == 3
    verify_graph(graph, model, {"x": torch.randn(3), "y": torch.randn(3), "z": torch.randn(3)})


def test_tracing_aliased_arguments_leaves_them_and_the_module_unchanged():
    model = Sub()
    w = model.w.detach().clone()
    t = torch.ones(3)
    trace(Writes(), {"x": t, "y": t})
    assert t.tolist() == [2.0, 2.0, 2.0]  # x was written in place, as eager would
    trace(model, {"x": model.w, "y": model.w})
    assert torch.equal(model.w.detach(), w)
