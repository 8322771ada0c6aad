"""``context_parallel_attention``: the parts of attention split along the sequence (ring,
zigzag ring, Ulysses, all-gather), run as threads joined by a PartGroup, against one
``scaled_dot_product_attention`` on the whole sequence: outputs and the gradients of
queries, keys, values (float32 at rtol 1e-5); plus the zigzag permutation, the counted
work of the causal ring, and the errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnscaler.ops.builtin import attention_blocks
from nnscaler.ops.builtin.context_parallel import (
    ContextParallelError,
    context_parallel_attention,
    from_zigzag,
    to_zigzag,
)
from nnscaler.ops.partgroup import run_parts

RTOL, ATOL = 1e-5, 1e-6
SETTINGS = settings(max_examples=20, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _inputs(b, hq, hk, length, e, ev, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, length, e, generator=g)
    k = torch.randn(b, hk, length, e, generator=g)
    v = torch.randn(b, hk, length, ev, generator=g)
    return q, k, v


def _packed_mask(length: int, docs: list[int], causal: bool) -> torch.Tensor:
    """Packed sequences: tokens see only their own document (and, causal, the past)."""
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    mask = doc.unsqueeze(-1) == doc.unsqueeze(0)
    if causal:
        mask &= torch.ones(length, length, dtype=torch.bool).tril()
    return mask


def _split_mask(mask, n, p):
    if mask is None or mask.shape[-2] == 1:
        return mask
    return mask.chunk(n, -2)[p]


def _compare(q, k, v, n, strategy, *, mask=None, causal=False, gqa=False, scale=None):
    """Run the parts and the whole op; compare outputs and the input gradients."""
    up = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(7))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=gqa)
    want_grads = torch.autograd.grad((want * up).sum(), leaves)
    parts = [[t.clone().chunk(n, -2)[p].requires_grad_(True) for t in (q, k, v)]
             for p in range(n)]

    def call(p):
        return lambda g: context_parallel_attention(
            *parts[p], _split_mask(mask, n, p), is_causal=causal, scale=scale,
            enable_gqa=gqa, strategy=strategy, group=g)

    outs = run_parts([call(p) for p in range(n)])
    got = torch.cat(outs, -2)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    total = sum((o * u).sum() for o, u in zip(outs, up.chunk(n, -2), strict=True))
    grads = torch.autograd.grad(total, [t for part in parts for t in part])
    for i, name in enumerate("qkv"):
        got_grad = torch.cat([grads[3 * p + i] for p in range(n)], -2)
        torch.testing.assert_close(got_grad, want_grads[i], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("strategy", ["ring", "zigzag", "ulysses", "allgather"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_strategies_match_whole_attention(strategy, n, causal):
    q, k, v = _inputs(2, 4, 4, 16, 8, 6, seed=n)
    _compare(q, k, v, n, strategy, causal=causal)


@pytest.mark.parametrize("strategy", ["ring", "zigzag", "ulysses"])
@pytest.mark.parametrize("hk", [1, 2])
def test_grouped_query_attention(strategy, hk):
    n = 2 if strategy != "ulysses" or hk == 2 else 1
    q, k, v = _inputs(1, 4, hk, 8, 4, 4, seed=hk)
    _compare(q, k, v, n, strategy, causal=True, gqa=True)


@pytest.mark.parametrize("strategy", ["ring", "zigzag", "ulysses", "allgather"])
def test_padding_and_packed_masks(strategy):
    n, length = 2, 16
    q, k, v = _inputs(2, 2, 2, length, 4, 4, seed=3)
    pad = torch.ones(2, 1, 1, length, dtype=torch.bool)
    pad[1, ..., 11:] = False  # the second sequence is padded after 11 tokens
    _compare(q, k, v, n, strategy, mask=pad)
    packed = _packed_mask(length, [5, 3, 8], causal=True)  # three documents in one row
    _compare(q, k, v, n, strategy, mask=packed)
    bias = torch.randn(1, 2, length, length)  # a float bias with heads (ALiBi-like)
    _compare(q, k, v, n, strategy, mask=bias)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.sampled_from([2, 3, 4]))
    strategy = draw(st.sampled_from(["ring", "zigzag", "ulysses", "allgather"]))
    chunk = draw(st.integers(1, 4)) * (2 if strategy == "zigzag" else 1)
    hk = draw(st.sampled_from([1, 2]))
    if strategy == "ulysses":
        hk = n * draw(st.sampled_from([1, 2]))
    hq = hk * draw(st.sampled_from([1, 2]))
    return dict(n=n, strategy=strategy, length=n * chunk, hk=hk, hq=hq,
                causal=draw(st.booleans()) or strategy == "zigzag",
                e=draw(st.sampled_from([2, 4])), scale=draw(st.sampled_from([None, 0.5])),
                seed=draw(st.integers(0, 2**16)))


@SETTINGS
@given(cases())
def test_lengths_chunks_and_heads(case):
    q, k, v = _inputs(1, case["hq"], case["hk"], case["length"], case["e"], 3, case["seed"])
    _compare(q, k, v, case["n"], case["strategy"], causal=case["causal"],
             gqa=case["hq"] != case["hk"], scale=case["scale"])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_zigzag_order_and_back(n):
    x = torch.arange(4.0 * n).reshape(1, 4 * n)  # 2n half-chunks of 2 tokens
    chunks = x.chunk(n, -1)
    zig = run_parts([lambda g, p=p: to_zigzag(chunks[p], g, -1) for p in range(n)])
    for p, held in enumerate(zig):
        halves = x.chunk(2 * n, -1)
        assert torch.equal(held, torch.cat([halves[p], halves[2 * n - 1 - p]], -1))
    back = run_parts([lambda g, p=p: from_zigzag(zig[p], g, -1) for p in range(n)])
    assert torch.equal(torch.cat(back, -1), x)


def test_zigzag_balances_the_causal_work(monkeypatch):
    """Count the (query segment, key segment) products each part computes."""
    counts: dict[str, list[int]] = {}
    real = attention_blocks.BlockAttention.result

    def result(self, ev):
        counts.setdefault(self.kind, []).append(self.pairs * self.unit)
        return real(self, ev)

    monkeypatch.setattr(attention_blocks.BlockAttention, "result", result)
    n = 4
    q, k, v = _inputs(1, 1, 1, 32, 4, 4, seed=0)
    for strategy, unit in (("ring", 4), ("zigzag", 1)):  # work in quarter-chunk products
        monkeypatch.setattr(attention_blocks.BlockAttention, "kind", strategy, raising=False)
        monkeypatch.setattr(attention_blocks.BlockAttention, "unit", unit, raising=False)
        _compare(q, k, v, n, strategy, causal=True)
    assert sorted(counts["ring"]) == [4, 8, 12, 16]  # part p computes p + 1 blocks
    assert counts["zigzag"] == [2 * n + 1] * n  # every part the same: 2n + 1 quarter products


def test_errors_name_the_op_and_the_fix():
    q, k, v = _inputs(1, 3, 3, 6, 4, 4, seed=0)

    def run(n, **kw):
        parts = [[t.chunk(n, -2)[p] for t in (q, k, v)] for p in range(n)]
        return run_parts([lambda g, p=p: context_parallel_attention(*parts[p], group=g, **kw)
                          for p in range(n)])

    with pytest.raises(ContextParallelError, match=r"zigzag.*2 x 2.*got a chunk of 3.*strategy='ring'"):
        run(2, strategy="zigzag", is_causal=True)
    with pytest.raises(ContextParallelError, match=r"Ulysses.*divide by 2.*3 query and 3 key"):
        run(2, strategy="ulysses")
    with pytest.raises(ContextParallelError, match="dropout_p=0.1"):
        run(2, dropout_p=0.1)
    with pytest.raises(ContextParallelError, match="strategy is one of"):
        run(2, strategy="tree")
    with pytest.raises(ContextParallelError, match="every key column"):
        context_parallel_attention(q, k, v, torch.ones(6, 4, dtype=torch.bool))


# -- the ring's own backward (ProcessPartGroup, and a group of one part) -------------------


@pytest.mark.parametrize("causal", [False, True])
def test_fused_ring_on_one_part_matches(causal):
    """A group of one part runs `_RingAttention` (the recomputing backward)."""
    q, k, v = _inputs(2, 4, 2, 8, 4, 3, seed=5)
    mask = None if causal else _packed_mask(8, [3, 5], causal=False)
    _compare(q, k[:1], v[:1], 1, "ring", causal=causal, gqa=True, mask=mask)  # keys broadcast


def _dist_cases():
    pad = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    pad[1, ..., 13:] = False
    return [dict(strategy=s, causal=c, mask=m, gqa=g)
            for s in ("ring", "zigzag", "allgather", "ulysses")
            for c, m, g in ((True, None, False), (False, None, True), (False, pad, False),
                            (False, _packed_mask(16, [7, 9], causal=True), True))]


def _dist_worker(rank, world):
    from nnscaler.runtime.partgroup import ProcessPartGroup

    group = ProcessPartGroup(list(range(world)))
    for case in _dist_cases():
        hk = 4 if case["strategy"] == "ulysses" else 2
        q, k, v = _inputs(2, 4 if case["gqa"] else hk, hk, 16, 4, 3, seed=11)
        up = torch.randn(*q.shape[:-1], 3, generator=torch.Generator().manual_seed(3))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*leaves, attn_mask=case["mask"],
                                              is_causal=case["causal"], enable_gqa=case["gqa"])
        want_grads = torch.autograd.grad((want * up).sum(), leaves)
        mine = [t.chunk(world, -2)[rank].clone().requires_grad_(True) for t in (q, k, v)]
        out = context_parallel_attention(*mine, _split_mask(case["mask"], world, rank),
                                         is_causal=case["causal"], enable_gqa=case["gqa"],
                                         strategy=case["strategy"], group=group)
        grads = torch.autograd.grad((out * up.chunk(world, -2)[rank]).sum(), mine)
        torch.testing.assert_close(out, want.chunk(world, -2)[rank], rtol=RTOL, atol=ATOL)
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, w.chunk(world, -2)[rank], rtol=RTOL, atol=ATOL)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_strategies_on_processes_match_whole_attention(world):
    from dist_utils import run_distributed

    assert all(run_distributed(_dist_worker, world))


@pytest.mark.parametrize("strategy", ["ring", "zigzag", "allgather"])
def test_tiles_smaller_than_the_chunks(strategy, monkeypatch):
    """Blocks are computed in tiles of at most TILE tokens (here 3: uneven tiles)."""
    monkeypatch.setattr(attention_blocks, "TILE", 3)
    q, k, v = _inputs(1, 2, 1, 16, 4, 4, seed=9)
    _compare(q, k, v, 2, strategy, causal=True, gqa=True)
    _compare(q, k, v, 2, strategy, mask=_packed_mask(16, [5, 11], causal=True), gqa=True)
    _compare(q, k, v, 1, "ring", causal=True, gqa=True)  # the own backward, tiled
