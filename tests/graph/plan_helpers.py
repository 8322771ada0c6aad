"""Traced models and reference plans shared by the graph tests.

Models are traced once per session (hypothesis runs many plans on each); every test takes
its own :class:`~nnscaler.graph.IRGraph` copy with :func:`fresh`.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import attrs
import torch

from nnscaler.anno import Split
from nnscaler.graph import IRGraph, check_plan, run_plan
from nnscaler.ir import FullTensor, Graph, Op
from nnscaler.models import MLP, GPTConfig, GPTWithLoss, MLPConfig
from nnscaler.models import gpt as gpt_module
from nnscaler.models import mlp as mlp_module
from nnscaler.trace import trace

BATCH = 4
CASES = ("mlp", "gpt", "gpt_manual", "gpt_nobias")


@attrs.frozen(eq=False)
class Case:
    """A traced model: the module, its forward arguments, its graph and its reference run."""

    name: str
    module: torch.nn.Module
    args: dict[str, Any]
    graph: Graph
    expected: torch.Tensor
    grads: dict[str, torch.Tensor]


def _reference(module: torch.nn.Module, args: dict[str, Any]) -> tuple[torch.Tensor, dict]:
    module.zero_grad(set_to_none=True)
    out = module(**args)
    out.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return out.detach(), grads


@functools.cache
def case(name: str) -> Case:
    """``mlp``; ``gpt`` (SDPA attention); ``gpt_manual`` (explicit softmax attention);
    ``gpt_nobias``: the GPT whose MLP output projections have no bias (the Megatron row
    split needs a linear without bias, see test_plans)."""
    torch.manual_seed(0)
    if name == "mlp":
        config = MLPConfig(d_in=8, d_hidden=16, n_classes=4, n_layers=3)
        module: torch.nn.Module = MLP(config)
        args = {"batch": mlp_module.make_batch(config, BATCH)}
    else:
        attn = "manual" if name == "gpt_manual" else "sdpa"
        config = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=8, seq_len=6, attn=attn)
        module = GPTWithLoss(config)
        if name == "gpt_nobias":
            for block in module.gpt.blocks:
                block.mlp.proj.bias = None
        args = {"batch": gpt_module.make_batch(config, BATCH)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # these models trace without opaque ops
        return traced_case(name, module, args)


def traced_case(name: str, module: torch.nn.Module, args: dict[str, Any]) -> Case:
    """Trace ``module`` on ``args`` and run it once for the reference loss and gradients."""
    graph = trace(module, args)
    expected, grads = _reference(module, args)
    return Case(name, module, args, graph, expected, grads)


def fresh(name: str) -> IRGraph:
    """A new IRGraph of the traced model ``name``."""
    return IRGraph.from_graph(case(name).graph)


def assert_reproduces(graph: IRGraph, name: str, *, ndevices: int, grads: bool = True) -> None:
    """``graph`` passes check_plan on ``ndevices`` and run_plan reproduces the module's
    output (and parameter gradients) within float32 rtol 1e-5."""
    assert_case_reproduces(graph, case(name), ndevices=ndevices, grads=grads)


def assert_case_reproduces(graph: IRGraph, c: Case, *, ndevices: int, grads: bool = True) -> None:
    """:func:`assert_reproduces` for any :class:`Case` (see :func:`traced_case`)."""
    check_plan(graph, ndevices)
    c.module.zero_grad(set_to_none=True)
    out = run_plan(graph, c.module, c.args)
    torch.testing.assert_close(out.detach(), c.expected, rtol=1e-5, atol=1e-6)
    try:
        if grads:
            out.backward()
            got = {n: p.grad for n, p in c.module.named_parameters() if p.grad is not None}
            assert got.keys() == c.grads.keys()
            for n, g in c.grads.items():
                torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=n: f"{n}: {m}")
    finally:
        c.module.zero_grad(set_to_none=True)


# -- reference plans --------------------------------------------------------------------


def replicate_rest(graph: IRGraph, ndevices: int) -> None:
    """Replicate every op not yet assigned on all ``ndevices`` devices."""
    for op in graph.nodes():
        if op.device is None:
            for device, copy in enumerate(graph.replicate(op, ndevices)):
                graph.assign(copy, device)


def data_parallel(graph: IRGraph, ndevices: int) -> IRGraph:
    """Split every op along the batch dim on ``ndevices`` devices; replicate the others.

    The batch dim is followed through the graph: dim 0 of every forward input, then the
    dim of each output that a batch split of its op splits.
    """
    batch_dim: dict[FullTensor, int] = {t.full: 0 for t in graph.input_tensors() if t.ndim}
    for op in graph.nodes():
        transform = _batch_split(op, batch_dim, ndevices)
        if transform is None:
            parts = graph.replicate(op, ndevices)
        else:
            parts = graph.partition(op, idx=transform.idx, dim=transform.dim, num=ndevices)
            for out, layout in zip(op.output_tensors(), transform.outputs, strict=False):
                if isinstance(layout, Split):
                    batch_dim[out.full] = layout.dim
        for device, part in enumerate(parts):
            graph.assign(part, device)
    return graph


def _batch_split(op: Op, batch_dim: dict[FullTensor, int], num: int) -> Any:
    if op.anno is None or op.opdef is None:
        return None
    space = op.anno.transform_space(num, rules=op.opdef.rules_for(op.anno))
    for t in space:
        x = op.inputs[t.idx]
        if getattr(x, "full", None) in batch_dim and batch_dim[x.full] == t.dim:
            return t
    return None


def megatron_mlp(graph: IRGraph, ndevices: int) -> IRGraph:
    """Megatron's MLP: fc split on its output features (columns), gelu on the same dim,
    proj on its reduction dim (rows; a value-partial output); every other op replicated."""
    for fc in graph.select(name="linear", module="*.mlp.fc"):
        for device, part in enumerate(graph.partition(fc, idx=1, dim=0, num=ndevices)):
            graph.assign(part, device)
    for act in graph.select(name="gelu", module="*.mlp"):
        for device, part in enumerate(graph.partition(act, idx=0, dim=-1, num=ndevices)):
            graph.assign(part, device)
    for proj in graph.select(name="linear", module="*.mlp.proj"):
        for device, part in enumerate(graph.partition(proj, idx=0, dim=-1, num=ndevices)):
            graph.assign(part, device)
    replicate_rest(graph, ndevices)
    return graph
