"""Hypothesis strategies for dim annotations: valid annotations, their texts, their shapes."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from nnscaler.anno import STAR, DimAnno, Ident, OpAnno, Reduce, Star, TensorAnno

NAMES = ("a", "b", "c", "h", "d", "k", "x1", "long_name")
NUMBERS = ("1", "2", "3", "4")


@st.composite
def op_annos(
    draw: st.DrawFn,
    *,
    max_inputs: int = 3,
    groups: bool = True,
    stars: bool = True,
    numbers: bool = True,
    questions: bool = True,
) -> OpAnno:
    """A random valid annotation: identifiers with consistent marks, numbers, groups, stars,
    ``?`` entries, one to three outputs."""
    marks = {name: draw(st.sampled_from(Reduce)) for name in NAMES}

    def ident(names: tuple[str, ...]) -> Ident:
        if not names or (numbers and draw(st.integers(0, 4)) == 0):
            return Ident(draw(st.sampled_from(NUMBERS)), draw(st.sampled_from([Reduce.SPATIAL, Reduce.FROZEN])))
        name = draw(st.sampled_from(names))
        return Ident(name, marks[name])

    def tensor(names: tuple[str, ...], star: bool) -> TensorAnno:
        if questions and draw(st.integers(0, 5)) == 0:
            return TensorAnno(None)
        dims: list[DimAnno | Star] = []
        for _ in range(draw(st.integers(1, 4))):
            kind = draw(st.sampled_from(["ident", "ident", "group", "star"]))
            if kind == "star" and star and STAR not in dims:
                dims.append(STAR)
            elif kind == "group" and groups:
                dims.append(DimAnno(tuple(ident(names) for _ in range(draw(st.integers(2, 3))))))
            else:
                dims.append(DimAnno((ident(names),)))
        return TensorAnno(tuple(dims))

    inputs = tuple(tensor(NAMES, stars) for _ in range(draw(st.integers(0, max_inputs))))
    defined = tuple(sorted({x.name for t in inputs for x in t.idents if not x.is_number}))
    star = any(t.has_star for t in inputs)
    outputs = tuple(tensor(defined, star) for _ in range(draw(st.integers(1, 3))))
    return OpAnno(inputs, outputs)


@st.composite
def texts_of(draw: st.DrawFn, anno: OpAnno) -> str:
    """``anno`` written with random (valid) whitespace."""

    def space(least: int = 0) -> str:
        return draw(st.sampled_from([" ", "  ", "\t"])) if least or draw(st.booleans()) else ""

    def tensor(t: TensorAnno) -> str:
        if t.dims is None:
            return "?"
        parts = []
        for dim in t.dims:
            if isinstance(dim, DimAnno) and len(dim.idents) > 1:
                inner = "".join(str(x) + space(1) for x in dim.idents).rstrip()
                parts.append(f"({space()}{inner}{space()})")
            else:
                parts.append(str(dim))
        return "".join(p + space(1) for p in parts).rstrip()

    def side(ts: tuple[TensorAnno, ...]) -> str:
        return ",".join(space() + tensor(t) + space() for t in ts)

    return space() + side(anno.inputs) + "->" + side(anno.outputs) + space()


def _size(ident: Ident, sizes: dict[str, int]) -> int:
    return int(ident.name) if ident.is_number else sizes[ident.name]


def tensor_shape(tensor: TensorAnno, sizes: dict[str, int], star: tuple[int, ...]) -> tuple[int, ...]:
    shape: list[int] = []
    for dim in tensor.dims or ():
        if isinstance(dim, Star):
            shape.extend(star)
        else:
            shape.append(math.prod(_size(x, sizes) for x in dim.idents))
    return tuple(shape)


@st.composite
def bound_cases(draw: st.DrawFn, **anno_options: Any) -> tuple[OpAnno, list, dict[str, int], dict, list]:
    """(annotation, input shapes, true sizes, kwargs, expected output shapes)."""
    anno = draw(op_annos(**anno_options))
    sizes = {name: draw(st.integers(1, 4)) for name in NAMES}
    star = tuple(draw(st.lists(st.integers(1, 3), max_size=3)))
    shapes = []
    for t in anno.inputs:
        if t.is_tensor:
            shapes.append(tensor_shape(t, sizes, star))
        else:  # a non-tensor, or a tensor taken whole
            shapes.append(draw(st.none() | st.tuples(st.integers(1, 3))))
    kwargs = {name: sizes[name] for name in NAMES if draw(st.booleans())}
    expected = [tensor_shape(t, sizes, star) if t.is_tensor else None for t in anno.outputs]
    return anno, shapes, sizes, kwargs, expected
