"""Expert weights in the shape their tensor-parallel split needs: ``gate_up_proj
[E, 2F, H]`` held by the graph as ``[E, 2, F, H]``.

Why. Tensor parallelism inside the experts gives part ``p`` of ``n`` the intermediate
units ``[p F/n, (p+1) F/n)`` of every expert: the same columns of ``down_proj`` (one
block of its last dim) and the same rows of both halves of the fused ``gate_up_proj``,
gate and up, which are *two* blocks of its dim ``2F``. A layout (`nnscaler.layout`) holds
one block per dim and per device, so a fused weight could only stay whole on every part.
Viewed as ``[E, 2, F, H]`` (a row-major reshape: index 0 of the ``2`` is the gate rows,
index 1 the up rows), the same rows are one block of dim 2, and every layout, adapter,
reducer and checkpoint piece works on it unchanged.

Why this and not a many-block piece kind. A layout kind naming several blocks of a dim
would reach the layout planner, its primitives, the simulator, code generation and every
checkpoint path; the reshape reaches only the places where a value crosses between the
module and the graph, and each of those is one ``reshape``: the graph's tensor records
the module's shape (`FullTensor.model_shape`), a rank's piece records it too
(`AttrMeta.model_shape`, in its state-dict record), initial values and the reference
interpreter reshape the module's weight, and checkpoints hold the module's own
``[E, 2F, H]``: `merge_state_dicts` reshapes the merged tensor back, and loading a full
state dict reshapes it to the view before cutting pieces. The reshape is exact both ways.

When. After tracing, a parameter is viewed only when every op that reads it is a
`moe_experts` call taking it whole as its ``gate_up_proj`` (and nothing writes it in
place): the view changes how *those* ops see it, and no other op reads it. A weight also
read by something else keeps its shape; the tensor-parallel split then keeps it whole on
every part, which slices it (`ffn_parallel_moe`).
"""

from __future__ import annotations

import attrs
import torch

from nnscaler.ir import FullTensor, Graph, Op, SubTensor, TensorKind
from nnscaler.ops.builtin.moe import MOE_EXPERTS

__all__ = ["view_expert_weights"]

_GATE_UP = 3  # moe_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)


def _viewable(full: FullTensor, readers: list[Op], graph: Graph) -> bool:
    if (full.kind is not TensorKind.PARAMETER or full.version or full.model_shape is not None
            or len(full.shape) != 3 or full.shape[1] % 2):
        return False
    if any(t.base is full for t in graph.tensors):  # written in place somewhere
        return False
    for op in graph.consumers(full):
        if op not in readers:
            return False
        reads = [x for x in op.input_tensors() if x.full is full]
        if reads != [op.inputs[_GATE_UP]] or not reads[0].is_whole:
            return False
    return True


def _rebound(op: Op, view: FullTensor) -> Op:
    inputs = list(op.inputs)
    inputs[_GATE_UP] = view.whole()
    args = [torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, SubTensor)
            else x for x in inputs]
    shapes = [x.shape if isinstance(x, SubTensor) else None for x in inputs]
    anno = op.opdef.annotation_for(args, op.kwargs).bind(shapes, op.kwargs)
    return attrs.evolve(op, inputs=tuple(inputs), anno=anno, plan=op.plan.copy())


def view_expert_weights(graph: Graph) -> list[str]:
    """Hold every expert ``gate_up_proj [E, 2F, H]`` that only `moe_experts` reads as
    ``[E, 2, F, H]`` (in place in ``graph``); returns the names of the weights viewed."""
    readers: dict[FullTensor, list[Op]] = {}
    for op in graph.ops:
        if op.opdef is not None and op.opdef.name == MOE_EXPERTS:
            x = op.inputs[_GATE_UP]
            if isinstance(x, SubTensor):
                readers.setdefault(x.full, []).append(op)
    viewed: list[str] = []
    for full, ops in readers.items():
        if not _viewable(full, ops, graph):
            continue
        e, two_f, h = full.shape
        view = attrs.evolve(full, shape=(e, 2, two_f // 2, h), model_shape=full.shape)
        graph.tensors[graph.tensors.index(full)] = view
        for op in ops:
            graph.ops[graph.ops.index(op)] = _rebound(op, view)
        viewed.append(full.name)
    if viewed:
        graph.reindex()
    return viewed
