"""RVD layouts: how one full tensor is spread over an ordered group of devices.

A `Layout` says that a tensor of full shape ``shape`` lives on ``devices`` as
``r`` replicas of ``v`` value-partial parts (the true value is the sum of the ``v``
parts), each part split into ``d[i]`` equal chunks along tensor dim ``i``; so
``len(devices) == r * v * prod(d)``.

Device coordinates. Position ``i`` in ``devices`` is the mixed-radix number whose digits
are ``(r, v, d_0, ..., d_{n-1})`` with radices ``(R, V, D_0, ..., D_{n-1})``, the replica
digit most significant and the last dim's chunk digit least significant (row-major
order). So ``R(2)V(1)D(1,2)@[5,7,4,6]`` puts chunk 0 of dim 1 on devices 5 and 4 and
chunk 1 on devices 7 and 6; devices 5 and 7 form replica 0. Any assignment of pieces to
devices is described by listing the devices in the right order.

Value-partial semantics. For every replica and every chunk, the ``v`` devices that
share ``(r, d)`` (a *part group*) hold tensors whose sum is that chunk of the full
tensor; which device holds which part is immaterial.

Gradients. `Layout.dual` is the layout of a gradient under the exact transpose:
``R`` and ``V`` swap (a replicated value's gradient is value-partial over its replicas,
a value-partial value's gradient is replicated), ``D`` stays. `Layout.replicated`
is its layout under the replicated-gradient convention (every device holds the whole
gradient of its chunk).
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import attrs
import torch

from nnscaler.errors import LayoutError

__all__ = [
    "Box",
    "Layout",
    "LayoutError",
    "Piece",
    "assemble",
    "materialize",
    "piece",
]

#: A box of a tensor: ``(start, stop)`` per dim, in global (full-tensor) coordinates.
Box = tuple[tuple[int, int], ...]


def _ints(what: str, value: Any, *, minimum: int) -> tuple[int, ...]:
    if type(value) is tuple and all(type(x) is int and x >= minimum for x in value):
        return value  # the common case, without the costlier checks below
    try:
        items = tuple(value)
    except TypeError:
        raise LayoutError(f"{what} must be a sequence of ints, got {value!r}.") from None
    for x in items:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < minimum:
            raise LayoutError(
                f"{what} must hold ints >= {minimum}, got {x!r} in {value!r}. "
                f"Fix: pass {what} as a tuple of ints >= {minimum}."
            )
    return tuple(int(x) for x in items)


def _count(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise LayoutError(f"{what} must be an int >= 1, got {value!r}.")
    return int(value)


@attrs.frozen(kw_only=True, repr=False)
class Layout:
    """A tensor of full ``shape`` spread over ``devices`` as ``R(r) V(v) D(d...)``.

    ``d`` defaults to no split (all ones) and ``devices`` to ``0 .. N-1``.
    ``str(layout)`` is short (``R(2)V(1)D(1,2)@[0,1,2,3]``); ``repr`` adds the shape.
    """

    shape: tuple[int, ...] = attrs.field(converter=lambda s: _ints("Layout shape", s, minimum=0))
    r: int = attrs.field(default=1, converter=lambda x: _count("Layout r (replicas)", x))
    v: int = attrs.field(default=1, converter=lambda x: _count("Layout v (value parts)", x))
    d: tuple[int, ...] = attrs.field(converter=lambda s: _ints("Layout d (splits)", s, minimum=1))
    devices: tuple[int, ...] = attrs.field(
        converter=lambda s: _ints("Layout devices", s, minimum=0)
    )

    @d.default
    def _default_d(self) -> tuple[int, ...]:
        return (1,) * len(self.shape)

    @devices.default
    def _default_devices(self) -> tuple[int, ...]:
        return tuple(range(self.r * self.v * math.prod(self.d)))

    def __attrs_post_init__(self) -> None:
        if len(self.d) != len(self.shape):
            raise LayoutError(
                f"Layout d {self.d} has {len(self.d)} entries but the tensor has "
                f"{len(self.shape)} dims (shape {self.shape}). Fix: give one split count "
                f"per dim (1 for an unsplit dim)."
            )
        for i, (size, parts) in enumerate(zip(self.shape, self.d)):
            if size % parts:
                raise LayoutError(
                    f"Layout: dim {i} of size {size} cannot be split into {parts} equal "
                    f"chunks (d[{i}] = {parts}, shape {self.shape}). Fix: choose a d[{i}] "
                    f"that divides {size}."
                )
        need = self.r * self.v * math.prod(self.d)
        if len(self.devices) != need:
            raise LayoutError(
                f"Layout {self.counts_str()}: needs r * v * prod(d) = {need} devices, got "
                f"{len(self.devices)} ({list(self.devices)}). Fix: list {need} distinct "
                f"device ids, or change r, v or d."
            )
        if len(set(self.devices)) != len(self.devices):
            dup = sorted({x for x in self.devices if self.devices.count(x) > 1})
            raise LayoutError(
                f"Layout {self.counts_str()}: devices {list(self.devices)} repeat {dup}; "
                f"every device holds exactly one piece. Fix: list distinct device ids."
            )

    # -- text ---------------------------------------------------------------------------
    def counts_str(self) -> str:
        return f"R({self.r})V({self.v})D({','.join(map(str, self.d))})"

    def __str__(self) -> str:
        return f"{self.counts_str()}@[{','.join(map(str, self.devices))}]"

    def __repr__(self) -> str:
        return f"Layout(shape={self.shape}, {self})"

    @classmethod
    def parse(cls, text: str, *, shape: Sequence[int]) -> Layout:
        """Build a layout from its ``str`` form, e.g. ``"R(2)V(1)D(1,2)@[0,1,2,3]"``.

        The ``@[...]`` device list may be left out (devices ``0 .. N-1``).
        """
        m = _LAYOUT_RE.fullmatch(text.replace(" ", ""))
        if m is None:
            raise LayoutError(
                f"cannot parse layout {text!r}: expected the form "
                f"'R(<int>)V(<int>)D(<int>,...)@[<device>,...]', e.g. 'R(2)V(1)D(1,2)@[0,1,2,3]' "
                f"(the '@[...]' part may be left out)."
            )
        d = tuple(int(x) for x in m["d"].split(",") if x) if m["d"] else ()
        devices = m["devices"]
        kwargs: dict[str, Any] = {}
        if devices is not None:
            kwargs["devices"] = tuple(int(x) for x in devices.split(",") if x)
        return cls(shape=tuple(shape), r=int(m["r"]), v=int(m["v"]), d=d, **kwargs)

    # -- sizes --------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def ndevices(self) -> int:
        return len(self.devices)

    @property
    def counts(self) -> tuple[int, ...]:
        """The radices ``(r, v, d_0, ..., d_{n-1})`` of the device coordinates."""
        return (self.r, self.v, *self.d)

    @property
    def piece_shape(self) -> tuple[int, ...]:
        return tuple(size // parts for size, parts in zip(self.shape, self.d))

    @property
    def piece_numel(self) -> int:
        return math.prod(self.piece_shape)

    # -- coordinates --------------------------------------------------------------------
    def index(self, device: int) -> int:
        """The position of ``device`` in `devices`."""
        try:
            return _index_map(self)[device]
        except KeyError:
            raise LayoutError(
                f"device {device!r} is not in layout {self}; its devices are {list(self.devices)}."
            ) from None

    def coords(self, device: int) -> tuple[int, ...]:
        """``(r, v, d_0, ..., d_{n-1})`` of ``device`` (see the module docstring)."""
        return unravel(self.index(device), self.counts)

    def device_at(self, coords: Sequence[int]) -> int:
        """The device at ``(r, v, d_0, ..., d_{n-1})``."""
        coords = tuple(coords)
        if len(coords) != len(self.counts) or any(
            not 0 <= c < n for c, n in zip(coords, self.counts)
        ):
            raise LayoutError(
                f"coordinates {coords} are outside layout {self}: expected "
                f"(r, v, d_0, ...) below {self.counts}."
            )
        return self.devices[ravel(coords, self.counts)]

    def box(self, device: int) -> Box:
        """The ``(start, stop)`` range per dim of the piece that ``device`` holds."""
        chunk = self.coords(device)[2:]
        return tuple((c * p, (c + 1) * p) for c, p in zip(chunk, self.piece_shape))

    def dual(self) -> Layout:
        """The layout of the gradient under the exact transpose: R and V swap.

        The device with value coordinates ``(r, v, d)`` gets gradient coordinates
        ``(v, r, d)``: the ``r`` replicas of a value hold ``r`` gradient parts that sum
        to the gradient, the ``v`` parts of a value each hold the whole gradient.
        """
        counts = (self.v, self.r, *self.d)
        devices = [0] * self.ndevices
        for i, dev in enumerate(self.devices):
            c = unravel(i, self.counts)
            devices[ravel((c[1], c[0], *c[2:]), counts)] = dev
        return Layout(shape=self.shape, r=self.v, v=self.r, d=self.d, devices=tuple(devices))

    def replicated(self) -> Layout:
        """The same chunks on the same devices, every device holding its whole chunk:
        ``R(r*v)V(1)D(d)``. Under the replicated-gradient convention (docs/internals/design.md, "Gradient
        layouts") this is the layout of the gradient of a tensor in ``self``."""
        return Layout(shape=self.shape, r=self.r * self.v, v=1, d=self.d, devices=self.devices)


_LAYOUT_RE = re.compile(
    r"R\((?P<r>\d+)\)V\((?P<v>\d+)\)D\((?P<d>[\d,]*)\)(?:@\[(?P<devices>[\d,]*)\])?"
)


@functools.lru_cache(maxsize=4096)
def _index_map(layout: Layout) -> dict[int, int]:
    return {dev: i for i, dev in enumerate(layout.devices)}


def unravel(index: int, counts: Sequence[int]) -> tuple[int, ...]:
    """Mixed-radix digits of ``index`` (first digit most significant)."""
    out = []
    for n in reversed(counts):
        index, digit = divmod(index, n)
        out.append(digit)
    return tuple(reversed(out))


def ravel(coords: Sequence[int], counts: Sequence[int]) -> int:
    """Inverse of `unravel`."""
    index = 0
    for c, n in zip(coords, counts):
        index = index * n + c
    return index


# ---------------------------------------------------------------------------------------
# Pieces: from a full tensor to per-device tensors and back
# ---------------------------------------------------------------------------------------


class Piece(NamedTuple):
    """What one device holds: ``full[slices]`` (or, for ``v > 1``, one part of it)."""

    slices: tuple[slice, ...]
    part: int


def piece(layout: Layout, device: int) -> Piece:
    """The slices of the full tensor that ``device`` holds, and its value-part index."""
    coords = layout.coords(device)
    return Piece(tuple(slice(a, b) for a, b in layout.box(device)), coords[1])


def _check_full(full: torch.Tensor, layout: Layout, what: str) -> None:
    if not isinstance(full, torch.Tensor):
        raise LayoutError(f"{what}: expected a torch.Tensor, got {type(full).__name__}.")
    if tuple(full.shape) != layout.shape:
        raise LayoutError(
            f"{what}: the tensor has shape {tuple(full.shape)} but layout {layout!r} "
            f"describes shape {layout.shape}. Fix: pass a tensor of the layout's shape, or "
            f"build the layout with shape={tuple(full.shape)}."
        )


def materialize(
    full: torch.Tensor, layout: Layout, *, generator: torch.Generator | None = None
) -> dict[int, torch.Tensor]:
    """The per-device tensors of ``full`` in ``layout``, keyed by device, in layout order.

    Value parts: without ``generator``, part 0 holds the value and the other parts are
    zeros. With a ``generator``, parts 1.. are random integers in [-8, 8] and part 0 is
    the rest, so the parts of an integer-valued tensor sum to it exactly. Every replica
    holds the same parts. Each returned tensor is a fresh, contiguous copy.
    """
    _check_full(full, layout, "materialize()")
    parts: dict[tuple[int, ...], list[torch.Tensor]] = {}
    out: dict[int, torch.Tensor] = {}
    for dev in layout.devices:
        coords = layout.coords(dev)
        chunk = coords[2:]
        if chunk not in parts:
            value = full[piece(layout, dev).slices]
            split = [value.clone()] + [torch.zeros_like(value) for _ in range(layout.v - 1)]
            if generator is not None and layout.v > 1:
                for p in split[1:]:
                    p.copy_(torch.randint(-8, 9, value.shape, generator=generator))
                    split[0] -= p
            parts[chunk] = split
        out[dev] = parts[chunk][coords[1]].clone().contiguous()
    return out


def _as_mapping(
    per_device: Mapping[int, torch.Tensor] | Sequence[torch.Tensor], layout: Layout, what: str
) -> Mapping[int, torch.Tensor]:
    if isinstance(per_device, Mapping):
        return per_device
    items = list(per_device)
    if len(items) != layout.ndevices:
        raise LayoutError(
            f"{what}: got {len(items)} tensors for layout {layout} of {layout.ndevices} "
            f"devices. Fix: pass one tensor per device, in layout order, or a dict by device."
        )
    return dict(zip(layout.devices, items))


def check_pieces(per_device: Mapping[int, torch.Tensor], layout: Layout, what: str) -> None:
    """Raise `LayoutError` unless ``per_device`` has one tensor of the piece shape
    on every device of ``layout`` and nothing else."""
    keys = set(per_device)
    want = set(layout.devices)
    if keys != want:
        missing = sorted(want - keys)
        extra = sorted(keys - want, key=repr)
        raise LayoutError(
            f"{what}: layout {layout} needs exactly one tensor on each of devices "
            f"{sorted(want)}; missing {missing}, unexpected {extra}. Fix: pass the per-device "
            f"tensors that materialize(full, layout) gives."
        )
    for dev in layout.devices:
        t = per_device[dev]
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"{what}: device {dev} holds a {type(t).__name__}, not a tensor.")
        if tuple(t.shape) != layout.piece_shape:
            raise LayoutError(
                f"{what}: device {dev} holds a tensor of shape {tuple(t.shape)}, but layout "
                f"{layout!r} gives every device a piece of shape {layout.piece_shape}. Fix: "
                f"pass the per-device tensors that materialize(full, layout) gives."
            )


def assemble(
    per_device: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
    layout: Layout,
    *,
    replica: int = 0,
) -> torch.Tensor:
    """The full tensor from one replica's pieces: value parts summed, chunks placed.

    ``per_device`` is a dict by device or a sequence in layout order. Every replica of a
    valid layout assembles to the same tensor; ``replica`` picks which one is read.
    """
    per_device = _as_mapping(per_device, layout, "assemble()")
    check_pieces(per_device, layout, "assemble()")
    if not 0 <= replica < layout.r:
        raise LayoutError(
            f"assemble(): replica {replica} does not exist in layout {layout} "
            f"(replicas 0..{layout.r - 1})."
        )
    first = per_device[layout.devices[0]]
    full = torch.zeros(layout.shape, dtype=first.dtype, device=first.device)
    for dev in layout.devices:
        if layout.coords(dev)[0] == replica:
            full[piece(layout, dev).slices] += per_device[dev]
    return full
