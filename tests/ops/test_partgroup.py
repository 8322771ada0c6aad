"""PartGroup in one process: run_parts joins the parts of a split in threads. Values are
the same on every part, and gradients follow the exact adjoint (all_reduce "sum": each
part's input gets the sum of every part's result gradient; all_gather: the sum over parts
of the gradients of its slot; "max": none)."""

from __future__ import annotations

import threading

import pytest
import torch

from nnscaler.ops.partgroup import (
    SINGLE,
    PartGroup,
    PartGroupError,
    ThreadPartGroup,
    run_parts,
)

SHAPE = (3, 4)
NPARTS = [1, 2, 3]


def _data(n: int, seed: int) -> list[torch.Tensor]:
    """Integer-valued float64 tensors: every sum is exact, whatever the order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-9, 10, SHAPE, generator=g).double() for _ in range(n)]


def _leaves(n: int, seed: int = 1) -> list[torch.Tensor]:
    return [x.requires_grad_(True) for x in _data(n, seed)]


def _run_with_deadline(fn, seconds: float = 20.0):
    """``fn()`` in a daemon thread: a hang fails the test instead of the whole run."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "run_parts hung"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


# -- all_reduce -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", NPARTS)
def test_all_reduce_sum_is_identical_on_every_part_with_exact_adjoint(n):
    xs = _leaves(n)
    groups: list[PartGroup] = [None] * n  # type: ignore[list-item]

    def call(p: int):
        def f(group: PartGroup) -> torch.Tensor:
            groups[p] = group
            return group.all_reduce(xs[p] * 1.0, "sum")

        return f

    results = run_parts([call(p) for p in range(n)])
    assert [g.index for g in groups] == list(range(n))
    assert all(g.size == n for g in groups)
    if n > 1:
        assert all(isinstance(g, ThreadPartGroup) for g in groups)
    total = sum(x.detach() for x in xs)
    for r in results:
        assert torch.equal(r.detach(), total)
        assert r.requires_grad
    # each part's x gets the sum of every part's result gradient
    gs = _data(n, 2)
    loss = sum((g * r).sum() for g, r in zip(gs, results, strict=True))
    loss.backward()
    for x in xs:
        assert torch.equal(x.grad, sum(gs))


@pytest.mark.parametrize("n", NPARTS)
def test_all_reduce_sum_with_scalar_weights(n):
    """loss = sum_p c_p * result_p.sum(): every x_p.grad is sum_q c_q everywhere."""
    xs = _leaves(n)
    cs = [0.5, 2.0, -3.0][:n]
    results = run_parts([lambda g, p=p: g.all_reduce(xs[p]) for p in range(n)])
    sum(c * r.sum() for c, r in zip(cs, results, strict=True)).backward()
    for x in xs:
        assert torch.equal(x.grad, torch.full(SHAPE, sum(cs), dtype=torch.float64))


@pytest.mark.parametrize("n", NPARTS)
def test_all_reduce_max_values_and_no_gradient(n):
    xs = _leaves(n)
    results = run_parts([lambda g, p=p: g.all_reduce(xs[p], "max") for p in range(n)])
    want = torch.stack([x.detach() for x in xs]).amax(0)
    for r in results:
        assert torch.equal(r, want)
        assert not r.requires_grad
    # max is not differentiable here: a loss through it gives the inputs no gradient
    results = run_parts([lambda g, p=p: g.all_reduce(xs[p], "max") + xs[p] for p in range(n)])
    sum(r.sum() for r in results).backward()
    for x in xs:
        assert torch.equal(x.grad, torch.ones(SHAPE, dtype=torch.float64))


# -- all_gather -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", NPARTS)
def test_all_gather_in_part_order_with_exact_adjoint(n):
    xs = _leaves(n)
    results = run_parts([lambda g, p=p: g.all_gather(xs[p]) for p in range(n)])
    want = torch.stack([x.detach() for x in xs])
    for r in results:
        assert r.shape == (n, *SHAPE)
        assert torch.equal(r.detach(), want)
    # each part's x gets the sum over parts of the gradients of its slot
    ups = [torch.stack(_data(n, 10 + p)) for p in range(n)]  # [n, *SHAPE] per part
    sum((u * r).sum() for u, r in zip(ups, results, strict=True)).backward()
    for q, x in enumerate(xs):
        assert torch.equal(x.grad, sum(u[q] for u in ups))


def test_all_gather_of_scalars():
    xs = [torch.tensor(float(v), requires_grad=True) for v in (3, -1, 7)]
    results = run_parts([lambda g, p=p: g.all_gather(xs[p]) for p in range(3)])
    for r in results:
        assert torch.equal(r.detach(), torch.tensor([3.0, -1.0, 7.0]))
    (results[0][2] * 5 + results[2][2] * 2 + results[1][0]).backward()
    assert [x.grad.item() for x in xs] == [1.0, 0.0, 7.0]


def test_collectives_in_sequence_stay_in_order():
    """Several collectives in a row: each pairs the parts' calls in the same order."""
    xs = _leaves(3)

    def f(p: int):
        def call(g: PartGroup) -> list[torch.Tensor]:
            a = g.all_reduce(xs[p])
            b = g.all_gather(xs[p] * (p + 1))
            c = g.all_reduce(xs[p], "max")
            d = g.all_reduce(a * (p + 1))
            return [a, b, c, d]

        return call

    for _ in range(5):
        results = run_parts([f(p) for p in range(3)])
        total = sum(x.detach() for x in xs)
        for a, b, c, d in results:
            assert torch.equal(a.detach(), total)
            assert torch.equal(b.detach(), torch.stack([x.detach() * (q + 1)
                                                        for q, x in enumerate(xs)]))
            assert torch.equal(c, torch.stack([x.detach() for x in xs]).amax(0))
            assert torch.equal(d.detach(), total * 6)


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["all_reduce", "all_gather"])
def test_shape_mismatch_is_a_part_group_error(what):
    xs = [torch.zeros(2, 3), torch.zeros(3, 2)]

    def call(p: int):
        return lambda g: getattr(g, what)(xs[p])

    with pytest.raises(PartGroupError, match=rf"{what}.*shapes \[\(2, 3\), \(3, 2\)\].*agree"):
        _run_with_deadline(lambda: run_parts([call(0), call(1)]))


def test_bad_reduce_op_is_a_part_group_error():
    x = torch.zeros(2)
    with pytest.raises(PartGroupError, match=r"op must be one of \('sum', 'max'\), got 'mean'"):
        _run_with_deadline(lambda: run_parts([lambda g: g.all_reduce(x, "mean")] * 2))
    # only one part misuses it: its error is the one raised, the other part is released
    with pytest.raises(PartGroupError, match=r"got 'min'"):
        _run_with_deadline(lambda: run_parts([lambda g: g.all_reduce(x, "sum"),
                                              lambda g: g.all_reduce(x, "min")]))
    with pytest.raises(PartGroupError, match=r"got 'prod'"):
        SINGLE.all_reduce(x, "prod")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("failing", [0, -1])
def test_a_failing_part_raises_its_own_error_without_hanging(n, failing):
    failing %= n

    def call(p: int):
        def f(g: PartGroup) -> torch.Tensor:
            if p == failing:
                raise ValueError(f"part {p} is broken")
            y = g.all_reduce(torch.ones(2))  # waits for the failed part: must be released
            return g.all_gather(y)

        return f

    with pytest.raises(ValueError, match=f"part {failing} is broken"):
        _run_with_deadline(lambda: run_parts([call(p) for p in range(n)]))


def test_a_part_failing_after_a_collective():
    def call(p: int):
        def f(g: PartGroup) -> torch.Tensor:
            y = g.all_reduce(torch.ones(2))
            if p == 1:
                raise KeyError("late")
            return g.all_reduce(y)

        return f

    with pytest.raises(KeyError, match="late"):
        _run_with_deadline(lambda: run_parts([call(p) for p in range(3)]))


def test_a_single_part_raises_directly():
    def f(g: PartGroup) -> None:
        assert g is SINGLE
        raise ValueError("alone")

    with pytest.raises(ValueError, match="alone"):
        run_parts([f])


# -- grad mode ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", NPARTS)
def test_grad_mode_of_the_caller_is_used_in_the_parts(n):
    xs = _leaves(n)

    def call(p: int):
        def f(g: PartGroup) -> tuple[bool, torch.Tensor]:
            return torch.is_grad_enabled(), g.all_reduce(xs[p] * 2)

        return f

    with torch.no_grad():
        results = run_parts([call(p) for p in range(n)])
    assert all(not enabled and not r.requires_grad for enabled, r in results)
    results = run_parts([call(p) for p in range(n)])
    assert all(enabled and r.requires_grad for enabled, r in results)
    # the caller's mode is restored afterwards, even inside no_grad
    with torch.no_grad():
        run_parts([call(p) for p in range(n)])
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


# -- SINGLE ---------------------------------------------------------------------------------


def test_single_is_a_group_of_one():
    assert SINGLE.size == 1 and SINGLE.index == 0
    assert isinstance(SINGLE, PartGroup)
    assert "size=1" in repr(SINGLE)
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    s = SINGLE.all_reduce(x)
    m = SINGLE.all_reduce(x, "max")
    a = SINGLE.all_gather(x)
    assert torch.equal(s.detach(), x.detach()) and s.requires_grad
    assert torch.equal(m, x.detach()) and not m.requires_grad
    assert a.shape == (1, 3) and torch.equal(a[0].detach(), x.detach())
    (2 * s.sum() + 3 * m.sum() + (a * torch.tensor([[1.0, 2.0, 3.0]])).sum()).backward()
    assert torch.equal(x.grad, torch.tensor([3.0, 4.0, 5.0]))
    # run_parts with one part hands it SINGLE and runs it in the caller's thread
    seen = run_parts([lambda g: (g, threading.current_thread())])
    assert seen == [(SINGLE, threading.current_thread())]
