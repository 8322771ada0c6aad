"""execute_plan on real gloo processes against the layout simulator: forward equals
nnscaler.layout.execute, backward (torch.autograd on every rank) equals execute_adjoint,
or, with grad="replicated", the replicated-gradient composition."""

from __future__ import annotations

import random

import pytest
import torch
from dist_utils import run_distributed

from nnscaler.layout import Layout, execute, execute_adjoint, materialize, plan

SHAPE = (4, 8)

FIXED = {
    2: [
        ("R(1)V(2)D(1,1)", "R(2)V(1)D(1,1)"),  # V->R
        ("R(1)V(2)D(1,1)", "R(1)V(1)D(1,2)@[1,0]"),  # V->D
        ("R(1)V(1)D(2,1)", "R(2)V(1)D(1,1)"),  # D->R
        ("R(2)V(1)D(1,1)", "R(1)V(1)D(1,2)@[1,0]"),  # R->D
        ("R(1)V(1)D(2,1)", "R(1)V(1)D(1,2)"),  # D(0)->D(1)
        ("R(1)V(1)D(1,1)@[0]", "R(1)V(1)D(1,1)@[1]"),  # p2p
    ],
    4: [
        ("R(1)V(4)D(1,1)", "R(4)V(1)D(1,1)"),
        ("R(1)V(4)D(1,1)", "R(1)V(1)D(1,4)@[3,1,0,2]"),
        ("R(1)V(1)D(4,1)", "R(4)V(1)D(1,1)"),
        ("R(2)V(1)D(2,1)", "R(2)V(1)D(1,2)"),
        ("R(4)V(1)D(1,1)", "R(1)V(1)D(2,2)@[2,3,0,1]"),
        ("R(1)V(2)D(2,1)", "R(2)V(1)D(1,2)"),
        ("R(1)V(2)D(1,1)@[0,1]", "R(2)V(1)D(1,1)@[2,3]"),  # pipeline boundary
        ("R(1)V(1)D(1,2)@[0,1]", "R(1)V(1)D(2,1)@[3,2]"),
        ("R(1)V(1)D(1,1)@[0]", "R(3)V(1)D(1,1)@[1,2,3]"),  # broadcast (reduce backward)
        ("R(1)V(4)D(1,1)", "R(1)V(1)D(1,1)@[3]"),
    ],
}


def _random_layout(rng: random.Random, world: int) -> str:
    n = rng.choice([k for k in (1, 2, 4) if k <= world])
    counts = [1, 1, 1, 1]  # r, v, d0, d1
    left = n
    while left > 1:
        counts[rng.randrange(4)] *= 2
        left //= 2
    devices = rng.sample(range(world), n)
    r, v, d0, d1 = counts
    return f"R({r})V({v})D({d0},{d1})@[{','.join(map(str, devices))}]"


def _cases(world: int, seed: int, n: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return FIXED[world] + [
        (_random_layout(rng, world), _random_layout(rng, world)) for _ in range(n)
    ]


def _ints(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-9, 10, shape, generator=gen).double()


def _run_cases(rank: int, world: int, cases: list[tuple[str, str]], grad: str) -> int:
    from nnscaler import runtime as rt

    done = 0
    for i, (a, b) in enumerate(cases):
        src, dst = Layout.parse(a, shape=SHAPE), Layout.parse(b, shape=SHAPE)
        p = plan(src, dst)
        gen = torch.Generator().manual_seed(i)
        pieces = materialize(_ints(SHAPE, gen), src, generator=gen)
        want = execute(p, pieces)
        if grad == "exact":
            ups = {d: _ints(dst.piece_shape, gen) for d in dst.devices}
            want_back = execute_adjoint(p, ups)
        else:
            ups = materialize(_ints(SHAPE, gen), dst.replicated())
            exact = execute(plan(dst.replicated(), dst.dual()), ups)
            want_back = execute(plan(src.dual(), src.replicated()), execute_adjoint(p, exact))

        rt.ensure_groups(rt.plan_groups(p, grad=grad))  # every rank, same list
        x = pieces[rank].clone().requires_grad_(True) if rank in src.devices else None
        y = rt.execute_plan(p, x, grad=grad, dtype=torch.float64)
        where = f"case {i} {a} -> {b} ({grad}) on rank {rank}\n{p}"
        if y is None:
            assert rank not in src.devices and rank not in dst.devices, where
            continue
        gy = ups[rank] if rank in dst.devices else torch.empty(0, dtype=torch.float64)
        if rank in dst.devices:
            assert torch.equal(y, want[rank]), f"forward differs: {where}"
        else:
            assert y.numel() == 0, where
        if x is not None:
            (dx,) = torch.autograd.grad(y, x, gy)
            assert torch.equal(dx, want_back[rank]), (
                f"backward differs: {where}\n{dx}\n{want_back[rank]}"
            )
        else:
            torch.autograd.backward(y, gy)
        done += 1
    return done


@pytest.mark.parametrize("world", [2, 4])
def test_execute_plan_matches_simulator_exact(world):
    cases = _cases(world, seed=world, n=6)
    done = run_distributed(_run_cases, world, cases, "exact")
    assert sum(done) >= len(cases)


@pytest.mark.parametrize("world", [2, 4])
def test_execute_plan_replicated_convention(world):
    cases = _cases(world, seed=10 + world, n=3)
    done = run_distributed(_run_cases, world, cases, "replicated")
    assert sum(done) >= len(cases)


def test_plan_groups_lists_collective_groups_only():
    from nnscaler import runtime as rt

    src = Layout.parse("R(2)V(1)D(2,1)@[0,1,2,3]", shape=SHAPE)
    dst = Layout.parse("R(2)V(1)D(1,2)@[0,1,2,3]", shape=SHAPE)
    assert rt.plan_groups(plan(src, dst)) == [(0, 1), (2, 3)]
    p2p = plan(Layout(shape=SHAPE, devices=(0,)), Layout(shape=SHAPE, devices=(1,)))
    assert rt.plan_groups(p2p) == []
