"""Transform spaces: which splits an annotation allows, and the layouts they give."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from nnscaler.anno import (
    AnnotationError,
    Reduce,
    Replicate,
    Split,
    Transform,
    TransformRule,
    ValuePartial,
    parse,
)

from .strategies import bound_cases

S, R, V = Split, Replicate(), ValuePartial()


def table(space: list[Transform]) -> list[tuple]:
    return [(t.idx, t.dim, t.num, t.ident, t.inputs, t.outputs, dict(t.kwarg_updates)) for t in space]


def test_matmul_like() -> None:
    bound = parse("a k+, n k+ -> a n").bind([(4, 2), (3, 2)])
    assert table(bound.transform_space()) == [
        (0, 0, 2, "a", (S(0), R), (S(0),), {}),
        (0, 0, 4, "a", (S(0), R), (S(0),), {}),
        (0, 1, 2, "k", (S(1), S(1)), (V,), {}),
        (1, 0, 3, "n", (R, S(0)), (S(1),), {}),
        (1, 1, 2, "k", (S(1), S(1)), (V,), {}),  # the same identifier, addressed from input 1
    ]
    assert table(bound.transform_space(2)) == [
        row for row in table(bound.transform_space()) if row[2] == 2
    ]
    assert str(bound.split(0, 1, 2)) == "split input 0 dim 1 ('k') in 2: S(1), S(1) -> V"


def test_hidden_group_updates_kwargs() -> None:
    bound = parse("(h d) -> h d").bind([(32,)], {"h": 4})
    space = bound.transform_space()
    assert table(space) == [
        (0, 0, 2, "h", (S(0),), (S(0),), {"h": 2}),
        (0, 0, 4, "h", (S(0),), (S(0),), {"h": 1}),
    ]
    assert space[0].part_kwargs({"h": 4, "p": 0.1}, 1) == {"h": 2, "p": 0.1}
    assert str(space[0]) == "split input 0 dim 0 ('h') in 2: S(0) -> S(0) [h=2]"
    assert hash(space[0]) == hash(bound.split(0, 0, 2)) and space[0] == bound.split(0, 0, 2)


def test_frozen_numbers_and_inner_group_members_are_not_split() -> None:
    bound = parse("b (h d^), d^ 4, (e h) -> b e").bind([(2, 6), (3, 4), (10,)], {"h": 2})
    # d is frozen, 4 is a number, h is a later member of (e h), e is splittable from input 2
    assert [(t.idx, t.dim, t.num, t.ident) for t in bound.transform_space()] == [
        (0, 0, 2, "b"),
        (2, 0, 5, "e"),
    ]
    assert bound.transform_space(2)[0].inputs == (S(0), R, R)


def test_question_inputs_and_outputs() -> None:
    bound = parse("a, ?, ? -> a, ?").bind([(4,), None, (3,)])
    (t,) = bound.transform_space(4)
    assert t.inputs == (S(0), None, R) and t.outputs == (S(0), None)
    assert str(t) == "split input 0 dim 0 ('a') in 4: S(0), ?, R -> S(0), ?"


def test_stars_and_repeats() -> None:
    bound = parse("* a, a -> *").bind([(2, 3, 4), (4,)])
    assert [(t.idx, t.dim, t.ident, t.outputs) for t in bound.transform_space(2)] == [
        (0, 0, "*0", (S(0),)),
        (0, 2, "a", (R,)),
        (1, 0, "a", (R,)),
    ]
    # an identifier that names two dims of one tensor cannot be split
    assert parse("a a -> a").bind([(2, 2)]).transform_space() == []


def test_rules_override_the_default() -> None:
    def modifier(kwargs: dict, idx: int, dim: int, num: int, part: int) -> dict:
        return {**kwargs, "offset": part * kwargs["n"] // num}

    rule = TransformRule([S(0)], [S(0)], modifier)  # the author's word beats the '^'
    bound = parse("n^ -> n^").bind([(6,)], {"n": 6})
    assert bound.transform_space() == []
    space = bound.transform_space(rules=[rule])
    assert [(t.num, t.inputs, t.outputs, t.modifier) for t in space] == [
        (2, (S(0),), (S(0),), modifier),
        (3, (S(0),), (S(0),), modifier),
        (6, (S(0),), (S(0),), modifier),
    ]
    assert space[0].part_kwargs({"n": 6}, 1) == {"n": 6, "offset": 3}
    assert bound.split(0, 0, 3, rules=[rule]) == space[1]

    with pytest.raises(AnnotationError, match="2 input and 1 output placements"):
        bound.transform_space(rules=[TransformRule([S(0), R], [S(0)])])


def test_split_error_lists_the_legal_choices() -> None:
    bound = parse("a k^, n k^ -> a n").bind([(4, 8), (6, 8)])
    with pytest.raises(AnnotationError) as info:
        bound.split(0, 1, 2)
    reason = info.value.reason
    assert "cannot split input 0 dim 1 in 2: 'k' is marked '^'" in reason
    assert "idx=0, dim=0 ('a'): num in [2, 4]" in reason
    assert "idx=1, dim=0 ('n'): num in [2, 3, 6]" in reason
    assert info.value.position == 2
    for args, why in [
        ((0, 0, 3), "'a' has size 4; num must be a divisor"),
        ((0, 0, 1), "at least 2"),
        ((2, 0, 2), "the op has 2 inputs"),
        ((0, 5, 2), "input 0 has 2 dims"),
    ]:
        with pytest.raises(AnnotationError, match=why):
            bound.split(*args)
    with pytest.raises(AnnotationError, match="no split is legal"):
        parse("4 -> 4").bind([(4,)]).split(0, 0, 2)
    with pytest.raises(AnnotationError, match="annotated '\\?'"):
        parse("? -> ?").bind([None]).split(0, 0, 2)


def test_layouts() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    parts = [S(1).chunk(x, 2, p) for p in range(2)]
    assert parts[0].shape == (3, 2) and torch.equal(S(1).combine(parts), x)
    parts = [V.chunk(x, 3, p) for p in range(3)]
    assert torch.equal(parts[2], torch.zeros_like(x)) and torch.equal(V.combine(parts), x)
    assert R.chunk(x, 2, 1) is x and R.combine([x, x]) is x
    assert (str(S(0)), str(V), str(R)) == ("S(0)", "V", "R")


@settings(max_examples=200, deadline=None)
@given(bound_cases())
def test_space_is_consistent(case: tuple) -> None:
    anno, shapes, _, kwargs, _ = case
    try:
        bound = anno.bind(shapes, kwargs)
    except AnnotationError:
        return
    for t in bound.transform_space():
        size = bound.sizes[t.ident]
        assert t.num >= 2 and size % t.num == 0
        assert t.inputs[t.idx] == S(t.dim)
        assert bound.split(t.idx, t.dim, t.num) == t
        reduce = next(x.reduce for x in bound.expanded.inputs[t.idx].idents if x.name == t.ident)
        assert reduce is not Reduce.FROZEN
        tensors = (*bound.expanded.inputs, *bound.expanded.outputs)
        for layout, tensor in zip(t.inputs + t.outputs, tensors, strict=True):
            if isinstance(layout, Split):  # the split dim starts with the identifier
                assert tensor.dims[layout.dim].idents[0].name == t.ident
            elif tensor.is_tensor:  # replicated or partial: the tensor lacks it
                assert t.ident not in {x.name for x in tensor.idents}
                if layout == V:
                    assert reduce is Reduce.SUM
        assert dict(t.kwarg_updates) == ({t.ident: size // t.num} if t.ident in kwargs else {})
