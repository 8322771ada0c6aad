"""Ring attention's block kernels: the math kernel against autograd through
``scaled_dot_product_attention`` (one block, packed blocks), the ring's step table
(every causal query/key pair computed exactly once, zigzag order included), the ring on
a kernel against the whole op (threads), and kernel selection."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nnscaler.errors import RegistrationError
from nnscaler.ops.builtin.attention_kernels import (
    MATH,
    BlockKernel,
    Packed,
    select_kernel,
    validate_kernel,
)
from nnscaler.ops.builtin.context_parallel import (
    ring_backward,
    ring_forward,
    ring_steps,
    to_zigzag,
)
from nnscaler.ops.partgroup import run_parts
from nnscaler.registry import Registry

RTOL, ATOL = 1e-5, 1e-6


def _qkv(b, hq, hk, length, e, seed=0, klen=None):
    g = torch.Generator().manual_seed(seed)
    klen = length if klen is None else klen
    return (torch.randn(b, hq, length, e, generator=g), torch.randn(b, hk, klen, e, generator=g),
            torch.randn(b, hk, klen, e, generator=g))


def _reference(q, k, v, causal, scale, dout):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out, torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("causal", [False, True])
def test_math_kernel_is_attention_with_its_gradients(causal):
    q, k, v = _qkv(2, 4, 2, 6, 8)
    dout = torch.randn(2, 4, 6, 8, generator=torch.Generator().manual_seed(1))
    want, want_grads = _reference(q, k, v, causal, 0.3, dout)
    out, lse = MATH.forward(q, k, v, causal=causal, scale=0.3)
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-2, -1)) * 0.3
    if causal:
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=RTOL, atol=ATOL)
    grads = MATH.backward(dout, q, k, v, out, lse, causal=causal, scale=0.3)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL)


def test_packed_blocks_attend_within_their_sequences():
    """Three sequences; the last has queries but no key in this block (out 0, lse -inf)."""
    q, k, v = _qkv(1, 2, 1, 7, 4, seed=3, klen=5)
    packed = Packed(cu_q=torch.tensor([0, 3, 5, 7], dtype=torch.int32),
                    cu_k=torch.tensor([0, 3, 5, 5], dtype=torch.int32), max_q=3, max_k=3)
    dout = torch.randn(1, 2, 7, 4, generator=torch.Generator().manual_seed(2))
    out, lse = MATH.forward(q, k, v, causal=False, scale=0.5, packed=packed)
    grads = MATH.backward(dout, q, k, v, out, lse, causal=False, scale=0.5, packed=packed)
    for qa, qb, ka, kb in ((0, 3, 0, 3), (3, 5, 3, 5)):
        sl = (slice(None), slice(None))
        want, want_grads = _reference(q[..., qa:qb, :], k[..., ka:kb, :], v[..., ka:kb, :],
                                      False, 0.5, dout[..., qa:qb, :])
        torch.testing.assert_close(out[..., qa:qb, :], want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(grads[0][(*sl, slice(qa, qb))], want_grads[0])
        torch.testing.assert_close(grads[1][(*sl, slice(ka, kb))], want_grads[1])
    assert out[..., 5:, :].eq(0).all() and lse[..., 5:].eq(float("-inf")).all()
    assert grads[0][..., 5:, :].eq(0).all()


def test_a_causal_block_is_a_diagonal_one():
    q, k, v = _qkv(1, 1, 1, 4, 4, klen=6)
    with pytest.raises(ValueError, match="diagonal"):
        MATH.forward(q, k, v, causal=True, scale=1.0)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("zigzag", [False, True])
def test_ring_steps_cover_every_causal_pair_once(n, zigzag):
    """Over the ring's steps each part computes each query/key pair it needs exactly once
    (positions as each part holds them, zigzag order included), with the diagonal flag
    only on its own block; full attention computes every pair."""
    chunk = 4
    length = n * chunk
    pos = torch.arange(length).reshape(1, 1, length, 1).float()
    if zigzag:
        held = run_parts([lambda g, p=p: to_zigzag(pos.chunk(n, -2)[p], g, -2) for p in range(n)])
    else:
        held = list(pos.chunk(n, -2))
    held = [h.flatten().long() for h in held]
    for causal in (False, True):
        for i in range(n):
            step = ring_steps(n, i, chunk, zigzag=zigzag, causal=causal)
            seen = torch.zeros(length, length, dtype=torch.long)
            for src in range(n):
                s = step(src)
                if s is None:
                    continue
                rows, cols, diag = s
                assert diag == (causal and src == i)
                qp, kp = held[i][rows], held[src][cols]
                pair = kp.unsqueeze(0) <= qp.unsqueeze(1) if diag else torch.ones(
                    len(qp), len(kp), dtype=torch.bool)
                seen[qp.unsqueeze(1).expand_as(pair)[pair], kp.unsqueeze(0).expand_as(pair)[pair]] += 1
            mine = held[i]
            want = torch.zeros(length, length, dtype=torch.long)
            want[mine] = 1
            if causal:
                want = want * torch.ones(length, length, dtype=torch.long).tril()
            assert torch.equal(seen, want), (causal, i)


def _ring_on_threads(kernel, q, k, v, n, *, zigzag, causal, dout, scale=0.5):
    """Run `ring_forward` then `ring_backward` on ``n`` thread parts."""
    def part(p):
        def run(group):
            mine = [t.chunk(n, -2)[p] for t in (q, k, v, dout)]
            if zigzag:
                mine = [to_zigzag(t, group, -2) for t in mine]
            step = ring_steps(n, p, mine[0].shape[-2], zigzag=zigzag, causal=causal)
            out, lse = ring_forward(kernel, *mine[:3], group, step, scale)
            grads = ring_backward(kernel, mine[3], *mine[:3], out, lse, group, step, scale)
            return out, grads
        return run
    results = run_parts([part(p) for p in range(n)])
    return results


@pytest.mark.parametrize("zigzag", [False, True])
def test_ring_on_the_math_kernel_is_the_whole_op(zigzag):
    n = 2
    q, k, v = _qkv(2, 4, 2, 8, 4, seed=4)
    dout = torch.randn(2, 4, 8, 4, generator=torch.Generator().manual_seed(5))
    want, want_grads = _reference(q, k, v, True, 0.5, dout)
    results = _ring_on_threads(MATH, q, k, v, n, zigzag=zigzag, causal=True, dout=dout)
    order = run_parts([lambda g, p=p: to_zigzag(
        torch.arange(8).reshape(1, 1, 8, 1).chunk(n, -2)[p], g, -2) for p in range(n)])
    idx = torch.cat([o.flatten() for o in order]) if zigzag else torch.arange(8)
    out = torch.cat([r[0] for r in results], -2)
    torch.testing.assert_close(out, want[..., idx, :], rtol=RTOL, atol=ATOL)
    for j in range(3):
        got = torch.cat([r[1][j] for r in results], -2)
        torch.testing.assert_close(got, want_grads[j][..., idx, :], rtol=RTOL, atol=ATOL)


class _Fussy(BlockKernel):
    name = "fussy"

    def accepts(self, q, k, v):
        return q.dtype == torch.float64


def test_select_kernel_takes_the_last_that_accepts():
    registry: Registry = Registry("attention kernel", validate=validate_kernel)
    registry.register("math", MATH)
    fussy = registry.register("fussy", _Fussy())
    q32 = torch.zeros(1, 1, 2, 2)
    assert select_kernel(q32, q32, q32, registry) is MATH
    q64 = q32.double()
    assert select_kernel(q64, q64, q64, registry) is fussy
    assert select_kernel(q64, q64, q64, Registry("attention kernel")) is MATH
    with pytest.raises(RegistrationError, match="accepts.*BlockKernel"):
        registry.register("bad", object())


def test_the_plugin_manager_registers_the_math_kernel():
    from nnscaler.plugins import NNScalerPluginManager

    pm = NNScalerPluginManager(autoload=False)
    assert pm.attention_kernels.get("math") is MATH
    assert pm.contributions("nnscaler.ops.builtin")["attention_kernels"] == ["math"]


def test_fewer_key_heads_without_gqa_are_refused_as_by_the_whole_op():
    """The block-kernel ring takes GQA only with ``enable_gqa``, as
    ``scaled_dot_product_attention`` does: without it both raise."""
    from nnscaler.ops.builtin.context_parallel import context_parallel_attention

    q, k, v = _qkv(1, 4, 2, 4, 4)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError):
        context_parallel_attention(q, k, v)
    out = context_parallel_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                               rtol=RTOL, atol=ATOL)


def _doc_mask(length, docs, causal):
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    mask = doc.unsqueeze(-1) == doc.unsqueeze(0)
    return mask & torch.ones(length, length, dtype=torch.bool).tril() if causal else mask


def test_documents_are_read_from_the_mask_exactly():
    from nnscaler.ops.builtin.attention_documents import block_pack, documents_of

    mask = _doc_mask(8, [3, 5], causal=True)
    docs = documents_of(mask[4:], 1, 4, 4)  # part 1 of 2: rows 4..7, all of document 2
    assert docs.causal and docs.runs == ((0, 4, 3, 8),)
    early, own = block_pack(docs, 0, torch.device("cpu")), block_pack(docs, 1, torch.device("cpu"))
    assert early.keys.tolist() == [3] and early.packed.cu_k.tolist() == [0, 1]
    assert own.keys.tolist() == [0, 1, 2, 3] and own.packed.cu_q.tolist() == [0, 4]
    both = documents_of(_doc_mask(8, [3, 5], causal=False)[:4].float().log(), 2, 4, 0)
    assert not both.causal and [r[2:] for r in both.runs] == [(0, 3), (3, 8)] * 2
    window = torch.ones(8, 8, dtype=torch.bool).tril() & torch.ones(8, 8, dtype=torch.bool).triu(-2)
    assert documents_of(window[4:], 1, 4, 4) is None  # a sliding window: no documents
    padded = mask.clone()
    padded[7] = False
    assert documents_of(padded[4:], 1, 4, 4) is None  # a row that sees no key
    assert documents_of(mask[4:].expand(2, 4, 8), 1, 4, 4) is None  # per head


@pytest.mark.parametrize("causal", [False, True])
def test_the_ring_on_packed_documents_is_the_whole_op(causal):
    from nnscaler.ops.builtin.attention_documents import documents_of
    from nnscaler.ops.builtin.context_parallel import document_steps

    n, length = 2, 12
    q, k, v = _qkv(2, 4, 2, length, 4, seed=6)
    mask = torch.stack([_doc_mask(length, [5, 7], causal), _doc_mask(length, [2, 6, 4], causal)])
    mask = mask.unsqueeze(1)
    dout = torch.randn(2, 4, length, 4, generator=torch.Generator().manual_seed(8))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=0.5, enable_gqa=True)
    want_grads = torch.autograd.grad(want, leaves, dout)

    def part(p):
        def run(group):
            mine = [t.chunk(n, -2)[p] for t in (q, k, v, dout)]
            docs = documents_of(mask.chunk(n, -2)[p], 2, length // n, p * length // n)
            step = document_steps(docs, n, p, q.device)
            out, lse = ring_forward(MATH, *mine[:3], group, step, 0.5)
            return (out, *ring_backward(MATH, mine[3], *mine[:3], out, lse, group, step, 0.5))
        return run
    results = run_parts([part(p) for p in range(n)])
    for j, w in enumerate([want, *want_grads]):
        torch.testing.assert_close(torch.cat([r[j] for r in results], -2), w, rtol=RTOL,
                                   atol=ATOL)
