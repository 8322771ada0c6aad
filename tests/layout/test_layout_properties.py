"""Properties of every plan, over random layouts on 1 to 8 simulated devices.

- forward: the plan turns the pieces of x in src into pieces of x in dst (every
  replica's parts sum to its chunk; without value parts, every piece is exact);
- adjoint: <execute(P, a), b> == <a, execute_adjoint(P, b)> on unrelated per-device
  tensors, which pins every adjoint step;
- gradients: the adjoint maps a gradient laid out in dst.dual() to the same gradient
  laid out in src.dual();
- the replicated-gradient convention (docs/internals/design.md) is the exact adjoint between two layout
  changes: replicated -> dual on the way in, dual -> replicated on the way out;
- every step's ``after`` layout describes the tensors the step leaves behind.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_strategies import dot, int_tensors, layout_pairs, random_pieces

from nnscaler.layout import (
    Layout,
    assemble,
    execute,
    execute_adjoint,
    materialize,
    piece,
    plan,
    run_step,
)


def assert_holds(per_device: dict[int, torch.Tensor], full: torch.Tensor, layout: Layout):
    assert set(per_device) == set(layout.devices)
    for r in range(layout.r):
        assert torch.equal(assemble(per_device, layout, replica=r), full), (layout, r)
    if layout.v == 1:
        for dev in layout.devices:
            assert torch.equal(per_device[dev], full[piece(layout, dev).slices]), (layout, dev)


SETTINGS = settings(max_examples=250, deadline=None)


@SETTINGS
@given(layout_pairs(), st.integers(0, 2**16))
def test_plan_moves_the_tensor(adapters, pair, seed):
    src, dst = pair
    p = plan(src, dst, adapters)
    full = int_tensors(src.shape, seed)
    parts = materialize(full, src, generator=torch.Generator().manual_seed(seed))
    out = execute(p, parts)
    assert_holds(out, full, dst)
    if src.v == 1:
        assert {d: t for d, t in out.items()} == out  # plain dict in dst order
        assert list(out) == list(dst.devices)


@SETTINGS
@given(layout_pairs(), st.integers(0, 2**16))
def test_every_step_leaves_its_after_layout(adapters, pair, seed):
    src, dst = pair
    p = plan(src, dst, adapters)
    full = int_tensors(src.shape, seed)
    state = materialize(full, src, generator=torch.Generator().manual_seed(seed))
    for step in p.steps:
        state = run_step(step, state)
        assert_holds(state, full, step.after)


@SETTINGS
@given(layout_pairs(), st.integers(0, 2**16))
def test_adjoint_is_the_transpose_of_the_plan(adapters, pair, seed):
    src, dst = pair
    p = plan(src, dst, adapters)
    a = random_pieces(src, seed)
    b = random_pieces(dst, seed + 1)
    assert dot(execute(p, a), b) == dot(a, execute_adjoint(p, b))


@SETTINGS
@given(layout_pairs(), st.integers(0, 2**16))
def test_adjoint_carries_gradients_between_dual_layouts(adapters, pair, seed):
    src, dst = pair
    p = plan(src, dst, adapters)
    grad = int_tensors(src.shape, seed)
    g = torch.Generator().manual_seed(seed)
    back = execute_adjoint(p, materialize(grad, dst.dual(), generator=g))
    for r in range(src.v):  # every replica of the gradient (one per value part of src)
        assert torch.equal(assemble(back, src.dual(), replica=r), grad)


@SETTINGS
@given(layout_pairs(), st.integers(0, 2**16))
def test_replicated_gradients_are_the_adjoint_between_conversions(adapters, pair, seed):
    src, dst = pair
    p = plan(src, dst, adapters)
    grad = int_tensors(src.shape, seed)
    to_exact = plan(dst.replicated(), dst.dual(), adapters)
    to_replicated = plan(src.dual(), src.replicated(), adapters)
    assert to_exact.cost == 0  # local: one replica keeps the gradient, the others zero
    g = execute(to_exact, materialize(grad, dst.replicated()))
    g = execute(to_replicated, execute_adjoint(p, g))
    expected = materialize(grad, src.replicated())
    assert set(g) == set(expected)
    assert all(torch.equal(g[d], expected[d]) for d in g)


@settings(max_examples=60, deadline=None)
@given(layout_pairs())
def test_no_plan_costs_more_than_the_general_fallback(adapters, pair):
    src, dst = pair
    fallback = plan(src, dst, {"move": adapters.get("move")})
    assert plan(src, dst, adapters).cost <= fallback.cost + 1e-9
