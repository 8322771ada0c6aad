"""Built-in primitives: forward semantics, exact adjoints, plugin registration."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nnscaler.layout import Group, LayoutError, primitives
from nnscaler.plugins import NNScalerPluginManager

PRIMS = {p.name: p for p in primitives.BUILTIN_PRIMITIVES}


def rand(shape, g):
    return torch.randint(-9, 10, shape, generator=g).to(torch.float64)


def dot(xs, ys):
    assert len(xs) == len(ys)
    return float(sum((x * y).sum() for x, y in zip(xs, ys)))


def case(name: str, k: int, g: torch.Generator):
    """Inputs, output count and params of a random application of primitive ``name``."""
    if name in ("broadcast", "reduce"):
        n_out = 1 + int(torch.randint(0, 3, (1,), generator=g))
        return [rand((2, 3), g) for _ in range(k)], n_out, {}
    if name == "move":
        in_shapes, out_shapes = ((4, 2),) * k, ((2, 4),) * 2
        transfers = tuple(
            (i, ((0, 2), (0, 2)), j, ((0, 2), (a, a + 2)))
            for i in range(k)
            for j in range(2)
            for a in (0, 2)
            if (i + j + a) % 3
        )
        params = {"transfers": transfers, "in_shapes": in_shapes, "out_shapes": out_shapes}
        return [rand(s, g) for s in in_shapes], 2, params
    params = {
        "all_to_all": {"src_dim": 0, "dst_dim": 1},
        "all_gather": {"dim": 1},
        "reduce_scatter": {"dim": 1},
        "chunk": {"dim": 1},
        "pad": {"dim": 0},
    }.get(name, {})
    return [rand((2 * k, 2 * k), g) for _ in range(k)], k, params


EXACT = sorted(n for n, p in PRIMS.items() if p.exact_adjoint)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(EXACT), st.integers(1, 4), st.integers(0, 2**16))
def test_adjoint_is_the_transpose(name, k, seed):
    g = torch.Generator().manual_seed(seed)
    prim = PRIMS[name]
    xs, n_out, params = case(name, k, g)
    ys = prim.forward(xs, n_out=n_out, **params)
    assert len(ys) == n_out
    bs = [rand(y.shape, g) for y in ys]
    adj = PRIMS[prim.adjoint]
    back = adj.forward(bs, n_out=len(xs), **prim.adjoint_params(**params))
    assert [b.shape for b in back] == [x.shape for x in xs]
    assert dot(ys, bs) == dot(xs, back)


def test_adjoint_of_adjoint_is_the_primitive():
    for prim in primitives.BUILTIN_PRIMITIVES:
        if prim.exact_adjoint:
            assert PRIMS[PRIMS[prim.adjoint].adjoint] is prim, prim.name


def test_forward_semantics_on_small_lists():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    assert [t.tolist() for t in PRIMS["all_reduce"].forward([a, b], n_out=2)] == [[11, 22]] * 2
    rs = PRIMS["reduce_scatter"].forward([a, b], n_out=2, dim=0)
    assert [t.tolist() for t in rs] == [[11], [22]]
    ag = PRIMS["all_gather"].forward([a, b], n_out=2, dim=0)
    assert [t.tolist() for t in ag] == [[1, 2, 10, 20]] * 2
    assert [t.tolist() for t in PRIMS["chunk"].forward([a, b], n_out=2, dim=0)] == [[1], [20]]
    assert [t.tolist() for t in PRIMS["pad"].forward([a, b], n_out=2, dim=0)] == [
        [1, 2, 0, 0],
        [0, 0, 10, 20],
    ]
    assert [t.tolist() for t in PRIMS["value_split"].forward([a, b], n_out=2)] == [[1, 2], [0, 0]]
    x0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # rows 0-1 of dim 0, all of dim 1
    x1 = torch.tensor([[5.0, 6.0], [7.0, 8.0]])  # rows 2-3
    out = PRIMS["all_to_all"].forward([x0, x1], n_out=2, src_dim=0, dst_dim=1)
    assert [t.tolist() for t in out] == [[[1], [3], [5], [7]], [[2], [4], [6], [8]]]


def test_outputs_are_fresh_tensors():
    a = torch.ones(2)
    for name in ("all_reduce", "all_gather", "broadcast", "chunk"):
        params = {"dim": 0} if name in ("all_gather", "chunk") else {}
        outs = PRIMS[name].forward([a, a.clone()], n_out=2, **params)
        before = outs[1].clone()
        outs[0] += 1
        assert torch.equal(outs[1], before), name
        assert a.tolist() == [1, 1], name


def test_identity_allreduce_is_the_transpose_when_replicas_count_once():
    """Forward: identity on a replicated tensor. Backward: all-reduce. It is the transpose
    of replicating one logical tensor onto k devices (input counted once), not of the
    per-device identity; that is why it is flagged exact_adjoint=False."""
    prim = PRIMS["identity_allreduce"]
    assert not prim.exact_adjoint and prim.transition is None
    g = torch.Generator().manual_seed(0)
    x = rand((3,), g)
    ys = prim.forward([x.clone() for _ in range(3)], n_out=3)
    gs = [rand((3,), g) for _ in range(3)]
    back = PRIMS[prim.adjoint].forward(gs, n_out=3)
    assert all(torch.equal(b, back[0]) for b in back)  # every replica gets the full gradient
    assert dot(ys, gs) == float((x * back[0]).sum())


def test_collectives_reject_mismatched_groups():
    with pytest.raises(LayoutError, match="as many outputs as inputs"):
        PRIMS["all_reduce"].forward([torch.ones(1)], n_out=2)
    with pytest.raises(LayoutError, match="cannot cut dim 0 of size 3 into 2"):
        PRIMS["chunk"].forward([torch.ones(3), torch.ones(3)], n_out=2, dim=0)


def test_costs_follow_ring_algorithms():
    g4 = Group.of(range(4))
    assert PRIMS["all_reduce"].cost(g4, 100) == 150
    assert PRIMS["reduce_scatter"].cost(g4, 100) == 75
    assert PRIMS["all_gather"].cost(g4, 100) == 300
    assert PRIMS["all_to_all"].cost(g4, 100) == 75
    assert PRIMS["chunk"].cost(g4, 100) == 0
    move = {"transfers": ((0, ((0, 5),), 0, ((0, 5),)), (0, ((5, 10),), 1, ((0, 5),)))}
    assert PRIMS["move"].cost(Group((0,), (0, 1)), 10, **move) == 5  # the local copy is free


def test_builtins_register_through_the_adapter_hook():
    pm = NNScalerPluginManager(autoload=False, plugins=[primitives])
    assert pm.adapters.by_registrant("nnscaler.layout.primitives") == list(PRIMS)
    for name, prim in PRIMS.items():
        assert pm.adapters.get(name) is prim
    assert "adapters: all_reduce" in pm.report()
