"""Run a graph on one device: the reference that the traced graph is checked against.

`run_graph` executes the ops in order on real tensors, with the module's parameters
and buffers and the forward arguments. Because it runs the very calls the model made, in
the same order and grad mode, its outputs and gradients equal the module's bit for bit.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from nnscaler.errors import GraphMismatchError, InterpreterError
from nnscaler.ir.graph import Graph
from nnscaler.ir.op import Op
from nnscaler.ir.tensor import CURRENT_DEVICE, FullTensor, SubTensor, TensorKind


def _state_of(params: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(params, torch.nn.Module):
        state = dict(params.named_parameters(remove_duplicate=False))
        state.update(params.named_buffers(remove_duplicate=False))
        return state
    return dict(params)


def _lookup(t: FullTensor, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    for name in t.names:
        if name in state:
            value = state[name]
            return value if t.model_shape is None else value.reshape(t.shape)
    raise InterpreterError(
        f"the graph needs the {t.kind.value} {' / '.join(t.names)} (shape {list(t.shape)}) but "
        f"the given parameters and buffers have no entry by that name; pass the traced module "
        f"or its full state (named_parameters() and named_buffers(), non-persistent included)"
    )


def leaf_values(
    graph: Graph,
    params: torch.nn.Module | Mapping[str, torch.Tensor],
    forward_args: Mapping[str, Any],
) -> dict[FullTensor, Any]:
    """The value of every leaf of ``graph``: parameters, buffers, constants and inputs.

    ``params`` is the traced module (or a ``name -> tensor`` map of its parameters and
    buffers); ``forward_args`` holds a value for every argument the graph was traced with,
    nested the same way. Raises `InterpreterError` naming what is missing.
    """
    state = _state_of(params)
    env: dict[FullTensor, Any] = {}
    for t in graph.tensors:
        if t.version:
            continue
        if t.kind in (TensorKind.PARAMETER, TensorKind.BUFFER):
            env[t] = _lookup(t, state)
        elif t.kind is TensorKind.CONSTANT:
            env[t] = t.value

    missing = [name for name in graph.inputs if name not in forward_args]
    if missing:
        raise InterpreterError(
            f"the graph was traced with the forward arguments {list(graph.inputs)}; "
            f"missing: {missing}. Pass a value for each."
        )
    for name, structure in graph.inputs.items():
        ir_leaves, ir_spec = pytree.tree_flatten(structure)
        leaves, spec = pytree.tree_flatten(forward_args[name])
        if len(leaves) != len(ir_leaves):
            raise InterpreterError(
                f"forward argument {name!r} has structure {spec} but the graph was traced with "
                f"{ir_spec}; pass a value nested the same way"
            )
        for ir, value in zip(ir_leaves, leaves, strict=True):
            if isinstance(ir, SubTensor):
                if not isinstance(value, torch.Tensor):
                    raise InterpreterError(
                        f"forward argument {name!r}: a tensor was traced where "
                        f"{type(value).__name__} {value!r} is given"
                    )
                env[ir.full] = value
    return env


def default_device(values: Mapping[FullTensor, Any]) -> torch.device:
    """The device of the first real (not ``meta``) tensor among ``values``, else CPU."""
    first = next(
        (v for v in values.values() if isinstance(v, torch.Tensor) and v.device.type != "meta"),
        None,
    )
    return first.device if first is not None else torch.device("cpu")


def run_graph(
    graph: Graph,
    params: torch.nn.Module | Mapping[str, torch.Tensor],
    forward_args: Mapping[str, Any],
    *,
    device: torch.device | str | None = None,
) -> Any:
    """Execute ``graph`` and return what the traced ``forward`` would return.

    ``params`` is the traced module (or a ``name -> tensor`` map of its parameters and
    buffers); ``forward_args`` holds a value for every argument the graph was traced with,
    nested the same way. ``device`` replaces `CURRENT_DEVICE` in the
    recorded arguments (default: the device of the first input or parameter, else CPU).
    """
    env = leaf_values(graph, params, forward_args)
    device = default_device(env) if device is None else torch.device(device)
    run_ops(graph.ops, env, device)
    return pytree.tree_map(lambda leaf: _value(leaf, env, device), graph.outputs)


def _value(leaf: Any, env: Mapping[FullTensor, Any], device: torch.device) -> Any:
    if isinstance(leaf, SubTensor):
        if not leaf.is_whole:
            raise InterpreterError(
                f"the interpreter runs whole tensors only, got the piece {leaf}; "
                "run a traced (not partitioned) graph"
            )
        return env[leaf.full]
    if leaf is CURRENT_DEVICE:
        return device
    return leaf


def _values(tree: Any, env: Mapping[FullTensor, Any], device: torch.device) -> Any:
    """``tree`` with each leaf's value (`_value`); flat lists and dicts, the usual
    arguments, without pytree's walk."""
    if isinstance(tree, dict):
        if not any(isinstance(v, _NESTED) for v in tree.values()):
            return {k: _value(v, env, device) for k, v in tree.items()}
    elif not any(isinstance(v, _NESTED) for v in tree):
        return [_value(v, env, device) for v in tree]
    return pytree.tree_map(lambda leaf: _value(leaf, env, device), tree)


_NESTED = (list, tuple, dict)


def release_schedule(ops: Sequence[Op], keep: Collection[FullTensor] = ()
                     ) -> dict[int, list[FullTensor]]:
    """For `run_ops`: per op index, the values the ops compute that are read for
    the last time there (or never read), except those ``keep`` names."""
    kept = set(keep)
    last: dict[FullTensor, int] = {}
    for i, op in enumerate(ops):
        for y in op.output_tensors():
            last[y.full] = i
        for x in op.input_tensors():
            last[x.full] = i
    out: dict[int, list[FullTensor]] = {}
    for full, i in last.items():
        if not full.is_leaf and full not in kept:
            out.setdefault(i, []).append(full)
    return out


def run_ops(ops: Sequence[Op], env: dict[FullTensor, Any], device: torch.device, *,
            release: Mapping[int, Sequence[FullTensor]] | None = None) -> None:
    """Run ``ops`` in order, each in its recorded grad mode, reading their tensors from
    ``env`` (which must hold every leaf they read) and adding what each writes to it.
    `run_graph` runs a graph's ops so; a policy may run a list of them on values it
    made up (to time them, say).

    ``release`` (`release_schedule`) drops each value from ``env`` after its last
    reader, as the generated code does: holding every intermediate until the end costs
    memory and time (fresh pages for every tensor; a Llama's forward ran about 30% slower
    so)."""
    release = release or {}
    grad_on = torch.is_grad_enabled()
    try:
        for i, op in enumerate(ops):
            torch.set_grad_enabled(grad_on and not op.no_grad)
            inputs = _values(op.inputs, env, device)
            kwargs = _values(dict(op.kwargs), env, device)
            result = op.call(inputs, kwargs)
            for before, after in op.mutations:
                env[after.full] = env[before.full]
            outputs = op.outputs
            if len(outputs) == 1 and isinstance(result, torch.Tensor):
                if isinstance(outputs[0], SubTensor):
                    env[outputs[0].full] = result
            else:
                for ir, value in zip(outputs, pytree.tree_leaves(result), strict=True):
                    if isinstance(ir, SubTensor):
                        env[ir.full] = value
            for full in release.get(i, ()):
                env.pop(full, None)
    finally:
        torch.set_grad_enabled(grad_on)


def _fresh(args: Mapping[str, Any]) -> dict[str, Any]:
    """Copies of the tensors in ``args`` (leaves keep ``requires_grad``)."""

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        return x

    return {k: pytree.tree_map(copy, v) for k, v in args.items()}


def verify_graph(
    graph: Graph,
    module: torch.nn.Module,
    forward_args: Mapping[str, Any],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    seed: int = 0,
) -> None:
    """Check that ``graph`` reproduces ``module``: outputs and parameter gradients.

    Runs the module and `run_graph` from the same random seed and buffer state, on
    fresh copies of ``forward_args``; backpropagates the sum of every output that requires
    grad; compares with ``torch.allclose(rtol, atol)`` (default: bitwise). Raises
    `GraphMismatchError` naming the first output or gradient that differs.
    """
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}

    def run(fn: Any) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | None]]:
        with torch.no_grad():
            for n, b in module.named_buffers():
                b.copy_(buffers[n])
        module.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        out = fn(_fresh(forward_args))
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        terms = [t.float().sum() for t in leaves if t.requires_grad]
        if terms:
            torch.stack(terms).sum().backward()
        grads = {
            n: None if p.grad is None else p.grad.detach().clone()
            for n, p in module.named_parameters()
        }
        module.zero_grad(set_to_none=True)
        return [t.detach() for t in leaves], grads

    expected, expected_grads = run(lambda args: module(**args))
    got, got_grads = run(lambda args: run_graph(graph, module, args))

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if not (a.is_floating_point() or a.is_complex()):
            return torch.equal(a, b)
        return torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)  # 0, 0: bitwise

    def diff(a: torch.Tensor, b: torch.Tensor) -> str:
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        return f"max abs difference {(a.double() - b.double()).abs().max().item():.3e}"

    if len(expected) != len(got):
        raise GraphMismatchError(
            f"the module returned {len(expected)} tensors, the graph {len(got)}"
        )
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        if not same(a, b):
            raise GraphMismatchError(f"output tensor {i} differs: {diff(a, b)}")
    for name, a in expected_grads.items():
        b = got_grads[name]
        if (a is None) != (b is None):
            raise GraphMismatchError(
                f"parameter {name}: the module {'left no' if a is None else 'gave a'} gradient, "
                f"the graph {'none' if b is None else 'one'}"
            )
        if a is not None and b is not None and not same(a, b):
            raise GraphMismatchError(f"gradient of parameter {name} differs: {diff(a, b)}")
