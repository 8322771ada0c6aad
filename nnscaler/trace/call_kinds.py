"""What kind of call the tracer sees: the tables of calls it runs without recording
(interpreter state, metadata reads), the calls that read tensor data or whose result's
size depends on it, and small predicates on a call (may it write in place?) and on
tensors (storage, version counter, autocast state).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from nnscaler.ops.registry import op_name_of

_T = torch.Tensor


#: Calls that change interpreter state, never recorded.
STATE_CALLS = frozenset({torch._C._set_grad_enabled})


#: Metadata reads: their results are Python values; run them without any bookkeeping.
METADATA_CALLS = frozenset(
    {
        _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.ndim.__get__,
        _T.is_cuda.__get__, _T.is_meta.__get__, _T.layout.__get__, _T.requires_grad.__get__,
        _T.is_leaf.__get__, _T.grad_fn.__get__, _T._base.__get__, _T._version.__get__,
        _T.size, _T.dim, _T.numel, _T.stride, _T.element_size, _T.is_floating_point,
        _T.is_complex, _T.is_contiguous, _T.__len__, _T.nelement, _T.ndimension,
        _T.get_device, _T.data_ptr, _T.__hash__, _T.__repr__, _T.__format__,
    }
)


#: Calls whose Python result is read from tensor *data*.
DATA_READS = frozenset(
    {
        _T.item, _T.__bool__, _T.tolist, _T.__int__, _T.__float__, _T.__index__,
        _T.__complex__, _T.numpy, _T.__array__, _T.__contains__, _T.equal, _T.allclose,
        _T.is_nonzero, torch.equal, torch.allclose, torch.is_nonzero,
    }
)


#: Calls whose result's *size* depends on tensor data (see `data_sized`).
DATA_SIZED = frozenset(
    {
        torch.nonzero, _T.nonzero, torch.argwhere, _T.argwhere, torch.masked_select,
        _T.masked_select, torch.unique, _T.unique, torch.unique_consecutive,
        _T.unique_consecutive, torch.bincount, _T.bincount,
    }
)


#: The device types whose autocast state is recorded per op.
AUTOCAST_DEVICES = ("cpu", "cuda")


#: On the meta device these are moves to the device the tensor is already on.
DEVICE_MOVES = frozenset({_T.cpu, _T.cuda})


def func_name(func: Callable[..., Any]) -> str:
    name = torch.overrides.resolve_name(func)
    return name if name else op_name_of(func)


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def storage_of(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # e.g. a tensor subclass without storage
        return -id(t)


def may_write(func: Callable[..., Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a call may write one of its tensor arguments in place."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" \
        or kwargs.get("out") is not None or kwargs.get("inplace") is True \
        or name.startswith("__i")


def data_sized(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether the size of ``func``'s result depends on the *values* of its inputs:
    ``torch.nonzero``, ``torch.where(cond)`` (one argument), boolean-mask indexing,
    ``torch.unique``, ``repeat_interleave`` by a tensor of counts, ..."""
    if func in DATA_SIZED:
        return True
    if func is torch.where:
        return len(args) + len(kwargs) == 1
    if func in (torch.repeat_interleave, _T.repeat_interleave):
        if kwargs.get("output_size") is not None:
            return False
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
        return isinstance(repeats, torch.Tensor) and repeats.numel() > 1
    if func is _T.__getitem__ and len(args) > 1:
        return any(isinstance(k, torch.Tensor) and k.dtype in (torch.bool, torch.uint8)
                   for k in pytree.tree_leaves(args[1]))
    return False


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """``(device_type, dtype)`` of every device type whose autocast is on now."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(d))


def version_of(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors have no version counter
        return -1


def shapes_str(tensors: list[torch.Tensor]) -> str:
    return ", ".join(str(list(t.shape)) for t in tensors) or "none"


def check_outputs(anno: Any, outs: list[torch.Tensor]) -> None:
    """The annotation's output shapes must be the shapes the call returned."""
    expected = anno.output_shapes
    if len(expected) != len(outs):
        return  # e.g. an in-place op annotated with the tensor it writes
    for i, (shape, t) in enumerate(zip(expected, outs, strict=True)):
        got = tuple(t.shape)
        if shape is not None and shape != got and not (got == () and shape == (1,)):
            raise ValueError(
                f"the annotation {str(anno)!r} gives output {i} the shape {list(shape)} but "
                f"the call returned {list(got)}"
            )
