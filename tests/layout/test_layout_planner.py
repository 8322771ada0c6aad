"""The planner picks the cheap decomposition for each basic transition, honours device
orders, uses primitives that plugins add, and explains what it cannot do."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from layout_strategies import layout_pairs

import nnscaler
from nnscaler.layout import Layout, LayoutError, execute, materialize, plan, primitives
from nnscaler.layout.primitives import ReduceScatter
from nnscaler.plugins import NNScalerPluginManager


def L(text: str, shape=(8, 12)) -> Layout:
    return Layout.parse(text, shape=shape)


def check(p, full):
    """The plan turns the pieces of ``full`` in p.src into pieces of it in p.dst."""
    from nnscaler.layout import assemble

    out = execute(p, materialize(full, p.src, generator=torch.Generator().manual_seed(1)))
    for r in range(p.dst.r):
        assert torch.equal(assemble(out, p.dst, replica=r), full)


X = torch.arange(96, dtype=torch.float64).reshape(8, 12)


@pytest.mark.parametrize(
    "src, dst, names",
    [
        ("R(1)V(4)D(1,1)", "R(1)V(1)D(1,4)", ("reduce_scatter",)),
        ("R(1)V(4)D(1,1)", "R(4)V(1)D(1,1)", ("all_reduce",)),
        ("R(1)V(1)D(4,1)", "R(4)V(1)D(1,1)", ("all_gather",)),
        ("R(1)V(1)D(4,1)", "R(1)V(1)D(1,4)", ("all_to_all",)),
        ("R(4)V(1)D(1,1)", "R(1)V(1)D(1,4)", ("chunk",)),
        ("R(4)V(1)D(1,1)", "R(1)V(4)D(1,1)", ("value_split",)),
        ("R(2)V(2)D(1,1)", "R(2)V(1)D(2,1)", ("reduce_scatter",)),
        ("R(2)V(1)D(2,1)", "R(2)V(1)D(2,1)", ()),
        ("R(2)V(1)D(2,1)@[0,1,2,3]", "R(2)V(1)D(2,1)@[2,1,0,3]", ()),  # replicas swapped
    ],
)
def test_basic_transitions_use_their_primitive(adapters, src, dst, names):
    p = plan(L(src), L(dst), adapters)
    assert p.names == names, str(p)
    check(p, X)


def test_reduce_scatter_beats_all_reduce_then_chunk(adapters):
    p = plan(L("R(1)V(4)D(1,1)"), L("R(1)V(1)D(4,1)"), adapters)
    assert p.names == ("reduce_scatter",)
    assert p.cost == 3 / 4 * 96  # all-reduce alone would move 2 * 3/4 * 96
    assert p.cost_bytes(4) == 4 * p.cost


def test_chunk_follows_the_consumer_device_order(adapters):
    p = plan(L("R(4)V(1)D(1,1)@[0,1,2,3]"), L("R(1)V(1)D(4,1)@[3,1,0,2]"), adapters)
    assert p.names == ("chunk",) and p.cost == 0
    assert [g.src for g in p.steps[0].groups] == [(3, 1, 0, 2)]
    check(p, X)


def test_reduce_scatter_follows_the_consumer_device_order(adapters):
    p = plan(L("R(1)V(2)D(1,1)@[0,1]"), L("R(1)V(1)D(1,2)@[1,0]"), adapters)
    assert p.names == ("reduce_scatter",)
    check(p, X)


def test_two_step_decompositions(adapters):
    # V over 4 devices to a 2x2 split: one reduce-scatter per dim.
    p = plan(L("R(1)V(4)D(1,1)"), L("R(1)V(1)D(2,2)"), adapters)
    assert p.names == ("reduce_scatter", "reduce_scatter"), str(p)
    assert p.cost == 3 / 4 * 96
    check(p, X)
    # split on dim 0 to replicated over 2 and split on dim 1 over 2.
    p = plan(L("R(1)V(1)D(4,1)"), L("R(2)V(1)D(1,2)"), adapters)
    assert set(p.names) <= {"all_gather", "all_to_all", "chunk"} and "move" not in p.names
    check(p, X)


def test_different_device_sets_use_point_to_point(adapters):
    p = plan(L("R(1)V(1)D(2,1)@[0,1]"), L("R(1)V(1)D(2,1)@[2,3]"), adapters)
    assert p.names == ("move",)
    assert p.cost == 48  # each device sends or receives one piece
    check(p, X)
    # Reduce before sending: device 4 receives one tensor, not four parts of it.
    p = plan(L("R(1)V(4)D(1,1)@[0,1,2,3]"), L("R(1)V(1)D(1,1)@[4]"), adapters)
    assert p.names == ("reduce_scatter", "move")
    assert p.cost == 3 / 4 * 96 + 96
    check(p, X)


def test_fan_out_uses_broadcast(adapters):
    p = plan(L("R(1)V(1)D(1,1)@[0]"), L("R(4)V(1)D(1,1)@[1,2,3,4]"), adapters)
    assert p.names == ("broadcast",) and p.cost == 96
    check(p, X)


@attrs.frozen(kw_only=True)
class FastReduceScatter(ReduceScatter):
    name: str = "fast_reduce_scatter"

    def cost(self, group, numel, **params):
        return super().cost(group, numel, **params) / 2


class FastPlugin:
    @nnscaler.hookimpl
    def nnscaler_register_adapters(self, registry):
        registry.register("fast_reduce_scatter", FastReduceScatter())


def test_a_plugin_primitive_with_a_lower_cost_is_used():
    pm = NNScalerPluginManager(autoload=False, plugins=[primitives, FastPlugin()])
    src, dst = L("R(1)V(4)D(1,1)"), L("R(1)V(1)D(1,4)")
    p = plan(src, dst, pm.adapters)
    assert p.names == ("fast_reduce_scatter",)
    assert p.steps[0].adjoint.name == "all_gather"
    check(p, X)
    without = NNScalerPluginManager(autoload=False, plugins=[primitives]).adapters
    assert plan(src, dst, without).names == ("reduce_scatter",)


def test_only_registered_primitives_are_used(adapters):
    only_move = {"move": adapters.get("move")}
    p = plan(L("R(1)V(4)D(1,1)"), L("R(1)V(1)D(1,4)"), only_move)
    assert p.names == ("move",)  # the general fallback
    check(p, X)
    no_rs = {n: adapters.get(n) for n in adapters if n not in ("reduce_scatter", "move")}
    no_rs["reduce_scatter"] = attrs.evolve(adapters.get("reduce_scatter"), transition=None)
    p = plan(L("R(1)V(4)D(1,1)"), L("R(1)V(1)D(1,4)"), no_rs)
    assert p.names == ("all_reduce", "chunk")
    check(p, X)


def test_plans_are_cached_and_pure(adapters):
    a, b = L("R(1)V(1)D(4,1)"), L("R(4)V(1)D(1,1)")
    assert plan(a, b, adapters) is plan(a, b, adapters)


def test_adjoint_plan_runs_backwards(adapters):
    p = plan(L("R(1)V(1)D(4,1)"), L("R(4)V(1)D(1,1)"), adapters)
    back = p.adjoint()
    assert back.names == ("reduce_scatter",)
    assert back.src == p.dst.dual() and back.dst == p.src.dual()
    assert back.adjoint() == p


def test_str_lists_the_steps(adapters):
    p = plan(L("R(1)V(4)D(1,1)"), L("R(1)V(1)D(2,2)"), adapters)
    text = str(p)
    assert text.splitlines()[0].startswith("plan R(1)V(4)D(1,1)@[0,1,2,3] -> R(1)V(1)D(2,2)")
    assert "1. reduce_scatter(dim=" in text


def test_mismatched_shapes_are_refused(adapters):
    with pytest.raises(LayoutError, match=r"different shapes.*keeps the full shape"):
        plan(L("R(2)V(1)D(1,1)"), L("R(2)V(1)D(1,1)", shape=(8, 6)), adapters)
    with pytest.raises(LayoutError, match="src must be a Layout, got str"):
        plan("R(2)V(1)D(1,1)", L("R(2)V(1)D(1,1)"), adapters)


def test_missing_primitives_are_explained(adapters):
    assert plan(L("R(2)V(1)D(1,1)@[0,1]"), L("R(2)V(1)D(1,1)@[1,0]"), {}).steps == ()
    with pytest.raises(LayoutError, match="no communication primitive is registered"):
        plan(L("R(2)V(1)D(1,1)"), L("R(1)V(1)D(2,1)"), {})
    only_ag = {"all_gather": adapters.get("all_gather")}
    with pytest.raises(LayoutError, match="names 'reduce_scatter' as its adjoint"):
        plan(L("R(1)V(1)D(2,1)"), L("R(2)V(1)D(1,1)"), only_ag)
    only_chunk = {n: adapters.get(n) for n in ("chunk", "pad")}
    with pytest.raises(LayoutError, match="no plan moves a tensor from .* transition 'move'"):
        plan(L("R(1)V(1)D(2,1)@[0,1]"), L("R(1)V(1)D(2,1)@[2,3]"), only_chunk)
    with pytest.raises(LayoutError, match="registered as 'x' but its name is 'move'"):
        plan(L("R(1)V(1)D(2,1)"), L("R(2)V(1)D(1,1)"), {"x": adapters.get("move")})


def test_execute_checks_its_inputs(adapters):
    p = plan(L("R(1)V(1)D(4,1)"), L("R(4)V(1)D(1,1)"), adapters)
    parts = materialize(X, p.src)
    with pytest.raises(LayoutError, match=r"missing \[3\]"):
        execute(p, {k: v for k, v in parts.items() if k != 3})
    parts[2] = torch.zeros(3, 12)
    with pytest.raises(LayoutError, match=r"device 2 holds a tensor of shape \(3, 12\)"):
        execute(p, parts)


def _reshard_by_trying_every_replica(p: Layout, q: Layout) -> list[tuple]:
    """The reshard fallback's transfers, written plainly: for each receiving device, try
    every replica of ``p`` and keep the least (elements from others, busiest sender's
    load, replicas counted from the receiver's position)."""
    load: dict[int, int] = {}
    out = []
    for j, dev in enumerate(q.devices):
        if q.coords(dev)[1] != 0:
            continue
        want = q.box(dev)
        best = None
        for r in range(p.r):
            parts = []
            for pos, src in enumerate(p.devices):
                c = p.coords(src)
                box = p.box(src)
                ov = tuple((max(a, x), min(b, y)) for (a, b), (x, y) in zip(box, want))
                if c[0] == r and all(a < b for a, b in ov):
                    parts.append((c[1:], pos, src, box, ov))
            parts.sort()  # by value part, then chunk: the order the planner visits them
            sizes = [(s, math.prod(b - a for a, b in ov)) for *_, s, _, ov in parts]
            remote = sum(n for s, n in sizes if s != dev)
            peak = max((load.get(s, 0) + n for s, n in sizes if s != dev), default=0)
            key = (remote, peak, (r - j) % p.r)
            if best is None or key < best[0]:
                best = (key, parts, sizes)
        for (_, pos, src, box, ov), (_, n) in zip(best[1], best[2]):
            local = tuple((a - o, b - o) for (a, b), (o, _) in zip(ov, box))
            out.append((pos, local, j, tuple((a - o, b - o) for (a, b), (o, _) in zip(ov, want))))
            if src != dev:
                load[src] = load.get(src, 0) + n
    return out


@settings(max_examples=50, deadline=None)
@given(layout_pairs())
def test_the_reshard_fallback_picks_the_replica_trying_every_one_would(adapters, pair):
    """The fallback skips replicas that cannot beat the best found; its transfers are the
    ones trying every replica gives."""
    from nnscaler.layout.planner import _Registry, _reshard_bridge, _snapshot

    src, dst = pair
    prims = _Registry(_snapshot(adapters))
    step = _reshard_bridge(src, dst, prims.by_transition["move"][0], prims)
    assert list(dict(step.params)["transfers"]) == _reshard_by_trying_every_replica(src, dst)
