"""check_promise: true annotations pass on every split, wrong ones are caught."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nnscaler.anno import PromiseBrokenError, Split, TransformRule, check_promise, parse


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def split_heads(x: torch.Tensor, *, h: int) -> torch.Tensor:
    b, s, hd = x.shape
    return x.view(b, s, h, hd // h).transpose(1, 2)


def test_matmul() -> None:
    checked = check_promise(torch.matmul, "a k+, k+ n -> a n", [randn(4, 6), randn(6, 3, seed=1)])
    assert {t.ident for t in checked} == {"a", "k", "n"} and len(checked) == 2 + 3 + 3 + 1


def test_batched_matmul_with_stars() -> None:
    inputs = [randn(2, 3, 4, 6), randn(2, 3, 6, 2, seed=1)]
    assert len(check_promise(torch.matmul, "* a k+, * k+ n -> * a n", inputs)) > 0


def test_linear() -> None:
    x, w, bias = randn(4, 6), randn(2, 6, seed=1), randn(2, seed=2)
    checked = check_promise(torch.nn.functional.linear, "b k+, n k+ -> b n", [x, w])
    assert {t.ident for t in checked} == {"b", "k", "n"}
    # with a bias, k cannot be '+': each part would add the replicated bias once more
    check_promise(torch.nn.functional.linear, "b k^, n k^, n -> b n", [x, w, bias])
    with pytest.raises(PromiseBrokenError, match="'k'"):
        check_promise(torch.nn.functional.linear, "b k+, n k+, n -> b n", [x, w, bias])


def test_elementwise_and_reductions() -> None:
    assert len(check_promise(torch.tanh, "* -> *", [randn(2, 3, 4)])) == 4
    assert len(check_promise(torch.tanh, "* -> *", [randn(())])) == 0
    check_promise(lambda x: x.sum(1), "a b+ -> a", [randn(4, 6)])
    check_promise(lambda x: x.sum(), "a+ b+ -> 1", [randn(4, 6)])  # a 0-d result is '1'
    check_promise(lambda x: x.argmax(1), "a b^ -> a", [randn(4, 6)])  # integers, exactly
    check_promise(lambda x: torch.max(x, 1), "a b^ -> a, a", [randn(4, 6)])


def test_hidden_dims_use_kwargs() -> None:
    checked = check_promise(split_heads, "b s (h d) -> b h s d", [randn(2, 3, 24)], {"h": 4})
    assert {(t.ident, t.num): dict(t.kwarg_updates) for t in checked if t.ident == "h"} == {
        ("h", 2): {"h": 2},
        ("h", 4): {"h": 1},
    }


def test_non_tensor_inputs_and_outputs() -> None:
    def op(x: torch.Tensor, scale: float, y: torch.Tensor) -> tuple[Any, ...]:
        return x * scale + y.sum(), x.shape[0], None

    checked = check_promise(op, "a, ?, ? -> a, ?, ?", [randn(4), 2.0, randn(3, seed=1)])
    assert [str(t) for t in checked] == [
        "split input 0 dim 0 ('a') in 2: S(0), ?, R -> S(0), ?, ?",
        "split input 0 dim 0 ('a') in 4: S(0), ?, R -> S(0), ?, ?",
    ]
    # one '?' output, a list: not unpacked
    check_promise(lambda x: [x.shape[0]], "a -> ?", [randn(4)])


def test_nums_limits_the_parts() -> None:
    checked = check_promise(torch.tanh, "a b -> a b", [randn(4, 6)], nums=[2])
    assert [(t.dim, t.num) for t in checked] == [(0, 2), (1, 2)]


def test_rules_and_modifiers() -> None:
    def add_positions(x: torch.Tensor, *, start: int = 0) -> torch.Tensor:
        return x + torch.arange(start, start + x.shape[0], dtype=x.dtype)

    def shift(kwargs: dict, idx: int, dim: int, num: int, part: int) -> dict:
        return {**kwargs, "start": kwargs["start"] + part * 6 // num}

    x, kwargs = [randn(6)], {"start": 10}
    assert check_promise(add_positions, "n^ -> n^", x, kwargs) == []
    rule = TransformRule([Split(0)], [Split(0)], shift)
    assert len(check_promise(add_positions, "n^ -> n^", x, kwargs, rules=[rule])) == 3
    with pytest.raises(PromiseBrokenError, match="S\\(0\\) -> S\\(0\\)"):
        check_promise(add_positions, "n^ -> n^", x, kwargs, rules=[TransformRule([Split(0)], [Split(0)])])


def test_part_kwargs_hook() -> None:
    def part_kwargs(t, kwargs, part):  # type: ignore[no-untyped-def]
        return {**t.part_kwargs(kwargs, part), "seen": (t.num, part)}

    calls = []

    def op(x: torch.Tensor, *, seen: Any = None) -> torch.Tensor:
        calls.append(seen)
        return x

    check_promise(op, "a -> a", [randn(2)], {}, part_kwargs=part_kwargs)
    assert calls == [None, (2, 0), (2, 1)]


def test_wrong_annotation_is_caught() -> None:
    with pytest.raises(PromiseBrokenError) as info:
        check_promise(torch.matmul, "a k, k n -> a n", [randn(4, 6), randn(6, 3, seed=1)])
    message = str(info.value)
    assert isinstance(info.value, AssertionError)
    assert "annotation 'a k, k n -> a n'" in message
    assert "split input 0 dim 1 ('k') in 2: S(1), S(0) -> R" in message
    assert "output 0" in message and "differs from the whole result by up to" in message
    assert "mark 'k' '+'" in message


def test_wrong_shapes_and_failures_are_caught() -> None:
    with pytest.raises(PromiseBrokenError, match="output 0 should have shape \\(4,\\)"):
        check_promise(lambda x: x.sum(0), "a b+ -> a", [randn(4, 6)])
    with pytest.raises(PromiseBrokenError, match="returned 1 values but .* has 2 outputs"):
        check_promise(lambda x: (x,), "a -> a, a", [randn(4)])
    with pytest.raises(PromiseBrokenError, match="failed on part 0"):
        check_promise(lambda x, h: x.view(4, 2), "(h d) -> h d", [randn(8)], {"h": 4})


def test_accepts_a_parsed_annotation() -> None:
    check_promise(torch.neg, parse("a -> a"), [randn(4)])


@st.composite
def einsums(draw: st.DrawFn) -> tuple[str, str, dict[str, int]]:
    """A random einsum and its true annotation: summed letters are '+', the rest plain."""
    letters = "abcd"
    inputs = [draw(st.lists(st.sampled_from(letters), min_size=1, max_size=3, unique=True))
              for _ in range(draw(st.integers(1, 2)))]
    used = sorted({c for ins in inputs for c in ins})
    output = draw(st.lists(st.sampled_from(used), max_size=len(used), unique=True).map(sorted))
    sizes = {c: draw(st.sampled_from([1, 2, 3, 4])) for c in used}
    mark = {c: "" if c in output else "+" for c in used}
    anno = ", ".join(" ".join(c + mark[c] for c in ins) for ins in inputs) + " -> "
    anno += " ".join(output) or "1"
    spec = ",".join("".join(ins) for ins in inputs) + "->" + "".join(output)
    return spec, anno, sizes


@settings(max_examples=60, deadline=None)
@given(einsums())
def test_einsum_promises(case: tuple[str, str, dict[str, int]]) -> None:
    spec, anno, sizes = case
    inputs = [randn(*(sizes[c] for c in ins), seed=i) for i, ins in enumerate(spec.split("->")[0].split(","))]
    checked = check_promise(lambda *xs: torch.einsum(spec, *xs), anno, inputs, rtol=1e-9, atol=1e-9)
    summed = [t for t in checked if f"{t.ident}+" in anno]
    # dropping the '+' of a summed letter breaks the promise as soon as it is split
    if summed:
        wrong = anno.replace(f"{summed[0].ident}+", summed[0].ident)
        with pytest.raises(PromiseBrokenError):
            check_promise(lambda *xs: torch.einsum(spec, *xs), wrong, inputs)
