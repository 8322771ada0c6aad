"""Tensors of the IR: a `FullTensor` is one logical tensor of the model, a
`SubTensor` is the piece of it that one op instance reads or writes.

A sub-tensor is described by two maps, so that the layout layer can compare pieces with
plain arithmetic and never look at data:

- ``indmap``: one half-open range ``(start, stop)`` per dim of the full tensor;
- ``valmap``: ``(part, nparts)``: the piece holds part ``part`` of a value split in
  ``nparts`` summands (``(0, 1)``: the whole value). Splitting part ``p`` of ``n`` again
  in ``k`` gives parts ``p*k .. p*k+k-1`` of ``n*k``, so value splits nest.

A traced graph holds whole sub-tensors only (every range is the full dim, valmap
``(0, 1)``); partitioning creates the others.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import attrs
import torch


class TensorKind(enum.Enum):
    """Where a full tensor's value comes from."""

    INPUT = "input"  # a forward argument
    PARAMETER = "parameter"  # an nn.Parameter of the module
    BUFFER = "buffer"  # a registered buffer (persistent or not)
    CONSTANT = "constant"  # a tensor the model captured (not registered): value kept
    ACTIVATION = "activation"  # produced by an op of the graph


_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
}


def dtype_str(dtype: torch.dtype) -> str:
    """A short name for ``dtype`` (``f32``, ``i64``, ``bool``, ...)."""
    return _DTYPE_SHORT.get(dtype, str(dtype).removeprefix("torch."))


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in value)


@attrs.frozen(kw_only=True, eq=False)
class FullTensor:
    """One logical tensor of the model, in one version.

    Identity is the object: two full tensors are the same tensor only if they are the same
    object. An in-place op does not change a full tensor; it produces a new *version*
    (``version`` + 1, same ``base``, same ``names``) that later uses refer to.

    - ``tid``: a number unique within the graph, for printing;
    - ``names``: qualified names of a parameter or buffer (several when tied, e.g. an LM
      head tied to the token embedding), or the argument path of a forward input;
    - ``persistent``: for buffers, whether it is in the module's ``state_dict``;
    - ``base``: for a version > 0, the version-0 tensor;
    - ``value``: the captured value of a `TensorKind.CONSTANT` (None otherwise);
    - ``model_shape``: for a parameter the graph holds reshaped (``shape``, the same
      elements in row-major order, e.g. an expert weight ``[E, 2F, H]`` viewed as
      ``[E, 2, F, H]``), the module's own shape: values from the module and checkpoints
      for it are in ``model_shape`` (None: the same as ``shape``).
    """

    tid: int
    shape: tuple[int, ...] = attrs.field(converter=_shape)
    dtype: torch.dtype
    requires_grad: bool = False
    kind: TensorKind = TensorKind.ACTIVATION
    names: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    persistent: bool = True
    version: int = 0
    base: FullTensor | None = None
    value: torch.Tensor | None = attrs.field(default=None, repr=False)
    model_shape: tuple[int, ...] | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_param(self) -> bool:
        return self.kind is TensorKind.PARAMETER

    @property
    def is_buffer(self) -> bool:
        return self.kind is TensorKind.BUFFER

    @property
    def is_leaf(self) -> bool:
        """True when no op of the graph produces it (input, parameter, buffer, constant)."""
        return self.kind is not TensorKind.ACTIVATION and self.version == 0

    @property
    def root(self) -> FullTensor:
        """The version-0 tensor this one is a version of (itself for version 0)."""
        return self.base if self.base is not None else self

    @property
    def name(self) -> str:
        """A readable name: the first qualified name, else ``t<tid>`` (``c<tid>`` for a
        constant); versions after the first get ``@v<n>``."""
        root = self.root
        if root.names:
            stem = root.names[0]
        else:
            stem = f"{'c' if root.kind is TensorKind.CONSTANT else 't'}{root.tid}"
        return f"{stem}@v{self.version}" if self.version else stem

    def whole(self) -> SubTensor:
        """The sub-tensor that covers all of this tensor."""
        return SubTensor(full=self, indmap=tuple((0, n) for n in self.shape))

    def new_version(self, tid: int, *, shape: tuple[int, ...] | None = None,
                    requires_grad: bool | None = None) -> FullTensor:
        """The tensor after an in-place op: same names and kind, next version."""
        return attrs.evolve(
            self,
            tid=tid,
            shape=self.shape if shape is None else shape,
            requires_grad=self.requires_grad if requires_grad is None else requires_grad,
            version=self.version + 1,
            base=self.root,
            value=None,
        )

    def __str__(self) -> str:
        return f"{self.name}:{dtype_str(self.dtype)}{list(self.shape)}"


def _check_indmap(sub: SubTensor, _: attrs.Attribute, indmap: tuple[tuple[int, int], ...]) -> None:
    shape = sub.full.shape
    if len(indmap) != len(shape):
        raise ValueError(
            f"a sub-tensor of {sub.full.name} (shape {list(shape)}) needs one (start, stop) "
            f"range per dim, got {len(indmap)}: {indmap}"
        )
    for d, ((start, stop), size) in enumerate(zip(indmap, shape, strict=True)):
        if not 0 <= start < stop <= size and not (size == 0 and start == stop == 0):
            raise ValueError(
                f"dim {d} of a sub-tensor of {sub.full.name} has range [{start}, {stop}) but "
                f"the dim has size {size}; ranges need 0 <= start < stop <= size"
            )


def _check_valmap(_: SubTensor, __: attrs.Attribute, valmap: tuple[int, int]) -> None:
    part, nparts = valmap
    if not (nparts >= 1 and 0 <= part < nparts):
        raise ValueError(f"valmap is (part, nparts) with 0 <= part < nparts, got {valmap}")


def _ranges(value: Any) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in value)


@attrs.frozen(kw_only=True)
class SubTensor:
    """The piece of ``full`` that an op instance holds: index ranges and a value part.

    Sub-tensors are values: two with the same full tensor, ranges and value part are equal.
    """

    full: FullTensor
    indmap: tuple[tuple[int, int], ...] = attrs.field(converter=_ranges, validator=_check_indmap)
    valmap: tuple[int, int] = attrs.field(default=(0, 1), converter=tuple, validator=_check_valmap)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.indmap)

    @property
    def ndim(self) -> int:
        return len(self.indmap)

    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype

    @property
    def requires_grad(self) -> bool:
        return self.full.requires_grad

    @property
    def is_whole(self) -> bool:
        """Covers every element and the whole value."""
        return self.valmap == (0, 1) and self.shape == self.full.shape

    @property
    def is_value_partial(self) -> bool:
        return self.valmap[1] > 1

    def split(self, dim: int, num: int) -> tuple[SubTensor, ...]:
        """``num`` pieces along ``dim`` (sizes as ``torch.tensor_split``: the first ones
        one longer when ``num`` does not divide the size)."""
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"dim {dim} is out of range for {self} ({self.ndim} dims)")
        dim %= self.ndim
        start, stop = self.indmap[dim]
        size = stop - start
        if not 1 <= num <= size:
            raise ValueError(
                f"cannot split dim {dim} of {self} (size {size}) in {num} parts; "
                f"use 1 <= num <= {size}"
            )
        q, r = divmod(size, num)
        pieces, at = [], start
        for i in range(num):
            n = q + (1 if i < r else 0)
            ranges = list(self.indmap)
            ranges[dim] = (at, at + n)
            pieces.append(attrs.evolve(self, indmap=tuple(ranges)))
            at += n
        return tuple(pieces)

    def value_split(self, num: int) -> tuple[SubTensor, ...]:
        """``num`` value parts that sum to this piece."""
        if num < 1:
            raise ValueError(f"a value split needs num >= 1, got {num}")
        part, nparts = self.valmap
        return tuple(
            attrs.evolve(self, valmap=(part * num + i, nparts * num)) for i in range(num)
        )

    def overlaps(self, other: SubTensor) -> bool:
        """True when both pieces share an element of the same full tensor."""
        if other.full is not self.full:
            return False
        return all(
            max(a0, b0) < min(a1, b1)
            for (a0, a1), (b0, b1) in zip(self.indmap, other.indmap, strict=True)
        )

    def covers(self, other: SubTensor) -> bool:
        """True when every element of ``other`` lies in this piece (ranges only)."""
        return other.full is self.full and all(
            a0 <= b0 and b1 <= a1
            for (a0, a1), (b0, b1) in zip(self.indmap, other.indmap, strict=True)
        )

    def select(self, value: torch.Tensor) -> torch.Tensor:
        """This piece's elements of ``value``, the full tensor's value (no value split)."""
        return value[tuple(slice(a, b) for a, b in self.indmap)]

    def __str__(self) -> str:
        text = self.full.name
        if self.shape != self.full.shape:
            dims = [
                ":" if (a, b) == (0, n) else f"{a}:{b}"
                for (a, b), n in zip(self.indmap, self.full.shape, strict=True)
            ]
            text += f"[{', '.join(dims)}]"
        if self.valmap != (0, 1):
            text += f"(part {self.valmap[0]}/{self.valmap[1]})"
        return text


@attrs.frozen
class _CurrentDevice:
    """Stands for "the device this program runs on" in an op's recorded arguments."""

    def __repr__(self) -> str:
        return "CURRENT_DEVICE"


#: Recorded in place of every ``torch.device`` (and ``device=`` argument) a model passed,
#: so that a graph does not depend on the device it was traced on.
CURRENT_DEVICE = _CurrentDevice()
