"""Value rules: a TransformRule with ValuePartial inputs and no Split one says the op is
linear in those inputs (value parts in, value parts out). Their transforms have
``dim=None``, any ``num >= 2``; check_promise cuts value-partial inputs into unequal
shares, so an op that is not linear cannot pass."""

from __future__ import annotations

import pytest
import torch

from nnscaler.anno import (
    AnnotationError,
    PromiseBrokenError,
    Replicate,
    Split,
    TransformRule,
    ValuePartial,
    check_promise,
    parse,
)
from nnscaler.anno.transform import VALUE_NUMS, split, transform_space

S, R, V = Split, Replicate(), ValuePartial()
SUM = TransformRule([V, V], [V])


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _modifier(kwargs: dict, idx: int, dim: int | None, num: int, part: int) -> dict:
    return {**kwargs, "part": part}


# -- the rule -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inputs", "outputs"),
    [([R], [S(0)]), ([R, None], [V]), ([None], [None]), ([], [])],
    ids=["replicate", "replicate-and-question", "question", "no-inputs"],
)
def test_a_rule_must_split_some_input(inputs, outputs) -> None:
    with pytest.raises(ValueError, match="a rule splits some input") as info:
        TransformRule(inputs, outputs)
    message = str(info.value)
    assert "Split(dim)" in message and "ValuePartial()" in message
    assert not isinstance(info.value, AnnotationError)


@pytest.mark.parametrize(
    ("inputs", "value"),
    [
        ([V, V], True),
        ([R, V], True),
        ([V, None], True),
        ([S(0)], False),
        ([S(0), V], False),  # a dim split whose other input is value-partial
        ([V, S(1)], False),
    ],
)
def test_is_value_rule(inputs, value) -> None:
    assert TransformRule(inputs, [V]).is_value_rule is value


# -- the transform space --------------------------------------------------------------------


def value_rows(space: list) -> list[tuple]:
    return [(t.idx, t.dim, t.num, t.ident, t.inputs, t.outputs) for t in space if t.dim is None]


def test_value_transforms_in_the_space() -> None:
    bound = parse("a b, a b -> a b").bind([(4, 6), (4, 6)])
    plain = bound.transform_space()
    assert all(t.dim is not None for t in plain)
    space = bound.transform_space(rules=[SUM])
    assert VALUE_NUMS == (2, 3, 4)
    assert value_rows(space) == [(0, None, n, "+", (V, V), (V,)) for n in (2, 3, 4)]
    # the dim splits of the annotation are still there, before the value splits
    assert space[: len(plain)] == plain and len(space) == len(plain) + 3
    # any num >= 2 is legal, divisor or not
    assert value_rows(bound.transform_space(5, rules=[SUM])) == [(0, None, 5, "+", (V, V), (V,))]
    assert value_rows(transform_space(bound, 7, rules=[SUM])) == [(0, None, 7, "+", (V, V), (V,))]
    assert bound.transform_space(1, rules=[SUM]) == []
    assert value_rows(bound.transform_space(0, rules=[SUM])) == []


def test_value_transform_idx_is_the_first_value_partial_input() -> None:
    bound = parse("a, a, ? -> a").bind([(4,), (4,), None])
    rule = TransformRule([R, V, None], [V])
    assert value_rows(bound.transform_space(2, rules=[rule])) == [
        (1, None, 2, "+", (R, V, None), (V,)),
    ]
    rule = TransformRule([V, V, None], [V])
    assert [t.idx for t in bound.transform_space(rules=[rule]) if t.dim is None] == [0, 0, 0]


def test_value_transform_carries_modifier_and_part_op() -> None:
    bound = parse("a, a -> a").bind([(4,), (4,)])
    rule = TransformRule([V, V], [V], modifier=_modifier, part_op="my.op")
    (t,) = [t for t in bound.transform_space(3, rules=[rule]) if t.dim is None]
    assert (t.modifier, t.part_op) == (_modifier, "my.op")
    assert t.part_kwargs({"x": 1}, 2) == {"x": 1, "part": 2}
    assert str(t) == "split the values of input 0 in 3: V, V -> V via my.op"
    assert split(bound, 0, None, 3, rules=[rule]) == t


def test_every_value_rule_is_listed() -> None:
    bound = parse("a, a -> a").bind([(4,), (4,)])
    rules = [TransformRule([V, V], [V]), TransformRule([R, V], [V])]
    assert [(t.idx, t.num, t.inputs) for t in bound.transform_space(2, rules=rules)
            if t.dim is None] == [(0, 2, (V, V)), (1, 2, (R, V))]


def test_value_rule_with_the_wrong_number_of_layouts() -> None:
    bound = parse("a, a -> a").bind([(4,), (4,)])
    with pytest.raises(AnnotationError, match="1 input and 1 output placements"):
        bound.transform_space(rules=[TransformRule([V], [V])])
    with pytest.raises(AnnotationError, match="1 input and 1 output placements"):
        bound.split(0, None, 2, rules=[TransformRule([V], [V])])


# -- split ----------------------------------------------------------------------------------


def test_split_values() -> None:
    bound = parse("a b, a b -> a b").bind([(4, 6), (4, 6)])
    t = bound.split(0, None, 2, rules=[SUM])
    assert (t.idx, t.dim, t.num, t.ident, t.inputs, t.outputs) == (0, None, 2, "+", (V, V), (V,))
    assert dict(t.kwarg_updates) == {} and t.modifier is None and t.part_op is None
    assert t in bound.transform_space(rules=[SUM])
    assert split(bound, 0, None, 2, rules=[SUM]) == t
    # any num >= 2, not only the listed ones
    assert bound.split(0, None, 7, rules=[SUM]).num == 7
    # input 1 is value-partial too: the same layouts
    other = bound.split(1, None, 2, rules=[SUM])
    assert (other.dim, other.num, other.inputs, other.outputs) == (None, 2, (V, V), (V,))


def test_str_of_a_value_transform() -> None:
    bound = parse("a b, a b -> a b").bind([(4, 6), (4, 6)])
    t = bound.split(0, None, 2, rules=[SUM])
    assert str(t).startswith("split the values of input 0 in 2: ")
    assert str(t) == "split the values of input 0 in 2: V, V -> V"
    rule = TransformRule([V, R], [V, None])
    bound = parse("a, a -> a, ?").bind([(4,), (4,)])
    assert str(bound.split(0, None, 4, rules=[rule])) == (
        "split the values of input 0 in 4: V, R -> V, ?"
    )


def test_split_values_without_a_value_rule_for_that_input() -> None:
    text = "a b, a b -> a b"
    bound = parse(text).bind([(4, 6), (4, 6)])
    rule = TransformRule([V, R], [V])
    with pytest.raises(AnnotationError) as info:
        bound.split(1, None, 2, rules=[rule])
    reason = info.value.reason
    assert reason.startswith(
        "cannot split the values of input 1 in 2: no value rule of the op takes input 1 "
        "value-partial\nlegal choices (idx, dim, num):\n"
    )
    assert "  idx=0, dim=0 ('a'): num in [2, 4]" in reason
    assert "  idx=0, dim=1 ('b'): num in [2, 3, 6]" in reason
    assert "  idx=0, dim=None (its values): any num >= 2" in reason
    assert reason.count("dim=None") == 1  # one line per rule, not per num
    assert reason.endswith("idx=0, dim=None (its values): any num >= 2")
    # no caret: a value split names no dim
    assert info.value.annotation == text and info.value.position is None
    assert str(info.value).splitlines()[-1] == f"    '{text}'"


@pytest.mark.parametrize(
    "rules", [[], [TransformRule([S(0), S(0)], [S(0)])]], ids=["no-rules", "dim-rule-only"]
)
def test_split_values_of_an_op_without_value_rules(rules) -> None:
    bound = parse("a b, a b -> a b").bind([(4, 6), (4, 6)])
    with pytest.raises(AnnotationError) as info:
        bound.split(0, None, 2, rules=rules)
    reason = info.value.reason
    assert "cannot split the values of input 0 in 2: no value rule of the op takes input 0 " \
           "value-partial" in reason
    assert "idx=0, dim=0 ('a'): num in [2, 4]" in reason
    assert "dim=None" not in reason


def test_split_values_in_fewer_than_two_parts() -> None:
    bound = parse("a b, a b -> a b").bind([(4, 6), (4, 6)])
    for num in (1, 0, -2):
        with pytest.raises(AnnotationError) as info:
            bound.split(0, None, num, rules=[SUM])
        reason = info.value.reason
        assert reason.startswith(f"cannot split the values of input 0 in {num}: num must be at "
                                 f"least 2\n")
        assert "idx=0, dim=None (its values): any num >= 2" in reason
        assert info.value.position is None


def test_split_values_of_an_input_out_of_range() -> None:
    bound = parse("a, a -> a").bind([(4,), (4,)])
    with pytest.raises(AnnotationError, match="no value rule of the op takes input 5"):
        bound.split(5, None, 2, rules=[SUM])


def test_an_op_with_only_a_value_split_lists_it() -> None:
    bound = parse("4, 4 -> 4").bind([(4,), (4,)])
    assert bound.transform_space() == []
    with pytest.raises(AnnotationError) as info:
        bound.split(0, 0, 2, rules=[SUM])
    reason = info.value.reason
    assert "cannot split input 0 dim 0 in 2: dim 0 of input 0 is the fixed size 4" in reason
    assert "legal choices (idx, dim, num):\n  idx=0, dim=None (its values): any num >= 2" in reason
    assert "no split is legal" not in reason
    assert info.value.position == 0
    assert str(info.value).splitlines()[-1] == "     ^"


# -- check_promise ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "kwargs"),
    [(torch.add, {}), (torch.sub, {}), (torch.add, {"alpha": 2.0}), (torch.sub, {"alpha": -3})],
    ids=["add", "sub", "add-alpha", "sub-alpha"],
)
def test_check_promise_accepts_linear_ops(fn, kwargs) -> None:
    checked = check_promise(fn, "a b, a b -> a b", [randn(4, 6), randn(4, 6, seed=1)], kwargs,
                            rules=[SUM])
    assert value_rows(checked) == [(0, None, n, "+", (V, V), (V,)) for n in (2, 3, 4)]
    # nums asks for any number of parts, divisors or not
    checked = check_promise(fn, "a b, a b -> a b", [randn(4, 6), randn(4, 6, seed=1)], kwargs,
                            rules=[SUM], nums=[5])
    assert value_rows(checked) == [(0, None, 5, "+", (V, V), (V,))]


@pytest.mark.parametrize(
    ("anno", "shapes"),
    [
        ("a b c, b c -> a b c", [(2, 3, 4), (3, 4)]),
        ("a b, 1 b -> a b", [(4, 6), (1, 6)]),
        ("a b, 1 -> a b", [(4, 6), (1,)]),
        ("a b, a 1 -> a b", [(4, 6), (4, 1)]),
    ],
)
def test_check_promise_accepts_broadcasting_add(anno, shapes) -> None:
    inputs = [randn(*s, seed=k) for k, s in enumerate(shapes)]
    checked = check_promise(torch.add, anno, inputs, rules=[SUM])
    assert [t.num for t in checked if t.dim is None] == [2, 3, 4]


def test_check_promise_accepts_a_value_rule_on_one_input() -> None:
    """``a * b`` is linear in ``a`` when ``b`` is replicated."""
    rule = TransformRule([R, V], [V])
    checked = check_promise(torch.mul, "a, a -> a", [randn(6), randn(6, seed=1)], rules=[rule])
    assert [(t.idx, t.num) for t in checked if t.dim is None] == [(1, 2), (1, 3), (1, 4)]
    rule = TransformRule([V, None], [V])
    check_promise(lambda x, s: x * s, "a, ? -> a", [randn(6), 3.0], rules=[rule])


@pytest.mark.parametrize(
    ("fn", "rule"),
    [
        (torch.mul, SUM),
        (lambda a, b: a + b + 1, SUM),
        (lambda a, b: a * b, TransformRule([V, R], [R])),  # linear, but the output is V
    ],
    ids=["mul", "affine", "output-not-value-partial"],
)
def test_check_promise_rejects_ops_that_are_not_linear(fn, rule) -> None:
    with pytest.raises(PromiseBrokenError) as info:
        check_promise(fn, "a b, a b -> a b", [randn(4, 6), randn(4, 6, seed=1)], rules=[rule])
    message = str(info.value)
    assert "breaks its promise under split the values of input 0 in 2" in message
    assert "output 0 differs from the whole result by up to" in message
    assert isinstance(info.value, AssertionError)


def test_check_promise_rejects_mul_under_a_value_rule_for_every_num() -> None:
    for num in (2, 3, 4, 5):
        with pytest.raises(PromiseBrokenError, match=f"values of input 0 in {num}"):
            check_promise(torch.mul, "a, a -> a", [randn(6), randn(6, seed=1)], rules=[SUM],
                          nums=[num])


def test_value_partial_inputs_are_cut_into_unequal_shares() -> None:
    seen: list[torch.Tensor] = []

    def op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(a.clone())
        return a + b

    a = torch.full((4,), 6.0, dtype=torch.float64)
    check_promise(op, "a, a -> a", [a, randn(4)], rules=[SUM], nums=[3])
    # the whole call, then the three parts of the value split (after the dim splits)
    shares = torch.stack(seen[-3:])
    torch.testing.assert_close(shares.sum(0), a)  # they sum to the input
    ratios = shares / a
    assert len({round(float(r), 6) for r in ratios.reshape(-1)}) > 3  # not multiples of it


# The shares of a value-partial input are not multiples of it, so an op that is only
# positively homogeneous (f(c x) = c f(x) for c > 0) does not pass for linear, and integer
# and complex inputs are cut the same way.
@pytest.mark.parametrize(
    ("fn", "anno", "inputs", "rule"),
    [
        (torch.relu, "a b -> a b", [randn(4, 6)], TransformRule([V], [V])),
        (torch.abs, "a b -> a b", [randn(4, 6)], TransformRule([V], [V])),
        (torch.maximum, "a b, a b -> a b", [randn(4, 6), randn(4, 6, seed=1)], SUM),
        (torch.mul, "a, a -> a", [torch.arange(1, 7), torch.arange(2, 8)], SUM),
        (torch.mul, "a, a -> a", [randn(6).to(torch.complex128),
                                  randn(6, seed=1).to(torch.complex128)], SUM),
    ],
    ids=["relu", "abs", "maximum", "int-mul", "complex-mul"],
)
def test_check_promise_rejects_homogeneous_and_non_float_non_linear_ops(fn, anno, inputs, rule):
    with pytest.raises(PromiseBrokenError):
        check_promise(fn, anno, inputs, rules=[rule])
