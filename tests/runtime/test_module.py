"""ParallelModule, the base of generated modules, and the boundary functions: start-up
checks, initial weights, the optimizer's view, train_step/infer_step rules, and the
gradient rules at the module's edges."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

from nnscaler.codegen import emit_files, load_generated_class
from nnscaler.graph import IRGraph
from nnscaler.runtime import Adapter, AttrMeta, ParallelModuleError, boundary
from nnscaler.runtime.collectives import CollectiveError
from nnscaler.trace import trace


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.frozen).sum()


def _generate(tmp_path, *, ndevices: int = 1, runtime_ngpus: int = 1, **kwargs):
    torch.manual_seed(0)
    module = Tiny()
    graph = IRGraph.from_graph(trace(module, {"x": torch.randn(3, 4)}))
    for op in graph.nodes():
        for device, copy in enumerate(graph.replicate(op, ndevices)):
            graph.assign(copy, device)
    emit_files(graph, tmp_path, plan_ngpus=ndevices, runtime_ngpus=runtime_ngpus,
               state=module, **kwargs)
    return module


def test_initial_weights_fullmap_and_optimizer_view(tmp_path):
    module = _generate(tmp_path)
    gen = load_generated_class(tmp_path, 0)()
    torch.testing.assert_close(gen.fc_weight, module.fc.weight, rtol=0, atol=0)
    meta = gen.fullmap["fc_weight"]
    assert isinstance(meta, AttrMeta) and meta.orig_name == "fc.weight"
    assert (meta.kind, meta.shape, meta.index, meta.holders) == ("parameter", (2, 4),
                                                                  ((0, 2), (0, 4)), (0,))
    assert meta.slicers == (slice(0, 2), slice(0, 4)) and meta.sub_shape == (2, 4)
    optimized = gen.parameters_for_optimizer()
    assert {id(p) for p in optimized} == {id(gen.fc_weight), id(gen.fc_bias)}  # not frozen
    gen(torch.randn(3, 4)).backward()
    assert gen.fc_weight.grad is not None
    gen.zero_grad()
    assert not gen.fc_weight.grad.any()
    uninitialized = load_generated_class(tmp_path, 0)(init_params=False)
    assert uninitialized.fc_weight.shape == (2, 4)


def test_missing_fullmodel(tmp_path):
    _generate(tmp_path)
    os.unlink(tmp_path / "fullmodel.pt")
    cls = load_generated_class(tmp_path, 0)
    with pytest.raises(ParallelModuleError, match=r"fullmodel.pt.*does not exist.*init_params=False"):
        cls()
    cls(init_params=False)


def test_train_step_needs_an_end2end_module(tmp_path):
    _generate(tmp_path)
    gen = load_generated_class(tmp_path, 0)()
    with pytest.raises(ParallelModuleError, match=r"end2end.*use_end2end=True"):
        gen.train_step([torch.randn(3, 4)])


def test_train_step_checks_dummy_flags(tmp_path):
    _generate(tmp_path, end2end=True)
    gen = load_generated_class(tmp_path, 0)()
    with pytest.raises(ParallelModuleError, match=r"is_dummy_batch has 1 entries for 2"):
        gen.train_step([torch.randn(3, 4)] * 2, is_dummy_batch=[False])
    (loss,) = gen.train_step([torch.randn(3, 4)], is_dummy_batch=[True])
    assert not loss.requires_grad and not gen.fc_weight.grad.any()


def test_needs_torch_distributed_for_several_ranks(tmp_path):
    _generate(tmp_path, ndevices=2, runtime_ngpus=2)
    cls = load_generated_class(tmp_path, 1)
    with pytest.raises(ParallelModuleError, match=r"rank 1 of 2.*not initialized.*torchrun"):
        cls()


def _wrong_rank(rank, world, outdir):
    try:
        load_generated_class(outdir, 1 - rank)()
    except ParallelModuleError as e:
        return str(e)
    return "no error"


def test_loaded_on_the_wrong_rank(tmp_path):
    _generate(tmp_path, ndevices=2, runtime_ngpus=2)
    messages = run_distributed(_wrong_rank, 2, str(tmp_path))
    assert "program of rank 1, but this process is rank 0; load gencode0.py" in messages[0]


def test_output_keeps_the_gradient_on_the_first_device_only():
    x = torch.ones(3, requires_grad=True)
    anchor = torch.ones(2, requires_grad=True)
    boundary.output(x * 2, first=False, anchors=(anchor,)).sum().backward()
    assert not x.grad.any() and anchor.grad is not None and not anchor.grad.any()
    x.grad = None
    boundary.output(x * 2, first=True).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]
    assert boundary.output(3, first=True) == 3
    assert boundary.input(x, ranks=[0]) is x  # one rank: nothing to sum


def test_adapter_plans_lazily_and_checks_its_ranks():
    adapter = Adapter("R(1)V(1)D(1)@[1]", "R(1)V(1)D(1)@[2]", shape=(4,), dtype=torch.float32)
    assert adapter._plan is None
    assert adapter.plan.names == ("move",) and adapter.groups() == []
    assert "shape=(4,)" in repr(adapter)
    with pytest.raises(CollectiveError, match=r"rank 0, which takes no part.*gencode0.py"):
        adapter(torch.ones(4))
