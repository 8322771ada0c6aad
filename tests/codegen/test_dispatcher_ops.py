"""Operators of torch's dispatcher that a library defines with ``torch.library.custom_op``
(transformers' ``grouped_mm_fallback``, flash-attention's kernels) are recorded as opaque
ops; the generated code calls them as ``torch.ops.<namespace>.<name>`` after importing the
module that defines them, and ``graph.pkl`` keeps them by their qualified name."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from nnscaler import ComputeConfig, parallelize
from nnscaler.parallel.graph_pickle import UnsafeGraphFileError, load_graph, save_graph
from nnscaler.trace import trace


@torch.library.custom_op("nnscaler_tests::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * ctx.scale * (1 - torch.tanh(x) ** 2), None


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


scaled_tanh.register_autograd(_backward, setup_context=_setup)


class UsesACustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.ops.nnscaler_tests.scaled_tanh(self.fc(x), 0.5).sum()


def test_generated_code_calls_the_operator_and_imports_its_module(tmp_path):
    torch.manual_seed(0)
    model = UsesACustomOp()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(model, {"x": x}, "dp",
                         ComputeConfig(plan_ngpus=1, runtime_ngpus=1), gen_savedir=tmp_path)
    source = next(tmp_path.rglob("gencode0.py")).read_text()
    assert "torch.ops.nnscaler_tests.scaled_tanh(" in source
    assert f"import {__name__}" in source
    loss = ref(x)
    loss.backward()
    got = pm(x)
    got.backward()
    torch.testing.assert_close(got, loss, rtol=0, atol=0)
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for attr, meta in pm.fullmap.items():  # the custom op's own backward ran
        torch.testing.assert_close(getattr(pm, attr).grad, grads[meta.orig_name],
                                   rtol=0, atol=0)
    assert len(pm.fullmap) == 2


def test_graph_pickle_keeps_the_operator_by_name(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(UsesACustomOp(), {"x": torch.randn(3, 4)})
    save_graph(graph, tmp_path / "graph.pkl")
    again = load_graph(tmp_path / "graph.pkl")
    fns = {op.name: op.fn for op in again.ops}
    assert fns["nnscaler_tests.scaled_tanh"] is torch.ops.nnscaler_tests.scaled_tanh


def test_an_unregistered_operator_is_refused_with_the_fix(tmp_path):
    from nnscaler.parallel import graph_pickle

    with pytest.raises(UnsafeGraphFileError, match="has not registered: import the module"):
        graph_pickle._dispatcher_op("nnscaler_tests::no_such_op", None)
    with pytest.raises(UnsafeGraphFileError, match="not a torch operator"):
        graph_pickle._dispatcher_op("os.system", None)
