"""The annotation grammar: valid and invalid annotations side by side, and round trips."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnscaler.anno import (
    STAR,
    AnnotationError,
    DimAnno,
    Ident,
    OpAnno,
    Reduce,
    Star,
    TensorAnno,
    parse,
)

from .strategies import op_annos, texts_of

# (annotation, canonical form)
VALID = [
    ("a k+, n k+ -> a n", "a k+, n k+ -> a n"),
    ("a  b,c->a", "a b, c -> a"),
    ("  a\tb ->  b  ", "a b -> b"),
    ("-> 4 8", "-> 4 8"),
    ("->4", "-> 4"),
    ("?, a -> a", "?, a -> a"),
    ("? -> ?", "? -> ?"),
    ("a -> ", "a -> ?"),  # nnScaler's op without outputs: it returns None
    ("a -> a, a, ?", "a -> a, a, ?"),
    ("b (h d^) -> b h d^", "b (h d^) -> b h d^"),
    ("b ( h  d ) -> b h d", "b (h d) -> b h d"),
    ("b (h 4) -> b h 4", "b (h 4) -> b h 4"),
    ("* h -> * h", "* h -> * h"),
    ("*, h * -> *", "*, h * -> *"),
    ("a 4^, 4 -> a 4", "a 4^, 4 -> a 4"),  # numbers may carry different marks
    ("a b+ -> 1", "a b+ -> 1"),
    ("x_1 long_name -> long_name x_1", "x_1 long_name -> long_name x_1"),
    ("a a -> a", "a a -> a"),
]

# (annotation, caret position or None, part of the reason)
INVALID = [
    ("a b", None, "needs '->'"),
    ("a -> b -> c", 7, "exactly one '->'"),
    ("a -> a, a -> a", 10, "exactly one '->'"),
    ("(a b -> a", 0, "never closed"),
    ("a (b c, d -> a", 2, "never closed"),
    ("a b) -> a", 3, "no matching '('"),
    ("((a b) c) -> a", 1, "cannot nest"),
    ("(a (b c)) -> a", 3, "cannot nest"),
    ("() -> a", 0, "empty group"),
    ("b (a) -> a", 2, "two or more identifiers"),
    ("a % -> a", 2, "unexpected character '%'"),
    ("a.b -> a", 1, "unexpected character '.'"),
    ("a - b", 2, "'->'"),
    ("4a -> 4", 0, "neither an identifier nor a number"),
    ("a,,b -> a", 2, "empty tensor entry"),
    ("a, -> a", 3, "empty tensor entry"),
    (", a -> a", 0, "empty tensor entry"),
    ("a -> a,", 7, "empty tensor entry"),
    ("a -> b", 5, "output identifier 'b' appears in no input"),
    ("a, b -> a (b c)", 13, "output identifier 'c'"),
    ("a+, a^ -> a", 4, "one mark"),
    ("a, a+ -> a", 3, "one mark"),
    ("a k+, n k -> a n", 8, "one mark"),
    ("a k+, n k+ -> a k", 16, "one mark"),
    ("4+ -> 4", 1, "cannot be marked '+'"),
    ("a (h 4+) -> a", 6, "cannot be marked '+'"),
    ("a -> *", 5, "no input has one"),
    ("* a * -> a", 4, "at most one '*'"),
    ("? a -> a", 0, "cannot be mixed with dims"),
    ("a ? -> a", 2, "cannot be mixed with dims"),
    ("*+ -> *", 1, "'*' takes no mark"),
    ("?^ -> a", 1, "'?' takes no mark"),
    ("a + -> a", 2, "must directly follow an identifier"),
    ("+a -> a", 0, "must directly follow an identifier"),
    ("(a b)+ -> a", 5, "inside the group"),
    ("(a *) -> a", 3, "cannot be inside a group"),
    ("a(b c) -> a", 1, "separated by a space"),
    ("a+b -> a", 2, "separated by a space"),
]


@pytest.mark.parametrize(("text", "canonical"), VALID)
def test_valid(text: str, canonical: str) -> None:
    anno = parse(text)
    assert str(anno) == canonical
    assert parse(canonical) == anno
    assert parse(str(anno)) == anno


@pytest.mark.parametrize(("text", "position", "reason"), INVALID)
def test_invalid(text: str, position: int | None, reason: str) -> None:
    with pytest.raises(AnnotationError) as info:
        parse(text)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.annotation, err.position) == (text, position)
    assert reason in err.reason
    lines = str(err).splitlines()
    assert lines[0] == err.reason.splitlines()[0]
    assert text in lines[1]
    if position is None:
        assert "^" not in lines[-1]
    else:  # the caret sits under the offending character
        caret = lines[2].index("^")
        assert lines[1][caret] == (text[position] if position < len(text) else "'")


def test_values() -> None:
    anno = parse("a k+, (h d^) * -> a k+, ?")
    a, k = Ident("a", Reduce.SPATIAL), Ident("k", Reduce.SUM)
    group = DimAnno((Ident("h"), Ident("d", Reduce.FROZEN)))
    assert anno == OpAnno(
        (TensorAnno((DimAnno((a,)), DimAnno((k,)))), TensorAnno((group, STAR))),
        (TensorAnno((DimAnno((a,)), DimAnno((k,)))), TensorAnno(None)),
    )
    assert str(group) == "(h d^)" and str(k) == "k+" and str(STAR) == "*"
    assert Star() == STAR and not anno.outputs[1].is_tensor and anno.inputs[1].has_star
    assert Ident("4").is_number and not Ident("x4").is_number
    assert [str(x) for x in anno.inputs[1].idents] == ["h", "d^"]


def test_equality_ignores_positions_and_parse_is_cached() -> None:
    assert parse("a  b -> a") == parse("a b -> a")
    assert hash(parse("a  b -> a")) == hash(parse("a b -> a"))
    assert parse("a b -> a") is parse("a b -> a")
    assert parse("a b -> a").source == "a b -> a"


@pytest.mark.parametrize(
    "build",
    [
        lambda: Ident("a b"),
        lambda: Ident("a", "+"),
        lambda: DimAnno(()),
        lambda: OpAnno((), ()),
    ],
)
def test_constructors_validate(build) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises((ValueError, TypeError)):
        build()


def test_not_a_string() -> None:
    with pytest.raises(TypeError, match="a string"):
        parse(42)  # type: ignore[arg-type]


def test_error_pickles() -> None:
    with pytest.raises(AnnotationError) as info:
        parse("a -> b")
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.reason, again.annotation, again.position) == ("output identifier 'b' appears in no input (outputs may use input identifiers and numbers)", "a -> b", 5)
    assert str(again) == str(info.value)


@settings(max_examples=200, deadline=None)
@given(op_annos())
def test_objects_round_trip(anno: OpAnno) -> None:
    assert parse(str(anno)) == anno
    assert str(parse(str(anno))) == str(anno)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_texts_round_trip(data: st.DataObject) -> None:
    anno = data.draw(op_annos())
    text = data.draw(texts_of(anno))
    assert parse(text) == anno
    assert parse(str(parse(text))) == parse(text)
