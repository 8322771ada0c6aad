"""Which pieces of a tensor make up a given region: the arithmetic behind ``check`` and
``run_plan``.

A piece (`SubTensor`) holds index ranges and a value part
``(p, n)``, read here as the interval ``[p/n, (p+1)/n)`` of the tensor's value. A region
can be formed from a set of pieces when every element of it lies in pieces whose value
intervals tile ``[0, 1)``: summing those pieces gives the value there. `cover` cuts
the region into cells along every piece boundary and, for each cell, picks such a tiling
(replicas of one piece count once); it returns the first cell that none can tile
otherwise.

A value part alone does not say *which* split made it: splitting ``sum(x)`` over rows and,
in a replica, over columns gives two "parts 0 and 1 of 2" that do not mix. So each piece
may carry a *value key*: the ``(split, part)`` pairs, outermost first, of the splits that
made it value-partial (``split`` names the split, e.g. the identifier and the count). Two
parts are summed together only where their keys first differ in the part of one split,
never in the split itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from fractions import Fraction

import attrs

from nnscaler.ir import SubTensor

Ranges = tuple[tuple[int, int], ...]
ValueKey = tuple[tuple[Hashable, int], ...]  # ((split, part), ...), outermost first


@attrs.frozen
class Cell:
    """A box of the region (absolute ranges) and the pieces whose values sum to it there
    (``picks``: their positions in the sequence given to `cover`)."""

    ranges: Ranges
    pieces: tuple[SubTensor, ...]
    picks: tuple[int, ...] = attrs.field(eq=False, default=())


@attrs.frozen
class Gap:
    """A box of the region that the pieces cannot form; ``parts`` are the value parts
    (``(p, n)``) that pieces hold there (none: no piece holds any element of it)."""

    ranges: Ranges
    parts: tuple[tuple[int, int], ...]
    mixed: bool = False  # the parts would tile, but come from different splits

    def __str__(self) -> str:
        box = "[" + ", ".join(f"{a}:{b}" for a, b in self.ranges) + "]"
        if not self.parts:
            return f"{box}: no piece holds these elements"
        held = ", ".join(f"{p}/{n}" for p, n in self.parts)
        if self.mixed:
            return (f"{box}: the value parts there ({held}) come from different splits of the "
                    f"op (along different identifiers), which do not sum to the value")
        return f"{box}: the value parts there ({held}) do not sum to the whole value"


def _contains(piece: SubTensor, ranges: Ranges) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(piece.indmap, ranges, strict=True))


def _overlaps(piece: SubTensor, ranges: Ranges) -> bool:
    return all(max(a, c) < min(b, d) or (a == b == c == d)
               for (a, b), (c, d) in zip(piece.indmap, ranges, strict=True))


def _interval(piece: SubTensor) -> tuple[Fraction, Fraction]:
    p, n = piece.valmap
    return Fraction(p, n), Fraction(p + 1, n)


def _compatible(a: ValueKey, b: ValueKey) -> bool:
    """Parts that can be summed: where their keys first differ, it is in the part of one
    split (two branches of it), not in the split."""
    for (split_a, part_a), (split_b, part_b) in zip(a, b):
        if split_a != split_b:
            return False
        if part_a != part_b:
            return True
    return True


def _tile(entries: Sequence[tuple[int, SubTensor, ValueKey]]) -> tuple[int, ...] | None:
    """Positions of pieces whose value intervals tile [0, 1) exactly, with compatible value
    keys (one piece per interval and key), or None."""
    options: dict[Fraction, list[tuple[Fraction, int, ValueKey]]] = {}
    seen: set[tuple[Fraction, Fraction, ValueKey]] = set()
    for at, piece, key in entries:
        lo, hi = _interval(piece)
        if (lo, hi, key) not in seen:
            seen.add((lo, hi, key))
            options.setdefault(lo, []).append((hi, at, key))
    for choices in options.values():
        choices.sort(key=lambda choice: (-choice[0], len(choice[2])))  # longest, plainest first
    dead: set[tuple[Fraction, tuple[ValueKey, ...]]] = set()

    def walk(at: Fraction, keys: tuple[ValueKey, ...]) -> list[int] | None:
        if at == 1:
            return []
        if (at, keys) in dead:
            return None
        for hi, pick, key in options.get(at, ()):
            if all(_compatible(key, k) for k in keys):
                rest = walk(hi, (*keys, key))
                if rest is not None:
                    return [pick, *rest]
        dead.add((at, keys))
        return None

    found = walk(Fraction(0), ())
    return None if found is None else tuple(found)


def cover(
    ranges: Ranges, pieces: Sequence[SubTensor], keys: Sequence[ValueKey] | None = None
) -> list[Cell] | Gap:
    """Cut ``ranges`` (one ``(start, stop)`` per dim) into cells that ``pieces`` can form.

    ``keys`` holds each piece's value key (default: all the same). Returns the cells, each
    with the pieces to sum there, or the first `Gap`.
    """
    ranges = tuple((int(a), int(b)) for a, b in ranges)
    keyed = [(at, p, () if keys is None else tuple(keys[at])) for at, p in enumerate(pieces)]
    near = [e for e in keyed if _overlaps(e[1], ranges)]

    def cell(box: Ranges) -> Cell | None:
        picks = _tile([e for e in near if _contains(e[1], box)])
        if picks is None:
            return None
        return Cell(box, tuple(pieces[i] for i in picks), picks)

    whole = cell(ranges)
    if whole is not None:  # the common case: pieces that each hold the whole region
        return [whole]
    cuts = []
    for d, (start, stop) in enumerate(ranges):
        points = {start, stop}
        for _, p, _ in near:
            a, b = p.indmap[d]
            points.update(x for x in (a, b) if start < x < stop)
        ordered = sorted(points)
        cuts.append(list(zip(ordered, ordered[1:])) or [(start, stop)])
    cells = []
    for box in itertools.product(*cuts):
        found = cell(tuple(box))
        if found is None:
            inside = [e for e in near if _contains(e[1], box)]
            parts = tuple(sorted({p.valmap for _, p, _ in inside}, key=lambda v: (v[1], v[0])))
            mixed = _tile([(at, p, ()) for at, p, _ in inside]) is not None
            return Gap(tuple(box), parts, mixed)
        cells.append(found)
    return cells
