"""Binding annotations to shapes: sizes, stars, hidden groups, and the errors that name them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from nnscaler.anno import AnnotationError, OpAnno, parse

from .strategies import bound_cases


def test_linear() -> None:
    bound = parse("b k+, n k+, n -> b n").bind([(8, 16), (32, 16), (32,)])
    assert bound.sizes == {"b": 8, "k": 16, "n": 32}
    assert bound.output_shapes == ((8, 32),)
    assert bound.kwarg_idents == frozenset()
    assert str(bound) == "b k+, n k+, n -> b n"


def test_matmul_with_stars() -> None:
    anno = parse("* a k+, * k+ n -> * a n")
    bound = anno.bind([(2, 3, 4, 5), (2, 3, 5, 6)])
    assert bound.output_shapes == ((2, 3, 4, 6),)
    assert bound.sizes == {"*0": 2, "*1": 3, "a": 4, "k": 5, "n": 6}
    assert str(bound.expanded) == "*0 *1 a k+, *0 *1 k+ n -> *0 *1 a n"
    assert bound.anno == anno
    assert anno.infer_shapes([(4, 5), (5, 6)]) == ((4, 6),)  # '*' may stand for no dims


def test_hidden_group_from_kwargs() -> None:
    bound = parse("b (h d) -> b h d").bind([(2, 32)], {"h": 4, "unrelated": 7})
    assert bound.sizes == {"b": 2, "h": 4, "d": 8}
    assert bound.output_shapes == ((2, 4, 8),)
    assert bound.kwarg_idents == frozenset({"h"})


def test_inference_by_division_to_a_fixpoint() -> None:
    # d comes from input 1; then h from the group of input 0; then e from input 2's group
    bound = parse("(h d), d, (h e) -> h e").bind([(12,), (3,), (20,)])
    assert bound.sizes == {"h": 4, "d": 3, "e": 5}
    assert bound.output_shapes == ((4, 5),)


def test_numbers_and_questions() -> None:
    anno = parse("?, a 4, ? -> a 2, ?")
    assert anno.infer_shapes([None, (3, 4), (5, 5)]) == ((3, 2), None)
    assert parse("-> 4 8").infer_shapes([]) == ((4, 8),)
    assert parse("a+ b+ -> 1").infer_shapes([(2, 3)]) == ((1,),)
    assert parse("1 -> 1").infer_shapes([()]) == ((1,),)  # a 0-d tensor is '1'


def test_kwargs_bools_are_not_sizes() -> None:
    bound = parse("(h d) -> d").bind([(6,)], {"h": 2, "d": True})
    assert bound.sizes == {"h": 2, "d": 3} and bound.kwarg_idents == frozenset({"h"})


def test_hand_built_annotation_is_checked() -> None:
    with pytest.raises(AnnotationError, match="appears in no input"):
        OpAnno((), (parse("a -> a").inputs[0],)).bind([])


# (annotation, input shapes, kwargs, parts of the reason, caret position)
ERRORS = [
    ("a k, k n -> a n", [(2, 64), (32, 3)], {},
     ["dimension 'k' is 64 in input 0 but 32 in input 1"], 5),
    ("a b, a -> a", [(2, 3)], {}, ["2 inputs", "1 were given"], None),
    ("a b -> a", [(1, 2, 3)], {}, ["input 0 has 3 dims", "'a b' has 2"], 0),
    ("* a b -> a", [(2,)], {}, ["input 0 has 1 dims", "at least 2"], 0),
    ("a, b -> a", [(2,), None], {}, ["input 1", "not a tensor", "'?'"], 3),
    ("a 4 -> a", [(2, 3)], {}, ["dim 1 of input 0 is annotated 4 but has size 3"], 2),
    ("*, * -> *", [(2, 3), (2, 4)], {}, ["[2, 3] in input 0", "[2, 4] in input 1"], 3),
    ("(h d) -> h d", [(12,)], {}, ["'h'", "pass h=... as a keyword argument"], 1),
    ("(h d) -> h d", [(12,)], {"h": 5}, ["cannot infer 'd'", "12", "(5)"], 0),
    ("(h d) -> h", [(12,)], {"h": 4, "d": 4}, ["(h d) is 4*4 = 16", "size 12"], 0),
    ("b (h d), h -> d", [(2, 12), (3,)], {"h": 4},
     ["dimension 'h' is 4 in keyword argument h=4 but 3 in input 1"], 9),
    ("(a a) -> a", [(9,)], {}, ["'a'", "pass a=..."], 1),
]


@pytest.mark.parametrize(("text", "shapes", "kwargs", "reasons", "position"), ERRORS)
def test_errors(text: str, shapes: list, kwargs: dict, reasons: list[str], position: int | None) -> None:
    with pytest.raises(AnnotationError) as info:
        parse(text).bind(shapes, kwargs)
    for reason in reasons:
        assert reason in info.value.reason
    assert (info.value.annotation, info.value.position) == (text, position)


@settings(max_examples=300, deadline=None)
@given(bound_cases())
def test_inferred_shapes(case: tuple) -> None:
    anno, shapes, sizes, kwargs, expected = case
    try:
        bound = anno.bind(shapes, kwargs)
    except AnnotationError as e:  # only a group with two unknown members may fail
        assert "as a keyword argument" in e.reason
        return
    assert list(bound.output_shapes) == expected
    assert bound.input_shapes == tuple(shapes)
    for name, size in bound.sizes.items():
        assert name.startswith("*") or size == sizes[name]
    assert bound.kwarg_idents == {n for n in kwargs if n in bound.sizes}


@settings(max_examples=100, deadline=None)
@given(bound_cases(groups=False))
def test_without_groups_binding_never_fails(case: tuple) -> None:
    anno, shapes, _, _, expected = case
    assert list(anno.infer_shapes(shapes)) == expected
