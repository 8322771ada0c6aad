"""The analytic time of an op on a named device (``device_type='H100'``), from its shapes.

Used where nothing is measured: a named device that is not here, and an op that cannot
run on made-up values. An op part's forward takes the longer of its arithmetic at the
device's throughput and its bytes at the device's memory bandwidth (a GPU kernel streams
its operands while it computes: the two overlap, they do not add), plus the fixed cost of
a kernel (`DeviceSpec.launch`). Three kinds of op are not costed by the generic rule:

- ops that move no data (`moves_no_data`): ``view``, ``transpose``, ``permute``,
  ``expand``, ``squeeze``/``unsqueeze``, ``detach``, a ``reshape`` or ``flatten`` of a
  contiguous tensor, a subscript by ints and slices: they return a view of their input
  and launch no kernel, so they cost nothing, forward and backward;
- ``scaled_dot_product_attention`` (`attention_flops`): its work is counted from its
  shapes, ``2 * B * H * Lq * Lk * (E + Ev)`` FLOPs forward (two matmuls: ``q @ k^T``
  and the probabilities times ``v``), half of it under a causal mask, 2.5 times that in
  backward (five matmuls of the same size against the forward's two, as the fused
  kernels do them), at the device's attention-kernel throughput;
- everything else: two FLOPs per multiply-accumulate (`nnscaler.extend.op_work`) at the
  device's matmul throughput, backward twice forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from nnscaler.extend import FullTensor, Op, SubTensor, op_work
from nnscaler_policy_autodist.comm import DeviceSpec

__all__ = ["VIEW_OPS", "analytic_time", "attention_flops", "mark_strided", "moves_no_data"]

#: Ops that return a view of their first input whatever its strides: no kernel, no bytes.
VIEW_OPS = frozenset({
    "torch.Tensor.view", "torch.Tensor.view_as", "torch.Tensor.expand",
    "torch.Tensor.expand_as", "torch.Tensor.permute", "torch.permute",
    "torch.Tensor.transpose", "torch.transpose", "torch.t", "torch.Tensor.t",
    "torch.squeeze", "torch.Tensor.squeeze", "torch.unsqueeze", "torch.Tensor.unsqueeze",
    "torch.detach", "torch.Tensor.detach", "torch.Tensor.unflatten", "torch.unflatten",
    "torch.narrow", "torch.Tensor.narrow", "torch.select", "torch.Tensor.select",
    "torch.split", "torch.Tensor.split", "torch.chunk", "torch.Tensor.chunk",
})

#: Ops that return a view when their input is contiguous, else a copy.
RESHAPE_OPS = frozenset({"torch.reshape", "torch.Tensor.reshape", "torch.flatten",
                         "torch.Tensor.flatten", "torch.Tensor.contiguous"})

#: View ops whose output is not contiguous even when their input is.
_STRIDING = frozenset({"torch.Tensor.permute", "torch.permute", "torch.Tensor.transpose",
                       "torch.transpose", "torch.t", "torch.Tensor.t", "torch.Tensor.expand",
                       "torch.Tensor.expand_as", "torch.narrow", "torch.Tensor.narrow",
                       "torch.select", "torch.Tensor.select", "torch.split",
                       "torch.Tensor.split", "torch.chunk", "torch.Tensor.chunk"})

GETITEM = "torch.Tensor.__getitem__"
SDPA = "torch.nn.functional.scaled_dot_product_attention"


def _first(op: Op) -> SubTensor | None:
    return next(iter(op.input_tensors()), None)


def _view_key(key: object) -> bool:
    """Whether a subscript by ``key`` returns a view: ints, slices, None, Ellipsis."""
    if isinstance(key, tuple):
        return all(_view_key(k) for k in key)
    return key is None or key is Ellipsis or isinstance(key, (int, slice)) \
        and not isinstance(key, bool)


def _strided_view(op: Op) -> bool:
    """A view whose output may not be contiguous: a subscript that slices a dim other
    than the first, or a `_STRIDING` op."""
    name = op.opdef.name if op.opdef is not None else op.name
    if name in _STRIDING:
        return True
    if name == GETITEM and len(op.inputs) > 1:
        key = op.inputs[1]
        keys = key if isinstance(key, tuple) else (key,)
        return any(isinstance(k, slice) and k != slice(None) for k in keys[1:])
    return False


def mark_strided(ops: Iterable[Op]) -> frozenset[FullTensor]:
    """The tensors ``ops`` (in program order) make that may not be contiguous: the
    outputs of transposes, permutes, expands and slicing subscripts, and of any view of
    such a tensor; a ``reshape`` of one copies it (and its output is contiguous)."""
    strided: set[FullTensor] = set()
    for op in ops:
        name = op.opdef.name if op.opdef is not None else op.name
        first = _first(op)
        source = first is not None and first.full in strided
        if name in RESHAPE_OPS:
            continue
        if _strided_view(op) or (source and (name in VIEW_OPS or _is_getitem_view(op))):
            strided.update(y.full for y in op.output_tensors())
    return frozenset(strided)


def _is_getitem_view(op: Op) -> bool:
    return len(op.inputs) > 1 and _view_key(op.inputs[1])


def moves_no_data(op: Op, strided: frozenset[FullTensor] = frozenset()) -> bool:
    """Whether ``op`` returns a view of its input (no kernel runs, no bytes move):
    a `VIEW_OPS` op; a ``reshape``/``flatten``/``contiguous`` of a tensor not in
    ``strided`` (`mark_strided`); a subscript by ints, slices, None and Ellipsis."""
    name = op.opdef.name if op.opdef is not None else op.name
    if name in VIEW_OPS:
        return True
    if name in RESHAPE_OPS:
        first = _first(op)
        return first is not None and first.full not in strided
    return name == GETITEM and _is_getitem_view(op)


def attention_flops(op: Op) -> tuple[float, float] | None:
    """(forward, backward) FLOPs of a whole ``scaled_dot_product_attention`` call, from
    its shapes (``None`` for another op): ``2 * B * H * Lq * Lk * (E + Ev)`` forward,
    halved under ``is_causal``; backward 2.5 times forward (the fused backward runs five
    matmuls of that size, recomputing the probabilities, where forward runs two)."""
    name = op.opdef.name if op.opdef is not None else op.name
    if name != SDPA:
        return None
    tensors = [x for x in op.inputs[:3] if isinstance(x, SubTensor)]
    if len(tensors) < 3:
        return None
    q, k, v = (tuple(x.shape) for x in tensors)
    lq, e = q[-2], q[-1]
    lk, ev = k[-2], v[-1]
    heads = math.prod(q[:-2])  # batch x query heads (a GQA key head serves several)
    fw = 2.0 * heads * lq * lk * (e + ev)
    if op.kwargs.get("is_causal", False) or (len(op.inputs) > 5 and op.inputs[5] is True):
        fw /= 2
    return fw, 2.5 * fw


def _bytes(op: Op) -> float:
    return float(sum(t.full.dtype.itemsize * math.prod(t.shape)
                     for t in (*op.input_tensors(), *op.output_tensors())))


def _grads(op: Op) -> bool:
    return not op.no_grad and any(t.full.requires_grad for t in op.input_tensors())


def _attention_share(op: Op, num: int, t: Any) -> float:
    """The share of an attention's work one of ``num`` parts does under ``t``: ``1/num``,
    except a split of the value's feature dim (``Ev``), under which every part still
    computes all of ``q @ k^T`` and only its ``Ev / num`` columns of the product with
    ``v``: ``(E + Ev / num) / (E + Ev)``."""
    v = op.inputs[2] if len(op.inputs) > 2 else None
    if t is None or num <= 1 or getattr(t, "idx", None) != 2 or not isinstance(v, SubTensor) \
            or t.dim != v.ndim - 1 or not isinstance(op.inputs[0], SubTensor):
        return 1.0 / num
    e, ev = op.inputs[0].shape[-1], v.shape[-1]
    return (e + ev / num) / (e + ev)


def analytic_time(op: Op, spec: DeviceSpec, num: int = 1,
                  strided: frozenset[FullTensor] = frozenset(),
                  t: Any = None) -> tuple[float, float]:
    """(forward, backward) seconds of one part of ``op`` in ``num`` parts on ``spec``'s
    device (the module's rules), split by ``t`` where given (it matters to attention's
    work: `_attention_share`). Backward is 0 when no gradient flows."""
    grads = _grads(op)
    if moves_no_data(op, strided):
        return 0.0, 0.0
    moved = _bytes(op) / num
    attn = attention_flops(op)
    if attn is not None:
        fw_rate = spec.attn_fw_flops or spec.flops
        bw_rate = spec.attn_bw_flops or spec.flops
        share = _attention_share(op, num, t)
        fw = max(attn[0] * share / fw_rate, moved / spec.mem_bw) + spec.launch
        # backward reads what forward read plus the output's gradient, writes the inputs'
        bw = max(attn[1] * share / bw_rate, 2 * moved / spec.mem_bw) + spec.launch
        return fw, (bw if grads else 0.0)
    work = op_work(op) / num
    fw = max(2 * work / spec.flops, moved / spec.mem_bw) + spec.launch
    return fw, (2 * fw if grads else 0.0)

