"""Layout values: construction, text, device coordinates, pieces, dual."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_strategies import int_tensors, layouts

from nnscaler.errors import NNScalerError
from nnscaler.layout import Layout, LayoutError, assemble, materialize, piece


def test_str_repr_and_parse_round_trip():
    lay = Layout(shape=(4, 6), r=2, d=(1, 2), devices=(0, 1, 2, 3))
    assert str(lay) == "R(2)V(1)D(1,2)@[0,1,2,3]"
    assert repr(lay) == "Layout(shape=(4, 6), R(2)V(1)D(1,2)@[0,1,2,3])"
    assert Layout.parse(str(lay), shape=(4, 6)) == lay
    assert Layout.parse("R(1)V(2)D(2)", shape=(8,)) == Layout(shape=(8,), v=2, d=(2,))


def test_defaults():
    lay = Layout(shape=(3, 5), r=2)
    assert lay.d == (1, 1)
    assert lay.devices == (0, 1)
    assert lay.counts == (2, 1, 1, 1)
    assert lay.piece_shape == (3, 5)


def test_device_coordinates_are_mixed_radix_replica_first():
    lay = Layout.parse("R(2)V(1)D(1,2)@[5,7,4,6]", shape=(4, 6))
    assert [lay.coords(d) for d in (5, 7, 4, 6)] == [
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (1, 0, 0, 0),
        (1, 0, 0, 1),
    ]
    assert lay.device_at((1, 0, 0, 1)) == 6
    assert lay.box(7) == ((0, 4), (3, 6))
    assert piece(lay, 4) == ((slice(0, 4), slice(0, 3)), 0)
    lay = Layout.parse("R(1)V(2)D(2)@[3,2,1,0]", shape=(4,))
    assert [piece(lay, d).part for d in (3, 2, 1, 0)] == [0, 0, 1, 1]
    assert piece(lay, 2).slices == (slice(2, 4),)


def test_dual_swaps_replicas_and_parts():
    lay = Layout.parse("R(2)V(3)D(1)@[0,1,2,3,4,5]", shape=(4,))
    dual = lay.dual()
    assert dual.counts == (3, 2, 1)
    for dev in lay.devices:
        r, v, d = lay.coords(dev)
        assert dual.coords(dev) == (v, r, d)
    assert dual.dual() == lay


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"shape": (4,), "r": 2, "devices": (0, 1, 2)},
            r"needs r \* v \* prod\(d\) = 2 devices, got 3",
        ),
        ({"shape": (4,), "r": 2, "devices": (1, 1)}, r"repeat \[1\]"),
        ({"shape": (6,), "d": (4,)}, r"dim 0 of size 6 cannot be split into 4 equal chunks"),
        ({"shape": (6, 2), "d": (2,)}, r"has 1 entries but the tensor has 2 dims"),
        ({"shape": (6,), "r": 0}, r"r \(replicas\) must be an int >= 1, got 0"),
        ({"shape": (6,), "devices": (-1,)}, r"ints >= 0, got -1"),
        ({"shape": (6,), "v": True}, r"got True"),
    ],
)
def test_invalid_layouts_say_what_is_wrong(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        Layout(**kwargs)


def test_layout_error_refines_value_error():
    assert issubclass(LayoutError, ValueError)
    assert issubclass(LayoutError, NNScalerError)
    with pytest.raises(LayoutError, match="cannot parse layout 'R2'"):
        Layout.parse("R2", shape=(2,))
    with pytest.raises(LayoutError, match="device 9 is not in layout"):
        Layout(shape=(2,)).coords(9)


def test_materialize_and_assemble_check_shapes():
    lay = Layout(shape=(4, 6), d=(2, 1))
    with pytest.raises(LayoutError, match=r"shape \(4, 5\) but layout .* describes shape \(4, 6\)"):
        materialize(torch.zeros(4, 5), lay)
    parts = materialize(torch.zeros(4, 6), lay)
    parts[1] = torch.zeros(2, 5)
    with pytest.raises(LayoutError, match=r"device 1 holds a tensor of shape \(2, 5\)"):
        assemble(parts, lay)
    with pytest.raises(LayoutError, match=r"missing \[1\]"):
        assemble({0: parts[0]}, lay)


def test_materialize_default_puts_the_value_in_part_zero():
    lay = Layout.parse("R(1)V(2)D(2)@[0,1,2,3]", shape=(4,))
    x = torch.arange(4.0)
    parts = materialize(x, lay)
    assert torch.equal(parts[0], x[:2]) and torch.equal(parts[1], x[2:])
    assert not parts[2].any() and not parts[3].any()


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(0, 2**16), st.booleans())
def test_assemble_inverts_materialize_on_every_replica(lay, seed, random_split):
    x = int_tensors(lay.shape, seed)
    g = torch.Generator().manual_seed(seed) if random_split else None
    parts = materialize(x, lay, generator=g)
    assert list(parts) == list(lay.devices)
    for r in range(lay.r):
        assert torch.equal(assemble(parts, lay, replica=r), x)
    assert torch.equal(assemble(list(parts.values()), lay), x)
