"""``cover``: which pieces form a region. Property: the leaves of any tree of index and
value splits form the whole tensor, and summing the chosen pieces cell by cell gives its
value back; without one leaf, there is a gap."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nnscaler.graph.pieces import Cell, Gap, cover
from nnscaler.ir import FullTensor, SubTensor

FULL = FullTensor(tid=0, shape=(4, 6), dtype=torch.float64)
WHOLE = FULL.whole()


def piece(rows: tuple[int, int], cols: tuple[int, int], valmap: tuple[int, int] = (0, 1)) -> SubTensor:
    return SubTensor(full=FULL, indmap=(rows, cols), valmap=valmap)


def test_one_whole_piece_is_one_cell():
    assert cover(WHOLE.indmap, [WHOLE]) == [Cell(WHOLE.indmap, (WHOLE,))]
    assert cover(((1, 3), (0, 2)), [WHOLE]) == [Cell(((1, 3), (0, 2)), (WHOLE,))]


def test_index_pieces_are_cut_into_cells():
    top, bottom = WHOLE.split(0, 2)
    cells = cover(WHOLE.indmap, [bottom, top, bottom])  # a replica counts once
    assert cells == [Cell(top.indmap, (top,)), Cell(bottom.indmap, (bottom,))]
    left, right = top.split(1, 2)
    cells = cover(((0, 4), (2, 5)), [left, right, bottom])
    assert [c.ranges for c in cells] == [((0, 2), (2, 3)), ((0, 2), (3, 5)), ((2, 4), (2, 3)),
                                          ((2, 4), (3, 5))]
    assert [c.pieces for c in cells] == [(left,), (right,), (bottom,), (bottom,)]


def test_value_parts_tile_the_value():
    a, b = WHOLE.value_split(2)
    b0, b1 = b.value_split(2)  # parts 2 and 3 of 4
    assert cover(WHOLE.indmap, [b1, a, b0]) == [Cell(WHOLE.indmap, (a, b0, b1))]
    assert cover(WHOLE.indmap, [a, b, b0, b1])[0].pieces == (a, b)  # longest parts first
    gap = cover(WHOLE.indmap, [a, b0])
    assert isinstance(gap, Gap) and gap.parts == ((0, 2), (2, 4))
    assert "the value parts there (0/2, 2/4) do not sum to the whole value" in str(gap)
    overlapping = [a, WHOLE.value_split(4)[0], WHOLE.value_split(4)[3]]  # 0-1/2, 0-1/4, 3/4-1
    assert isinstance(cover(WHOLE.indmap, overlapping), Gap)


def test_gap_names_the_box_without_pieces():
    top, _ = WHOLE.split(0, 2)
    gap = cover(WHOLE.indmap, [top])
    assert gap == Gap(((2, 4), (0, 6)), ())
    assert str(gap) == "[2:4, 0:6]: no piece holds these elements"


def test_zero_dim_tensors():
    scalar = FullTensor(tid=1, shape=(), dtype=torch.float32).whole()
    parts = scalar.value_split(3)
    assert cover((), parts) == [Cell((), parts)]
    assert isinstance(cover((), parts[:2]), Gap)


@st.composite
def split_trees(draw: st.DrawFn) -> tuple[torch.Tensor, list[tuple[SubTensor, tuple, torch.Tensor]], bool]:
    """A random tensor and the leaves ``(piece, value key, value)`` of a random tree of
    splits of it: index splits slice; value splits draw random parts that sum to their
    piece, and add a key element of their own (two value splits of replicas give parts
    with equal value maps but different values). Also whether some piece was replicated
    (then a leaf may be redundant)."""
    value = torch.randn(FULL.shape, dtype=torch.float64)
    leaves: list[tuple[SubTensor, tuple, torch.Tensor]] = [(WHOLE, (), value)]
    replicated = False
    for split in range(draw(st.integers(0, 6))):
        sub, key, v = leaves.pop(draw(st.integers(0, len(leaves) - 1)))
        how = draw(st.sampled_from(["rows", "cols", "value", "replica"]))
        num = draw(st.integers(2, 3))
        if how == "value":
            parts = [torch.randn_like(v) for _ in range(num - 1)]
            parts.append(v - sum(parts))
            leaves += [(p, (*key, (split, i)), x)
                       for i, (p, x) in enumerate(zip(sub.value_split(num), parts, strict=True))]
        elif how == "replica":
            leaves += [(sub, key, v), (sub, key, v)]
            replicated = True
        else:
            dim = 0 if how == "rows" else 1
            if sub.shape[dim] < num:
                leaves.append((sub, key, v))
                continue
            a = sub.indmap[dim][0]
            leaves += [(p, key, v.narrow(dim, p.indmap[dim][0] - a, p.shape[dim]))
                       for p in sub.split(dim, num)]
    return value, leaves, replicated


@settings(max_examples=200, deadline=None)
@given(tree=split_trees(), drop=st.integers(0, 100))
def test_leaves_of_a_split_tree_form_the_tensor(tree, drop):
    value, leaves, replicated = tree
    pieces, keys = [p for p, _, _ in leaves], [k for _, k, _ in leaves]
    cells = cover(WHOLE.indmap, pieces, keys)
    assert isinstance(cells, list)
    rebuilt = torch.zeros_like(value)
    for cell in cells:
        box = tuple(slice(a, b) for a, b in cell.ranges)
        for i in cell.picks:
            p, _, v = leaves[i]
            rel = tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(cell.ranges, p.indmap, strict=True))
            rebuilt[box] += v[rel]
    torch.testing.assert_close(rebuilt, value)

    if not replicated:  # every leaf is needed: without one, something is missing
        k = drop % len(pieces)
        assert isinstance(cover(WHOLE.indmap, pieces[:k] + pieces[k + 1:], keys[:k] + keys[k + 1:]), Gap)


def test_parts_of_different_splits_do_not_mix():
    """Parts 0/2 and 1/2 of two different value splits (of replicas) sum to nothing."""
    a0, a1 = WHOLE.value_split(2)
    gap = cover(WHOLE.indmap, [a0, a1], [(("rows", 0),), (("cols", 1),)])
    assert isinstance(gap, Gap) and gap.mixed and "come from different splits" in str(gap)
    assert cover(WHOLE.indmap, [a0, a1], [(("rows", 0),), (("rows", 1),)])[0].picks == (0, 1)
    # each half split again, differently: still the value
    q = [*a0.value_split(2), *a1.value_split(2)]
    keys = [(("rows", 0), ("x", 0)), (("rows", 0), ("x", 1)), (("rows", 1), ("y", 0)),
            (("rows", 1), ("y", 1))]
    assert cover(WHOLE.indmap, q, keys)[0].picks == (0, 1, 2, 3)
    keys[1] = (("rows", 0), ("y", 1))  # the second quarter from another split of the half
    assert isinstance(cover(WHOLE.indmap, q, keys), Gap)
