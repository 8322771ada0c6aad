"""Linear algebra: contraction marks, bias handling, aliases, einsum and grouped matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from nnscaler.anno import PromiseBrokenError, ValuePartial, check_promise
from nnscaler.ops.builtin import linalg
from nnscaler.ops.registry import OpRegistry
from nnscaler.ops.verify import verify_op

T = torch.Tensor


@pytest.fixture(scope="module")
def registry() -> OpRegistry:
    r = OpRegistry()
    linalg.register(r)
    return r


def anno(registry: OpRegistry, fn, *args, **kwargs) -> str:
    return str(registry.lookup(fn).annotation_for(args, kwargs))


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def idents(transforms) -> set[str]:
    return {t.ident for t in transforms}


def test_linear_bias_freezes_the_contraction(registry):
    x, w, b = randn(2, 3, 4), randn(6, 4), randn(6)
    op = registry.lookup(F.linear)
    assert anno(registry, F.linear, x, w) == "b0 b1 k+, n k+, ? -> b0 b1 n"
    assert anno(registry, F.linear, x, w, b) == "b0 b1 k^, n k^, n -> b0 b1 n"
    assert anno(registry, F.linear, randn(4), w, bias=randn(1)) == "k^, n k^, 1 -> n"
    no_bias = verify_op(op, (x, w))
    assert "k" in idents(no_bias)
    assert all(t.outputs == (ValuePartial(),) for t in no_bias if t.ident == "k")
    with_bias = verify_op(op, (x, w, b))
    assert idents(with_bias) == {"b0", "b1", "n", "k"}
    # the reduction dim splits only through linear's rule: the bias goes to part 0 alone
    row = [t for t in with_bias if t.ident == "k"]
    assert row and all(t.inputs[2] == ValuePartial() for t in row)
    assert all(t.outputs == (ValuePartial(),) for t in row)
    # the plain annotation cannot say it: the bias would be added once per part
    with pytest.raises(PromiseBrokenError):
        check_promise(F.linear, "b0 b1 k+, n k+, n -> b0 b1 n", (x, w, b))


def test_matmul_aliases_and_broadcast(registry):
    op = registry.lookup(torch.matmul)
    assert op.name == "torch.matmul"
    for f in (T.matmul, T.__matmul__, torch.linalg.matmul):
        assert registry.lookup(f) is op
    assert registry.lookup(torch.ger) is registry.lookup(torch.outer)
    assert anno(registry, torch.matmul, randn(4), randn(4)) == "k+, k+ -> 1"
    assert anno(registry, torch.matmul, randn(4), randn(2, 4, 3)) == "k+, b0 k+ n -> b0 n"
    assert anno(registry, torch.matmul, randn(2, 1, 5, 4), randn(3, 4, 6)) == (
        "b0 1 m k+, b1 k+ n -> b0 b1 m n"
    )
    verify_op(op, (randn(2, 1, 4, 6), randn(3, 6, 2)))
    # b.__rmatmul__(a) is a @ b
    rop = registry.lookup(T.__rmatmul__)
    a, b = randn(3, 4), randn(4, 2)
    assert torch.equal(rop.call((b, a), {}), a @ b)
    assert anno(registry, T.__rmatmul__, b, a) == "k+ n, m k+ -> m n"


def test_tracer_sees_registered_callables(registry):
    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x, w = randn(2, 4), randn(4, 3)
    with Record():
        x @ w
        x.matmul(w)
        torch.addmm(randn(3), x, w)
        F.linear(x, w.T)
        torch.einsum("ij,jk->ik", x, w)
    names = [registry.lookup(f).name for f in seen if registry.lookup(f) is not None]
    assert names.count("torch.matmul") == 2
    assert {"torch.addmm", "torch.nn.functional.linear", "torch.einsum"} <= set(names)


def test_addmm_input_term(registry):
    x, w = randn(4, 6), randn(6, 2)
    # beta * input + alpha * x @ w: splitting the contraction adds input once per part
    assert anno(registry, torch.addmm, randn(2), x, w) == "n, m k^, k^ n -> m n"
    assert anno(registry, torch.addmm, randn(4, 1), x, w, alpha=2) == "m 1, m k^, k^ n -> m n"
    # with beta=0 the input is ignored: the contraction is '+' again
    assert anno(registry, torch.addmm, randn(2), x, w, beta=0) == "n, m k+, k+ n -> m n"
    ts = verify_op(registry.lookup(torch.addmm), (randn(2), x, w), {"beta": 0, "alpha": 0.5})
    assert "k" in idents(ts)
    assert anno(registry, torch.addbmm, randn(4, 2), randn(3, 4, 6), randn(3, 6, 2)) == (
        "m n, b^ m k^, b^ k^ n -> m n"
    )
    verify_op(registry.lookup(T.baddbmm_), (randn(3, 4, 2), randn(3, 4, 6), randn(3, 6, 2)),
              {"beta": 0.5})


@pytest.mark.parametrize(
    ("equation", "shapes", "expected"),
    [
        ("ij,jk->ik", [(2, 3), (3, 4)], "?, i j+, j+ k -> i k"),
        ("ij,jk", [(2, 3), (3, 4)], "?, i j+, j+ k -> i k"),  # implicit output
        ("ii->i", [(3, 3)], "?, i^ i^ -> i^"),  # a diagonal
        ("ii", [(3, 3)], "?, i^ i^ -> 1"),  # a trace
        ("i,i->", [(3,), (3,)], "?, i+, i+ -> 1"),
        ("...ij,...jk->...ik", [(2, 1, 3, 4), (5, 4, 6)], "?, _e0 1 i j+, _e1 j+ k -> _e0 _e1 i k"),
        ("b...d,d->b", [(2, 3, 4), (4,)], "?, b _e0+ d+, d+ -> b"),
        ("ij,j->ij", [(2, 3), (1,)], "?, i j, 1 -> i j"),  # a broadcast label
    ],
)
def test_einsum_equation(registry, equation, shapes, expected):
    ops = [randn(*s) for s in shapes]
    assert anno(registry, torch.einsum, equation, *ops) == expected
    verify_op(registry.lookup(torch.einsum), (equation, *ops))


def test_einsum_other_forms(registry):
    a, b = randn(2, 3), randn(3, 4)
    # the sublist form: operands and their subscripts alternate
    assert anno(registry, torch.einsum, a, [0, 1], b, [1, 2], [0, 2]) == "A B+, ?, B+ C, ?, ? -> A C"
    verify_op(registry.lookup(torch.einsum), (a, [0, 1], b, [1, 2], [0, 2]))
    # operands in one list: taken whole
    assert anno(registry, torch.einsum, "ij,jk->ik", [a, b]) == "?, ? -> 2 4"


def test_tensordot(registry):
    a, b = randn(2, 3, 4), randn(4, 3, 5)
    assert anno(registry, torch.tensordot, a, b, dims=([1, 2], [1, 0])) == (
        "a0 c0+ c1+, c1+ c0+ b2 -> a0 b2"
    )
    verify_op(registry.lookup(torch.tensordot), (a, b), {"dims": ([1, -1], [1, 0])})


def test_grouped_mm(registry):
    op = registry.lookup(torch._grouped_mm)
    x = torch.randint(-3, 4, (8, 8)).float()
    w = torch.randint(-3, 4, (2, 12, 8)).float().transpose(-2, -1)  # (experts, k, n)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    # tokens and experts follow the offsets: '^'; k and n split in 16-byte blocks
    assert anno(registry, torch._grouped_mm, x, w, offs=offs) == (
        "s^ (k+ 4), e^ (k+ 4) (n 4), e^ -> s^ (n 4)"
    )
    ts = verify_op(op, (x, w), {"offs": offs})
    assert {(t.ident, t.num) for t in ts} == {("k", 2), ("n", 3)}
    # a batched matmul without offsets splits the groups too
    a, b = torch.randint(-3, 4, (2, 4, 8)).float(), torch.randint(-3, 4, (2, 8, 4)).float()
    assert "e" in idents(verify_op(op, (a, b)))
    assert anno(registry, torch._grouped_mm, x, w, offs, torch.zeros(2, 12)) == (
        "s^ (k^ 4^), e^ (k^ 4^) (n^ 4^), e^, ? -> s^ (n^ 4^)"
    )


@pytest.mark.parametrize(
    "fn, args",
    [
        (torch.addmm, lambda: (randn(6), randn(4, 8), randn(8, 6))),
        (torch.addmm, lambda: (randn(4, 6), randn(4, 8), randn(8, 6))),
        (torch.baddbmm, lambda: (randn(2, 4, 6), randn(2, 4, 8), randn(2, 8, 6))),
        (torch.addmv, lambda: (randn(4), randn(4, 8), randn(8))),
    ],
)
def test_add_products_split_the_contraction_with_input_on_one_part(registry, fn, args):
    """GPT-2's Conv1D is addmm(bias, x, w): its row split keeps the bias once."""
    done = verify_op(registry.lookup(fn), args())
    row = [t for t in done if t.ident == "k"]
    assert row and all(t.inputs[0] == ValuePartial() for t in row)
