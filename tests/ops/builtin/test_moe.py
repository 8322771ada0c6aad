"""The MoE experts op: the whole op against a loop over experts written from Hugging Face
Mixtral's definition, and its expert-parallel split (parts as threads) against the whole
op, values and gradients, float32 at rtol 1e-5: top-1 and top-2, a batch where some experts
get no token, one where every token goes to one expert, and the capacity factor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nnscaler.anno import bind, parse
from nnscaler.ops.builtin.moe import (
    EXPERT_PARALLEL,
    FFN_PARALLEL,
    MoEError,
    expert_parallel_moe,
    ffn_parallel_moe,
    gate_up_view,
    moe_anno,
    moe_experts,
    moe_rules,
    record_routing,
)
from nnscaler.ops.partgroup import run_parts

T, H, F_, E = 12, 8, 6, 4
TOL = dict(rtol=1e-5, atol=1e-6)


def _reference(hidden, index, weights, gate_up, down):
    """Mixtral's eager experts: for each expert, its tokens through ``down(silu(gate) *
    up)``, weighted, added into the output."""
    out = torch.zeros_like(hidden)
    for e in range(gate_up.size(0)):
        token, slot = torch.where(index == e)
        gate, up = F.linear(hidden[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None]
        out = out.index_add(0, token, y)
    return out


def _inputs(k: int, route: str = "random", seed: int = 0, n_experts: int = E):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, n_experts, generator=g)
    if route == "one":  # every token's first choice is expert 1; top-1: no other expert
        logits[:, 1] += 100.0
    if route == "some":  # experts 0 and 2 get no token
        logits[:, [0, 2]] -= 100.0
    weights, index = logits.softmax(-1).topk(k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return [torch.randn(T, H, generator=g), index, weights,
            torch.randn(n_experts, 2 * F_, H, generator=g) / 3,
            torch.randn(n_experts, H, F_, generator=g) / 3]


def _grads(out, leaves, seed: int = 7):
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad((out * up).sum(), leaves)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("route", ["random", "some", "one"])
def test_whole_op_is_the_experts_loop(k, route):
    args = _inputs(k, route)
    if route == "some":
        assert not (args[1] == 0).any() and not (args[1] == 2).any()
    if route == "one":
        assert (args[1][:, 0] == 1).all()
    got = moe_experts(*args)
    torch.testing.assert_close(got, _reference(*args), **TOL)


def _expert_parallel(args, n: int, **kw):
    """The split of the whole op in ``n`` parts (tokens and experts), run as threads; the
    outputs concatenated and the gradients of every input leaf, recombined."""
    hidden, index, weights, gate_up, down = args
    leaves = [x.clone().requires_grad_(True) for x in (hidden, weights, gate_up, down)]
    pieces = [torch.tensor_split(x, n) for x in (leaves[0], index, leaves[1], leaves[2],
                                                  leaves[3])]
    outs = run_parts([
        lambda grp, p=p: expert_parallel_moe(*(x[p] for x in pieces),
                                             expert_counts=[len(c) for c in pieces[3]],
                                             group=grp, **kw)
        for p in range(n)])
    out = torch.cat(outs)
    return out, _grads(out, leaves)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("route", ["random", "some", "one"])
def test_expert_parallel_parts_equal_the_whole_op(n, k, route):
    args = _inputs(k, route, seed=n)
    leaves = [x.clone().requires_grad_(True) for x in (args[0], args[2], args[3], args[4])]
    want = moe_experts(leaves[0], args[1], *leaves[1:])
    want_grads = _grads(want, leaves)
    got, got_grads = _expert_parallel(args, n)
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_routing_is_recorded_per_expert_and_per_part():
    args = _inputs(2, "some")
    with record_routing() as whole:
        moe_experts(*args, layer="moe.0")
    per_expert = torch.bincount(args[1].reshape(-1), minlength=E).tolist()
    assert per_expert[0] == per_expert[2] == 0
    (rec,) = whole
    assert (rec.layer, rec.tokens_per_expert, rec.tokens_per_part, rec.dropped) == (
        "moe.0", per_expert, [2 * T], 0)
    with record_routing() as records:
        _expert_parallel(args, 2, layer="moe.0")
    # each part records the whole batch's counts; experts 0, 1 are on part 0
    assert len(records) == 2
    for rec in records:
        assert rec.tokens_per_expert == per_expert
        assert rec.tokens_per_part == [per_expert[0] + per_expert[1], per_expert[2] + per_expert[3]]
        assert rec.imbalance == max(rec.tokens_per_part) / T


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recomputed_call_is_recorded_once_and_stays_exact(reentrant):
    """Activation checkpointing replays the op in backward: the replay adds no record and
    the gradients are those of the plain call."""
    from torch.utils.checkpoint import checkpoint

    args = _inputs(2, "some")
    leaves = [args[0], args[2], args[3], args[4]]
    plain = [x.clone().requires_grad_(True) for x in leaves]
    again = [x.clone().requires_grad_(True) for x in leaves]

    def call(h, w, gu, d):
        return moe_experts(h, args[1], w, gu, d, layer="moe.0")

    def grads(out, leaves):  # .backward(): the reentrant checkpoint refuses autograd.grad
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
        (out * up).sum().backward()
        return [x.grad for x in leaves]

    with record_routing() as records:
        want = call(*plain)
        want_grads = grads(want, plain)
    assert len(records) == 1
    with record_routing() as records:
        got = checkpoint(call, *again, use_reentrant=reentrant)
        got_grads = grads(got, again)
    assert len(records) == 1  # the forward's; the backward's replay is not counted
    assert records[0].tokens_per_expert == torch.bincount(args[1].reshape(-1),
                                                          minlength=E).tolist()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_capacity_drops_the_same_pairs_split_or_whole():
    args = _inputs(2, "one")
    with pytest.raises(MoEError, match=r"capacity_factor=1.0 gives each expert 6 token slots"
                                       r".*busiest expert got 12.*drop_tokens=True"):
        moe_experts(*args, capacity_factor=1.0)
    with record_routing() as records:
        want = moe_experts(*args, capacity_factor=1.0, drop_tokens=True)
    assert records[0].dropped > 0
    got, _ = _expert_parallel(args, 2, capacity_factor=1.0, drop_tokens=True)
    torch.testing.assert_close(got, want, **TOL)
    # a big enough factor drops nothing: dropless result
    torch.testing.assert_close(moe_experts(*args, capacity_factor=4.0), moe_experts(*args))


def test_bad_calls_are_named():
    args = _inputs(1)
    with pytest.raises(MoEError, match="unknown activation 'tanh'"):
        moe_experts(*args, activation="tanh", layer="blocks.0.moe")
    with pytest.raises(MoEError, match=r"MoE layer 'blocks.0.moe': expected hidden \[T, H\]"):
        moe_experts(args[0][:, :3], *args[1:], layer="blocks.0.moe")
    with pytest.raises(MoEError, match=r"top_k_index holds experts \[\d, 9\]"):
        moe_experts(args[0], args[1].clamp(max=0) + 9, *args[2:])


def test_the_splits_of_the_op():
    args = _inputs(2)
    bound = bind(parse(moe_anno(*args)), [tuple(x.shape) for x in args])
    rules = moe_rules(bound)
    space = bound.transform_space(2, rules=rules)
    # tokens: data parallel (experts replicated); experts: expert parallel; the experts'
    # intermediate units: tensor parallel; nothing else
    assert [(t.idx, t.dim, t.part_op) for t in space] == [
        (0, 0, None), (1, 0, None), (2, 0, None), (3, 0, EXPERT_PARALLEL),
        (4, 0, EXPERT_PARALLEL), (4, 2, FFN_PARALLEL)]
    assert [str(p) for p in space[3].inputs] == ["S(0)"] * 5
    assert [str(p) for p in space[0].inputs] == ["S(0)", "S(0)", "S(0)", "R", "R"]
    assert [str(p) for p in space[5].inputs] == ["R", "R", "R", "R", "S(2)"]
    assert [str(p) for p in space[5].outputs] == ["V"]
    # three parts cannot hold four experts, but can share six intermediate units
    assert [(t.idx, t.dim) for t in bound.transform_space(3, rules=rules)[3:]] == [(4, 2)]
    # with a capacity, tokens split only with the experts (the parts share their counts)
    capped = bind(parse(moe_anno(*args, capacity_factor=2.0)),
                  [tuple(x.shape) for x in args])
    assert {t.part_op for t in capped.transform_space(2, rules=moe_rules(capped))} == {
        EXPERT_PARALLEL, FFN_PARALLEL}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("k", [1, 2])
def test_ffn_parallel_parts_sum_to_the_whole_op(n, k):
    """Each part takes its slice of the gate rows and of the up rows of the fused weight
    and the same columns of the down projection; the parts' outputs sum to the op's, and
    the gradients of the slices are the whole op's (gate_up_proj's add up)."""
    args = _inputs(k, "some")
    hidden, index, weights, gate_up, down = args
    whole = [x.clone().requires_grad_(True) for x in (hidden, weights, gate_up, down)]
    want = moe_experts(whole[0], index, *whole[1:])
    want_grads = _grads(want, whole)
    leaves = [x.clone().requires_grad_(True) for x in (hidden, weights, gate_up, down)]
    downs = torch.tensor_split(leaves[3], n, dim=2)
    got = sum(ffn_parallel_moe(leaves[0], index, leaves[1], leaves[2], downs[p],
                               ffn_part=(p, n)) for p in range(n))
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(_grads(got, leaves), want_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(MoEError, match=r"ffn_part=\(0, 4\).*does not slice gate_up_proj"):
        ffn_parallel_moe(hidden, index, weights, gate_up, downs[0], ffn_part=(0, 4))


@pytest.mark.parametrize("n", [2, 3])
def test_ffn_parts_of_the_gate_up_view_hold_their_rows_alone(n):
    """gate_up_proj as [E, 2, F, H] (the tracer's view): part p holds block p of F, its gate
    rows and its up rows, and nothing else; the parts sum to the whole op, and each part's
    gradient is the whole op's gradient of its rows (no sum over the parts)."""
    hidden, index, weights, gate_up, down = _inputs(2, "some")
    whole = [x.clone().requires_grad_(True) for x in (hidden, weights, gate_up, down)]
    want = moe_experts(whole[0], index, *whole[1:])
    want_grads = _grads(want, whole)
    view = gate_up_view(gate_up)
    assert torch.equal(view[:, 0], gate_up[:, :F_]) and torch.equal(view[:, 1], gate_up[:, F_:])
    torch.testing.assert_close(moe_experts(hidden, index, weights, view, down), want, **TOL)
    leaves = [x.clone().requires_grad_(True) for x in (hidden, weights, view, down)]
    gate_ups = torch.tensor_split(leaves[2], n, dim=2)
    downs = torch.tensor_split(leaves[3], n, dim=2)
    got = sum(ffn_parallel_moe(leaves[0], index, leaves[1], gate_ups[p], downs[p],
                               ffn_part=(p, n)) for p in range(n))
    torch.testing.assert_close(got, want, **TOL)
    got_grads = _grads(got, leaves)
    torch.testing.assert_close(got_grads[2], gate_up_view(want_grads[2]), **TOL)
    # the annotation names F as a dim of its own, split with down_proj's
    args = [hidden, index, weights, view, down]
    bound = bind(parse(moe_anno(*args)), [tuple(x.shape) for x in args])
    ffn = [t for t in bound.transform_space(n, rules=moe_rules(bound)) if t.part_op == FFN_PARALLEL]
    assert [str(p) for p in ffn[0].inputs] == ["R", "R", "R", "S(2)", "S(2)"]
    with pytest.raises(MoEError, match=r"hold different slices of the intermediate dim"):
        ffn_parallel_moe(hidden, index, weights, gate_ups[0], down, ffn_part=(0, n))
    with pytest.raises(MoEError, match=r"a 4-d gate_up_proj is \[E, 2, F, H\]"):
        moe_experts(hidden, index, weights, gate_up.view(E, 3, 4, H), down)


def test_meta_tensors_give_the_shape_and_the_collectives():
    """On meta tensors (a cost model: no routing to read) the op runs an even routing."""
    args = [x.to("meta") for x in _inputs(2)]
    assert moe_experts(*args).shape == (T, H) and moe_experts(*args).device.type == "meta"
