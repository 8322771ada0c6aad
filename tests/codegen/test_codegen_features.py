"""What generated code handles beyond linear layers: buffers updated in place under
``no_grad``, captured constants, ``x[...] = v``, tensor lists, indexing with Ellipsis,
dtypes, reflected operators, nested outputs with constants, untraced forward arguments
with defaults; on one process (no torch.distributed) and batch-split on two."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

from nnscaler.anno import Split
from nnscaler.codegen import (
    CodegenError,
    build_program,
    emit_files,
    generate_rank,
    load_generated_class,
)
from nnscaler.graph import IRGraph, PartitionError
from nnscaler.runtime.module import ParallelModuleError
from nnscaler.trace import trace


class Fancy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("steps", torch.zeros(()), persistent=False)
        self.table = torch.arange(8.0)  # captured: not a parameter, not a buffer

    def forward(self, data: dict[str, torch.Tensor], flag: bool = True) -> dict:
        x = data["x"]
        h = self.lin(x) * self.scale + self.table
        with torch.no_grad():
            self.steps.add_(1)
        h = h.clone()
        h[:, 0:2] = 0.0
        h = torch.cat([h, x], dim=-1)
        y = h[..., :4].relu()
        z = h.sum(dim=-1, keepdim=True).to(torch.float64)
        w = x.new_zeros(x.shape) + 2.0 / x.abs().add(1)
        return {"y": y, "pair": (z, -y, w), "n": 3}


def _loss(out: dict) -> torch.Tensor:
    y, (z, neg, w) = out["y"], out["pair"]
    return y.sum() + 0.5 * z.sum() + (neg * w[:, :4]).sum()


def _traced() -> tuple[nn.Module, torch.Tensor, IRGraph]:
    torch.manual_seed(0)
    module = Fancy()
    x = torch.randn(4, 8)
    graph = IRGraph.from_graph(trace(module, {"data": {"x": x}}))
    return module, x, graph


def _batch_split(graph: IRGraph, n: int) -> IRGraph:
    """Split every op along the batch where its annotation allows, else replicate."""
    batch = {t.full: 0 for t in graph.input_tensors()}
    for op in graph.nodes():
        parts = None
        space = op.anno.transform_space(n, rules=op.opdef.rules_for(op.anno)) if op.anno else ()
        for t in space:
            x = op.inputs[t.idx]
            if getattr(x, "full", None) in batch and batch[x.full] == t.dim:
                try:
                    parts = graph.partition(op, idx=t.idx, dim=t.dim, num=n)
                except PartitionError:
                    break
                for out, layout in zip(op.output_tensors(), t.outputs, strict=False):
                    if isinstance(layout, Split):
                        batch[out.full] = layout.dim
                break
        for device, part in enumerate(parts or graph.replicate(op, n)):
            graph.assign(part, device)
    return graph


def test_one_process_matches_the_module(tmp_path):
    module, x, graph = _traced()
    for op in graph.nodes():
        graph.assign(op, 0)
    emit_files(graph, tmp_path, plan_ngpus=1, runtime_ngpus=1, state=module,
               forward_signature=inspect.signature(module.forward))
    source = (tmp_path / "gencode0.py").read_text()
    for text in ("def _forward_impl(self, data, flag=True):", "with torch.no_grad():",
                 "self.steps.add_(1)", "[:, 0:2] = 0.0", "torch.cat([", "[..., :4]",
                 ".to(torch.float64)", "2.0 / ", "'n': 3", "self.add_constant("):
        assert text in source, text
    gen = load_generated_class(tmp_path, 0)()
    assert {m.kind for m in gen.fullmap.values()} == {"parameter", "buffer", "constant"}
    ref = copy.deepcopy(module)
    want, got = ref({"x": x}), gen({"x": x}, flag=True)  # untraced: its default only
    with pytest.raises(ParallelModuleError, match=r"'flag' is False \(bool\), but the module "
                       r"was parallelized with True, which it holds as a constant"):
        gen({"x": x}, flag=False)
    assert got["n"] == 3 and isinstance(got["pair"], tuple)
    for a, b in [(want["y"], got["y"]), *zip(want["pair"], got["pair"], strict=True)]:
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    _loss(want).backward()
    _loss(got).backward()
    torch.testing.assert_close(gen.lin_weight.grad, ref.lin.weight.grad, rtol=0, atol=0)
    assert gen.steps.item() == ref.steps.item() == 1  # tracing leaves the module as it was
    assert "steps" not in gen.state_dict() and "scale" in gen.state_dict()


def _fancy_worker(rank, world, outdir, x):
    gen = load_generated_class(outdir, rank)(init_params=True)
    out = gen({"x": x})
    _loss(out).backward()
    return out["y"].detach(), {a: p.grad for a, p in gen.named_parameters()}, gen.steps.item()


def test_batch_split_on_two_processes(tmp_path):
    module, x, graph = _traced()
    _batch_split(graph, 2)
    program = build_program(graph, plan_ngpus=2, runtime_ngpus=2)
    assert program.adapters, "the plan splits the batch, so pieces move"
    emit_files(graph, tmp_path, plan_ngpus=2, runtime_ngpus=2, state=module, program=program)
    results = run_distributed(_fancy_worker, 2, str(tmp_path), x)
    ref = copy.deepcopy(module)
    out = ref({"x": x})
    _loss(out).backward()
    for y, _, steps in results:
        torch.testing.assert_close(y, out["y"], rtol=1e-5, atol=1e-6)
        assert steps == ref.steps.item()
    for name, p in ref.named_parameters():
        total = sum(grads[name.replace(".", "_")] for _, grads, _ in results)
        torch.testing.assert_close(total, p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inference_only", [False, True])
def test_infer_step_and_inference_only(tmp_path, inference_only):
    module, x, graph = _traced()
    for op in graph.nodes():
        graph.assign(op, 0)
    emit_files(graph, tmp_path, plan_ngpus=1, runtime_ngpus=1, state=module,
               inference_only=inference_only, end2end=True)
    gen = load_generated_class(tmp_path, 0)()
    (out,) = gen.infer_step([{"x": x}])
    assert not out["y"].requires_grad
    assert bool(gen.reducers) != inference_only
    assert (generate_rank(build_program(graph, plan_ngpus=1, runtime_ngpus=1, end2end=True,
                                        inference_only=inference_only), 0)
            == (tmp_path / "gencode0.py").read_text())


def test_custom_ops_in_generated_code(tmp_path, fresh_plugins):
    """A registered op's emit_fn writes its call; code_impl_pattern='source' copies the
    function into the file; a function no import reaches is an error that says so."""
    import nnscaler

    def twice(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
        return x * factor

    def cube(x: torch.Tensor) -> torch.Tensor:
        return x * x * x

    def local(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    twice_op = nnscaler.register_op(
        "a b -> a b", emit_fn=lambda op, args, kwargs: f"({args[0]} * {kwargs['factor']})"
    )(twice)
    cube_op = nnscaler.register_op("a b -> a b", code_impl_pattern="source")(cube)
    local_op = nnscaler.register_op("a b -> a b")(local)

    class UsesOps(nn.Module):
        def __init__(self, last) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.last = last

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.last(cube_op(twice_op(self.lin(x), factor=3.0))).sum()

    x = torch.randn(2, 4)
    for last, ok in ((torch.relu, True), (local_op, False)):
        module = UsesOps(last)
        graph = IRGraph.from_graph(trace(module, {"x": x}))
        for op in graph.nodes():
            graph.assign(op, 0)
        if not ok:
            with pytest.raises(CodegenError, match=r"no import path reaches it.*top level"):
                generate_rank(build_program(graph, plan_ngpus=1, runtime_ngpus=1), 0)
            continue
        out = tmp_path / "ops"
        emit_files(graph, out, plan_ngpus=1, runtime_ngpus=1, state=module)
        source = (out / "gencode0.py").read_text()
        assert "def cube(x: torch.Tensor) -> torch.Tensor:" in source
        assert " * 3.0)" in source  # written by the emit_fn
        gen = load_generated_class(out, 0)()
        torch.testing.assert_close(gen(x), module(x), rtol=0, atol=0)


class Block(nn.Module):
    """A parallel submodule inside a bigger model: its input requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x))


def _submodule_worker(rank, world, outdir, x, w):
    gen = load_generated_class(outdir, rank)()
    x = x.clone().requires_grad_()
    (gen(x) * w).sum().backward()  # every rank: the whole gradient of the output
    return x.grad, {a: p.grad for a, p in gen.named_parameters()}


def test_input_gradients_of_a_parallel_submodule(tmp_path):
    """The output (split by batch inside) is gathered on every device; the input's
    gradient is summed over the unit, so every rank holds all of it."""
    torch.manual_seed(0)
    module = Block()
    x, w = torch.randn(4, 8), torch.randn(4, 8)
    graph = _batch_split(IRGraph.from_graph(trace(module, {"x": x.requires_grad_()})), 2)
    emit_files(graph, tmp_path, plan_ngpus=2, runtime_ngpus=2, state=module)
    assert "x = boundary.input(x, ranks=[0, 1])" in (tmp_path / "gencode1.py").read_text()
    results = run_distributed(_submodule_worker, 2, str(tmp_path), x.detach(), w)
    ref = copy.deepcopy(module)
    xr = x.detach().clone().requires_grad_()
    (ref(xr) * w).sum().backward()
    for x_grad, _ in results:
        torch.testing.assert_close(x_grad, xr.grad, rtol=1e-5, atol=1e-6)
    total = sum(grads["fc_weight"] for _, grads in results)
    torch.testing.assert_close(total, ref.fc.weight.grad, rtol=1e-5, atol=1e-6)
