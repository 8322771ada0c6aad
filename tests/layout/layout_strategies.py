"""Hypothesis strategies for RVD layouts, shared by the layout tests."""

from __future__ import annotations

import torch
from hypothesis import assume
from hypothesis import strategies as st

from nnscaler.layout import Layout

SIZES = (1, 2, 3, 4, 6, 8, 12)
MAX_DEVICE_ID = 12


def _primes(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


@st.composite
def shapes(draw: st.DrawFn, *, max_ndim: int = 3) -> tuple[int, ...]:
    ndim = draw(st.integers(1, max_ndim))
    return tuple(draw(st.sampled_from(SIZES)) for _ in range(ndim))


@st.composite
def layouts_over(draw: st.DrawFn, shape: tuple[int, ...], devices: tuple[int, ...]) -> Layout:
    """A random R/V/D factorization of ``len(devices)`` that fits ``shape``."""
    r, v, d = 1, 1, [1] * len(shape)
    for p in _primes(len(devices)):
        options = ["R", "V"] + [i for i in range(len(shape)) if shape[i] % (d[i] * p) == 0]
        axis = draw(st.sampled_from(options))
        if axis == "R":
            r *= p
        elif axis == "V":
            v *= p
        else:
            d[axis] *= p
    return Layout(shape=shape, r=r, v=v, d=tuple(d), devices=devices)


@st.composite
def device_lists(draw: st.DrawFn, *, min_size: int = 1, max_size: int = 8) -> tuple[int, ...]:
    n = draw(st.sampled_from(range(min_size, max_size + 1)))
    chosen = draw(st.permutations(range(MAX_DEVICE_ID)))[:n]
    return tuple(chosen)


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    return draw(layouts_over(draw(shapes()), draw(device_lists())))


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[Layout, Layout]:
    """Two layouts of one shape: over the same devices (any order) or over other ones."""
    shape = draw(shapes())
    src_devices = draw(device_lists())
    same_set = draw(st.booleans())
    if same_set:
        dst_devices = tuple(draw(st.permutations(src_devices)))
    else:
        dst_devices = draw(device_lists())
    src = draw(layouts_over(shape, src_devices))
    dst = draw(layouts_over(shape, dst_devices))
    # Over one device set, equal counts often mean "nothing to do": keep a fifth of them.
    assume(not same_set or src.counts != dst.counts or draw(st.integers(0, 4)) == 0)
    return src, dst


def int_tensors(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Integer-valued float64, so that sums are exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 51, shape, generator=g).to(torch.float64)


def random_pieces(layout: Layout, seed: int) -> dict[int, torch.Tensor]:
    """Unrelated integer-valued tensors of the piece shape on every device."""
    g = torch.Generator().manual_seed(seed)
    return {
        dev: torch.randint(-9, 10, layout.piece_shape, generator=g).to(torch.float64)
        for dev in layout.devices
    }


def dot(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> float:
    """The dot product of two per-device tensor sets over the same devices."""
    if set(a) != set(b):
        raise ValueError(f"different devices: {sorted(a)} vs {sorted(b)}")
    return float(sum((a[k] * b[k]).sum() for k in a))
