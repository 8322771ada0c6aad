"""Graphs as readable text: one op a line.

An op line reads::

    t7 = torch.nn.functional.linear(t5, h.0.attn.q.weight, h.0.attn.q.bias)  | a b k^, n k^, n -> a b n | f32[2,8,32], f32[32,32], f32[32] -> f32[2,8,32] | h.0.attn.q (Linear) | gpt.py:71

that is: results, op name and arguments; the annotation bound to the call (``opaque``
when the op has none); input and output shapes; module path and class; the model's
source line. In-place and no-grad calls are flagged at the end, and so is a policy's plan
for the op (``device 0``, ``stage 1``, ``recompute 0``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from nnscaler.ir.tensor import SubTensor, dtype_str

if TYPE_CHECKING:
    from nnscaler.ir.graph import Graph
    from nnscaler.ir.op import Op

_MAX_CONST = 40


def format_value(value: Any) -> str:
    """An argument as it appears in an op line: tensor names, short constants."""
    if isinstance(value, SubTensor):
        return str(value)
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        inner = ", ".join(format_value(v) for v in value)
        if isinstance(value, list):
            return f"[{inner}]"
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, slice):
        parts = ["" if x is None else format_value(x) for x in (value.start, value.stop)]
        text = ":".join(parts)
        return text + (f":{format_value(value.step)}" if value.step is not None else "")
    if value is Ellipsis:
        return "..."
    if isinstance(value, torch.Size):
        return repr(tuple(value))
    if isinstance(value, torch.dtype):
        return str(value)
    text = repr(value)
    return text if len(text) <= _MAX_CONST else text[: _MAX_CONST - 3] + "..."


def _shape(t: SubTensor) -> str:
    return f"{dtype_str(t.dtype)}[{','.join(map(str, t.shape))}]"


def format_op(op: Op) -> str:
    """One line for ``op`` (see the module docstring)."""
    args = [format_value(v) for v in op.inputs]
    args += [f"{k}={format_value(v)}" for k, v in op.kwargs.items()]
    outs = op.output_tensors()
    lhs = ", ".join(str(t) for t in outs) if outs else "_"
    if not outs and any(not isinstance(x, SubTensor) for x in op.outputs):
        lhs = format_value(pytree.tree_unflatten(list(op.outputs), op.output_spec))
    anno = "opaque" if op.anno is None else str(op.anno)
    shapes = ", ".join(_shape(t) for t in op.input_tensors())
    shapes += " -> " + (", ".join(_shape(t) for t in outs) or "()")
    where = op.module_path or "<root>"
    if op.module_class:
        where += f" ({op.module_class.rsplit('.', 1)[-1]})"
    flags = [flag for flag, on in (("in-place", op.inplace), ("no_grad", op.no_grad)) if on]
    flags += [f"autocast({device}, {str(dtype).removeprefix('torch.')})"
              for device, dtype in op.autocast]
    flags += [f"{key} {value}" for key, value in (
        ("device", op.plan.device), ("stage", op.plan.stage), ("recompute", op.plan.recompute)
    ) if value is not None]
    line = f"{lhs} = {op.name}({', '.join(args)}) | {anno} | {shapes} | {where} | {op.short_source}"
    return line + (f" | {' '.join(flags)}" if flags else "")


def format_graph(graph: Graph) -> str:
    """The whole graph: a header, the inputs, one line per op, the outputs."""
    params = graph.parameters()
    tied = sum(1 for p in params if len(p.names) > 1)
    buffers = graph.buffers()
    lines = [
        f"Graph: {len(graph.ops)} ops ({len(graph.opaque_ops())} opaque), "
        f"{len(params)} parameters ({sum(p.numel for p in params):,} elements"
        f"{f', {tied} tied' if tied else ''}), {len(buffers)} buffers"
    ]
    for name, value in graph.inputs.items():
        leaves = list(pytree.tree_leaves(value))
        desc = ", ".join(
            f"{leaf}:{_shape(leaf)}" for leaf in leaves if isinstance(leaf, SubTensor)
        ) or format_value(value)
        lines.append(f"  input {name}: {desc}")
    for p in params:
        if len(p.names) > 1:
            lines.append(f"  tied parameter {p.name}: also {', '.join(p.names[1:])}")
    for op in graph.ops:
        lines.append(f"  {format_op(op)}")
    lines.append(f"  return {format_value(graph.outputs)}")
    for note in graph.data_dependent:
        lines.append(f"  # value read from data, fixed in this graph: {note}")
    return "\n".join(lines)
