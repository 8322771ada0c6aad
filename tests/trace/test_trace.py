"""The tracer's edge cases, one small module each; every traced graph is replayed by the
interpreter and must reproduce the module bit for bit (outputs and gradients)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnscaler.ir import CURRENT_DEVICE, Graph, Op, TensorKind, run_graph, verify_graph
from nnscaler.trace import OpaqueOpWarning, trace

STRATEGIES = ("real", "meta")


def traced(module: nn.Module, args: dict, strategy: str = "real") -> Graph:
    graph = trace(module, args, strategy=strategy)
    graph.validate()
    verify_graph(graph, module, args)
    return graph


def ops_named(graph: Graph, suffix: str) -> list[Op]:
    return [op for op in graph.ops if op.name.endswith(suffix)]


# -- inputs and outputs -------------------------------------------------------------------


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, batch: dict, pair: tuple, items: list) -> dict:
        a = self.fc(batch["x"]) + pair[0]
        b = pair[1]["y"] * items[1]
        return {"sum": a, "parts": [b, (a * 2, 3)], "n": items[0]}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nested_inputs_and_outputs_keep_their_structure(strategy):
    args = {
        "batch": {"x": torch.randn(2, 4, requires_grad=True)},
        "pair": (torch.randn(2, 4), {"y": torch.randn(3)}),
        "items": [5, torch.randn(3)],
    }
    graph = traced(Nested(), args, strategy)
    assert set(graph.inputs) == {"batch", "pair", "items"}
    x = graph.inputs["batch"]["x"]
    assert x.full.kind is TensorKind.INPUT and x.full.names == ("batch['x']",)
    assert x.full.requires_grad and x.shape == (2, 4)
    assert graph.inputs["items"][0] == 5
    assert graph.inputs["pair"][1]["y"].full.names == ("pair[1]['y']",)
    out = graph.outputs
    assert set(out) == {"sum", "parts", "n"} and out["n"] == 5 and out["parts"][1][1] == 3
    assert graph.producers(out["sum"])[0].name == "torch.add"
    result = run_graph(graph, Nested(), args)  # other weights, same structure
    assert isinstance(result["parts"][1], tuple) and result["parts"][1][0].shape == (2, 4)


class WithDefaults(nn.Module):
    def forward(self, x: torch.Tensor, scale: float = 2.0, mask: torch.Tensor | None = None,
                *, shift: int = 1) -> torch.Tensor:
        y = x * scale + shift
        return y if mask is None else y * mask


def test_keyword_arguments_with_defaults():
    graph = traced(WithDefaults(), {"x": torch.randn(3)})
    assert list(graph.inputs) == ["x"]
    assert [op.inputs[1] for op in ops_named(graph, "mul")] == [2.0]
    graph = traced(WithDefaults(), {"x": torch.randn(3), "mask": torch.ones(3), "shift": 5})
    assert list(graph.inputs) == ["x", "mask", "shift"] and len(ops_named(graph, "mul")) == 2
    assert ops_named(graph, "add")[0].inputs[1] == 5


# -- modules, parameters, buffers -----------------------------------------------------------


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Inner(), Inner()])
        self.shared = Inner()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.shared(self.shared(x))  # one module, called twice
        return self.head(x)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_module_paths_and_tied_and_shared_parameters(strategy):
    graph = traced(Outer(), {"ids": torch.randint(0, 10, (2, 3))}, strategy)
    paths = [(op.module_path, op.module_class.rsplit(".", 1)[-1]) for op in graph.ops]
    assert ("layers.1.proj", "Linear") in paths and ("layers.1", "Inner") in paths
    assert paths.count(("shared.proj", "Linear")) == 2
    params = graph.named_parameters()
    assert params["emb.weight"] is params["head.weight"]
    assert params["emb.weight"].names == ("emb.weight", "head.weight")
    assert len(graph.parameters()) == len(list(Outer().parameters()))  # each tensor once
    shared = params["shared.proj.weight"]
    assert [op.module_path for op in graph.consumers(shared)] == ["shared.proj", "shared.proj"]
    tied = [op for op in graph.ops if op.module_path in ("emb", "head")]
    assert all(params["emb.weight"] in [t.full for t in op.input_tensors()] for op in tied)
    assert "tied parameter emb.weight: also head.weight" in str(graph)


class Buffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 3.0))
        self.register_buffer("offset", torch.ones(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.offset


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_persistent_and_non_persistent_buffers(strategy):
    graph = traced(Buffers(), {"x": torch.randn(2, 4)}, strategy)
    by_name = {b.names[0]: b for b in graph.buffers()}
    assert by_name["scale"].persistent and not by_name["offset"].persistent
    assert all(b.kind is TensorKind.BUFFER and not b.requires_grad for b in by_name.values())


class Captured(nn.Module):
    """Holds a tensor without registering it: the graph keeps it as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.arange(4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unregistered_tensors_become_constants(strategy):
    graph = traced(Captured(), {"x": torch.randn(4)}, strategy)
    (const,) = graph.constants()
    assert torch.equal(const.value, torch.arange(4.0)) and const.name.startswith("c")


# -- control flow ---------------------------------------------------------------------------


class TrainingBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return x * 2
        return x.neg()


def test_self_training_takes_the_live_branch():
    m = TrainingBranch()
    assert [op.name for op in traced(m.train(), {"x": torch.randn(3)}).ops] == ["torch.mul"]
    assert [op.name for op in traced(m.eval(), {"x": torch.randn(3)}).ops] == ["torch.neg"]


class Loops(nn.Module):
    def __init__(self, n: int, double: bool) -> None:
        super().__init__()
        self.n, self.double = n, double

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n):
            x = x + i
        if self.double:
            x = x * 2
        return x


def test_python_loops_unroll_and_ifs_on_python_values_execute():
    graph = traced(Loops(3, True), {"x": torch.randn(2)})
    assert [op.name for op in graph.ops] == ["torch.add"] * 3 + ["torch.mul"]
    assert [op.inputs[1] for op in graph.ops[:3]] == [0, 1, 2]
    assert len(traced(Loops(2, False), {"x": torch.randn(2)}).ops) == 2


class ShapeScalars(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape
        n = x.size(-1) * x.dim() + x.numel() + len(x)
        return x.reshape(t, b) * n


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scalars_derived_from_shapes_are_folded(strategy):
    graph = traced(ShapeScalars(), {"x": torch.randn(2, 3)}, strategy)
    assert [op.name.rsplit(".", 1)[-1] for op in graph.ops] == ["reshape", "mul"]
    assert graph.ops[1].inputs[1] == 3 * 2 + 6 + 2
    assert graph.data_dependent == []


class Creation(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        pos = torch.arange(t, device=x.device)
        mask = torch.triu(torch.ones(t, t, device=x.device), diagonal=1)
        zeros = torch.zeros_like(x)
        return x + pos + mask.sum(0) + zeros


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tensor_creation_inside_forward(strategy):
    graph = traced(Creation(), {"x": torch.randn(2, 5)}, strategy)
    arange = ops_named(graph, "arange")[0]
    assert arange.input_tensors() == [] and arange.kwargs["device"] is CURRENT_DEVICE
    assert arange.outputs[0].shape == (5,)
    assert {"arange", "ones", "triu", "zeros_like"} <= {op.name.rsplit(".", 1)[-1] for op in graph.ops}


# -- in-place ops and grad mode ------------------------------------------------------------


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.add_(1.0)
        h[:, 0] = 0.0
        view = h[0]
        view.mul_(3.0)  # writes through a view: h changes too
        F.relu(h, inplace=True)
        return h * 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_in_place_ops_make_new_versions(strategy):
    graph = traced(InPlace(), {"x": torch.randn(2, 4)}, strategy)
    inplace = [op for op in graph.ops if op.inplace]
    assert [op.name.rsplit(".", 1)[-1] for op in inplace] == ["add_", "__setitem__", "mul_", "relu"]
    add_, setitem, mul_, relu = inplace
    h = graph.ops[0].outputs[0]
    (before, after), = add_.mutations
    assert before == h and after.full.version == 1 and after.full.base is h.full
    assert add_.outputs[0] == after  # add_ returns the tensor it changed
    assert setitem.input_tensors()[0] == after and setitem.result() is None
    assert setitem.output_tensors() == [setitem.mutations[0][1]]
    # the view and the tensor it views both get a new version
    assert {after.full.root for _, after in mul_.mutations} == {h.full, graph.ops[3].outputs[0].full}
    h_after_mul = next(a for _, a in mul_.mutations if a.full.root is h.full)
    assert relu.input_tensors() == [h_after_mul]
    assert graph.ops[-1].input_tensors() == [relu.mutations[0][1]]  # the last version
    assert "in-place" in str(add_)


class NoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            stats = self.fc(x).mean()
        return self.fc(x) * stats


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_grad_regions_are_recorded(strategy):
    graph = traced(NoGrad(), {"x": torch.randn(2, 4)}, strategy)
    assert [op.no_grad for op in graph.ops] == [True, True, False, False]
    assert not graph.ops[1].outputs[0].requires_grad and graph.ops[2].outputs[0].requires_grad
    assert "no_grad" in str(graph.ops[0])


# -- data reads -----------------------------------------------------------------------------


class DataBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x > 0).any():
            return x * x.max().item()
        return -x


def test_values_read_from_data_are_constants_with_the_real_strategy():
    x = torch.tensor([1.0, -2.0, 3.0])
    graph = traced(DataBranch(), {"x": x})
    assert ops_named(graph, "mul")[0].inputs[1] == 3.0
    assert len(graph.data_dependent) == 2
    assert "__bool__ -> True" in graph.data_dependent[0]
    assert "item -> 3.0" in graph.data_dependent[1]
    assert "value read from data" in str(graph)


# -- register_op and opaque ops ---------------------------------------------------------------


def test_register_op_is_one_node_never_traced_into(fresh_plugins):
    import nnscaler

    calls = []

    @nnscaler.register_op("a b, b c -> a c")
    def my_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (x.unsqueeze(-1) * y.unsqueeze(0)).sum(1)  # several torch calls inside

    class UsesOp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return my_matmul(x, self.w).relu()

    for strategy in STRATEGIES:
        graph = traced(UsesOp(), {"x": torch.randn(2, 4)}, strategy)
        names = [op.name for op in graph.ops]
        assert names[0].endswith("my_matmul") and len(names) == 2
        op = graph.ops[0]
        assert str(op.anno) == "a b, b c -> a c" and op.anno.sizes == {"a": 2, "b": 4, "c": 3}
        assert op.opdef is not None and not op.is_opaque and op.outputs[0].shape == (2, 3)


def my_scale(x: torch.Tensor) -> torch.Tensor:
    """A torch-level function (it honours __torch_function__) that nobody annotated."""
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(my_scale, (x,), x)
    return x * 3


class Opaque(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = my_scale(x)
        return my_scale(y) + x


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unannotated_functions_are_opaque_with_one_warning(strategy):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = traced(Opaque(), {"x": torch.randn(3)}, strategy)
    opaque = [w for w in caught if issubclass(w.category, OpaqueOpWarning)]
    assert len(opaque) == 1  # two calls, one warning
    message = str(opaque[0].message)
    assert "test_trace.my_scale has no dim annotation" in message
    assert "can only be replicated" in message and "register_op" in message
    assert opaque[0].filename == __file__  # points at the model's line that called it
    assert "'y = my_scale(x)'" in message
    assert len(graph.opaque_ops()) == 2 and graph.opaque_ops()[0].anno is None
    assert " | opaque | " in str(graph.opaque_ops()[0])


# -- source lines and printing ---------------------------------------------------------------


def test_ops_carry_the_models_source_line_and_code():
    graph = traced(Inner(), {"x": torch.randn(2, 4)})
    linear, relu = graph.ops
    assert linear.source_file == __file__ and linear.code == "return torch.relu(self.proj(x))"
    assert relu.source == f"{__file__}:{relu.source_line}" and linear.module_path == "proj"
    line = str(linear)
    assert line.startswith("t") and "torch.nn.functional.linear(x, proj.weight, proj.bias)" in line
    assert f"| proj (Linear) | test_trace.py:{linear.source_line}" in line


class RandomOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x)) + torch.rand_like(x)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_random_ops_replay_identically_from_the_same_seed(strategy):
    traced(RandomOps().train(), {"x": torch.randn(4, 8)}, strategy)  # bitwise, dropout on


class ReadsCapturedValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.limit = torch.tensor(3.0)  # not registered: stays a real tensor under meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(max=self.limit.item())


def test_meta_strategy_reads_values_of_real_captured_tensors():
    graph = traced(ReadsCapturedValue(), {"x": torch.randn(4) * 5}, "meta")
    (clamp,) = graph.ops
    assert 3.0 in clamp.inputs or clamp.kwargs.get("max") == 3.0
    assert graph.constants() == [] and len(graph.data_dependent) == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hooks_on_the_root_module_are_recorded(strategy):
    module = Inner()
    module.register_forward_pre_hook(
        lambda m, args, kwargs: (args, {"x": kwargs["x"] * 2}), with_kwargs=True
    )
    module.register_forward_hook(lambda m, args, out: out + 1)
    graph = traced(module, {"x": torch.randn(2, 4)}, strategy)
    assert [op.name.rsplit(".", 1)[-1] for op in graph.ops] == ["mul", "linear", "relu", "add"]
    assert graph.ops[-1].module_path == "" and graph.ops[1].module_path == "proj"
