"""Python source for the constants an op was called with.

`literal` turns a recorded argument into source that evaluates to it: numbers
(``inf`` and ``nan`` included), strings, ``None``, dtypes (``torch.float32``), the
runtime device (``self.device``: every device a model passed is recorded as
`CURRENT_DEVICE`), slices, ``Ellipsis``, ``torch.Size``, memory
formats, layouts and nested lists, tuples and dicts of these. A `Code` leaf is
source already (a variable name). Anything else is a `CodegenError` naming the
value.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import attrs
import torch

from nnscaler.codegen.errors import CodegenError
from nnscaler.ir import CURRENT_DEVICE

#: How generated code spells the device the module runs on.
DEVICE_EXPR = "self.device"

_TORCH_ENUMS: tuple[tuple[type, tuple[Any, ...]], ...] = (
    (torch.memory_format, (torch.contiguous_format, torch.channels_last,
                           torch.channels_last_3d, torch.preserve_format)),
    (torch.layout, (torch.strided, torch.sparse_coo, torch.sparse_csr)),
    (torch.qscheme, ()),
)


@attrs.frozen
class Code:
    """A piece of source to emit as is (a variable, an expression)."""

    text: str

    def __repr__(self) -> str:
        return self.text


def _torch_name(value: Any) -> str | None:
    """``torch.<name>`` for a torch singleton (dtype, memory format, layout), else None."""
    text = str(value)
    if text.startswith("torch."):
        attr = text.removeprefix("torch.")
        if getattr(torch, attr, None) is value:
            return text
    for name in dir(torch):
        if not name.startswith("_") and getattr(torch, name, None) is value:
            return f"torch.{name}"
    return None


def _float(value: float) -> str:
    if math.isnan(value):
        return "float('nan')"
    if math.isinf(value):
        return "float('inf')" if value > 0 else "float('-inf')"
    return repr(value)


def literal(value: Any, *, where: str = "") -> str:
    """Source that evaluates to ``value`` in generated code (see the module docstring)."""
    if isinstance(value, Code):
        return value.text
    if value is None:
        return "None"
    if value is Ellipsis:
        return "..."
    if value is CURRENT_DEVICE or isinstance(value, torch.device):
        return DEVICE_EXPR
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, enum.Enum):
        raise CodegenError(
            f"{where or 'a constant'}: cannot write the enum value {value!r} into generated "
            f"code; pass its plain value (an int or a str) in the model instead"
        )
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, complex):
        return f"complex({_float(value.real)}, {_float(value.imag)})"
    if isinstance(value, (str, bytes)):
        return repr(value)
    if isinstance(value, torch.dtype):
        name = _torch_name(value)
        if name is None:
            raise CodegenError(f"{where or 'a constant'}: the dtype {value!r} has no torch.<name>")
        return name
    if isinstance(value, torch.Size):
        return f"torch.Size([{', '.join(literal(v, where=where) for v in value)}])"
    if isinstance(value, slice):
        parts = (value.start, value.stop, value.step)
        return f"slice({', '.join(literal(v, where=where) for v in parts)})"
    if isinstance(value, range):
        return f"range({value.start}, {value.stop}, {value.step})"
    for kind, _ in _TORCH_ENUMS:
        if isinstance(value, kind):
            name = _torch_name(value)
            if name is not None:
                return name
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple: its items
        value = tuple(value)
    if isinstance(value, tuple):
        items = [literal(v, where=where) for v in value]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if isinstance(value, list):
        return f"[{', '.join(literal(v, where=where) for v in value)}]"
    if isinstance(value, dict):
        pairs = [f"{literal(k, where=where)}: {literal(v, where=where)}" for k, v in value.items()]
        return "{" + ", ".join(pairs) + "}"
    if isinstance(value, (set, frozenset)):
        items = sorted(literal(v, where=where) for v in value)
        inner = "{" + ", ".join(items) + "}" if items else "()"
        return inner if isinstance(value, set) else f"frozenset({inner})"
    raise CodegenError(
        f"{where or 'a constant'}: cannot write {type(value).__name__} {value!r} into "
        f"generated code; only numbers, strings, None, dtypes, devices, slices, Ellipsis, "
        f"torch.Size and lists, tuples and dicts of them can be. Pass such a value in the "
        f"model, or register an op that takes the object's plain fields."
    )


def index_literal(key: Any, *, where: str = "") -> str:
    """The source inside ``x[...]`` for an indexing key: ``0:2, ..., None``."""

    def one(k: Any) -> str:
        if isinstance(k, slice):
            start = "" if k.start is None else literal(k.start, where=where)
            stop = "" if k.stop is None else literal(k.stop, where=where)
            text = f"{start}:{stop}"
            if k.step is not None:
                text += f":{literal(k.step, where=where)}"
            return text
        return literal(k, where=where)

    if isinstance(key, tuple) and not hasattr(key, "_fields"):
        if not key:
            return "()"
        inner = ", ".join(one(k) for k in key)
        return inner + "," if len(key) == 1 else inner
    return one(key)
