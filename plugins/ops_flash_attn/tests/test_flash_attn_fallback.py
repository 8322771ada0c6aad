"""The PyTorch fallback computes flash-attn's attention.

The reference below is written from the definition, in float64 and one (batch, head)
at a time: ``softmax(q k^T * scale + bias, masked) v``, query head ``h`` reading
key/value head ``h // (nheads_q // nheads_k)``, the causal mask and the window aligned
to the bottom-right corner (query ``i`` sits on key diagonal ``i + seqlen_k - seqlen_q``),
a query row that sees no key giving zeros.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nnscaler_ops_flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
)
from nnscaler_ops_flash_attn.annotations import (
    gen_flash_attn_func,
    gen_flash_attn_varlen_func,
)

RTOL, ATOL = 1e-5, 1e-5  # float32 against a float64 reference


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    q, k, v = q.double(), k.double(), v.double()
    batch, seqlen_q, nheads_q, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads_q // nheads_k
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    left, right = window_size
    if causal:
        right = 0
    visible = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool)
    distance = torch.zeros(seqlen_q, seqlen_k, dtype=torch.float64)
    for i in range(seqlen_q):
        diagonal = i + seqlen_k - seqlen_q
        for j in range(seqlen_k):
            distance[i, j] = abs(diagonal - j)
            too_far_left = left >= 0 and j < diagonal - left
            too_far_right = right >= 0 and j > diagonal + right
            visible[i, j] = not (too_far_left or too_far_right)
    out = torch.zeros(batch, seqlen_q, nheads_q, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(nheads_q):
            kv = h // group
            scores = q[b, :, h] @ k[b, :, kv].T * scale
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            if alibi_slopes is not None:
                slope = alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h]
                scores = scores - float(slope) * distance
            for i in range(seqlen_q):
                if not visible[i].any():
                    continue  # sees nothing: zeros
                weights = torch.softmax(scores[i][visible[i]], dim=0)
                out[b, i, h] = weights @ v[b, :, kv][visible[i]]
    return out


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=RTOL, atol=ATOL)


def _qkv(b: int, sq: int, sk: int, hq: int, hk: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, sq, hq, d, generator=g),
        torch.randn(b, sk, hk, d, generator=g),
        torch.randn(b, sk, hk, d, generator=g),
    )


# ---------------------------------------------------------------------------------------
# dense
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(5, 5), (2, 5), (5, 2), (1, 7), (7, 1)], ids=lambda x: str(x))
@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_dense(causal: bool, sq: int, sk: int, hq: int, hk: int):
    q, k, v = _qkv(2, sq, sk, hq, hk, 8)
    _check(flash_attn_func(q, k, v, causal=causal), reference(q, k, v, causal=causal))


def test_causal_is_bottom_right_aligned():
    # flash-attn's documented example: seqlen_q = 2, seqlen_k = 5 keeps
    #   1 1 1 1 0
    #   1 1 1 1 1
    # so query 0 must ignore key 4 entirely and query 1 must see every key.
    q, k, v = _qkv(1, 2, 5, 1, 1, 4)
    base = flash_attn_func(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, 4] += 100.0
    v2[:, 4] += 100.0
    moved = flash_attn_func(q, k2, v2, causal=True)
    torch.testing.assert_close(moved[:, 0], base[:, 0])
    assert not torch.allclose(moved[:, 1], base[:, 1])


def test_rows_that_see_nothing_are_zero():
    # seqlen_q = 5, seqlen_k = 2, causal: the first three queries see no key
    q, k, v = _qkv(2, 5, 2, 2, 2, 4)
    out = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert out[:, 3:].abs().sum() > 0


@pytest.mark.parametrize(
    "window", [(1, -1), (-1, 1), (2, 0), (0, 0), (1, 2), (3, 3)], ids=lambda w: str(w)
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(4, 4), (3, 6), (6, 3)], ids=lambda x: str(x))
def test_sliding_window(window: tuple[int, int], causal: bool, sq: int, sk: int):
    q, k, v = _qkv(2, sq, sk, 4, 2, 8, seed=1)
    got = flash_attn_func(q, k, v, causal=causal, window_size=window)
    _check(got, reference(q, k, v, causal=causal, window_size=window))


@pytest.mark.parametrize("softcap", [0.3, 2.0, 30.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(softcap: float, causal: bool):
    q, k, v = _qkv(2, 3, 6, 6, 3, 8, seed=2)
    q = q * 3  # scores large enough for the cap to matter
    got = flash_attn_func(q, k, v, causal=causal, softcap=softcap, window_size=(2, -1))
    _check(got, reference(q, k, v, causal=causal, softcap=softcap, window_size=(2, -1)))


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_alibi(per_batch: bool, causal: bool, softcap: float):
    q, k, v = _qkv(2, 4, 6, 4, 2, 8, seed=3)
    slopes = torch.rand(2, 4) if per_batch else torch.rand(4)
    got = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, softcap=softcap)
    _check(got, reference(q, k, v, causal=causal, alibi_slopes=slopes, softcap=softcap))


def test_softmax_scale():
    q, k, v = _qkv(2, 3, 3, 2, 2, 8, seed=4)
    _check(
        flash_attn_func(q, k, v, softmax_scale=0.7, causal=True),
        reference(q, k, v, softmax_scale=0.7, causal=True),
    )


@settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(rng=st.randoms(use_true_random=False))
def test_random_calls_match_the_reference(rng: random.Random):
    (q, k, v), kwargs = gen_flash_attn_func(rng)
    _check(flash_attn_func(q, k, v, **kwargs), reference(q, k, v, **kwargs))


def test_packed_variants_equal_the_unpacked_call():
    q, k, v = _qkv(2, 4, 4, 4, 4, 8, seed=5)
    want = flash_attn_func(q, k, v, causal=True, softcap=3.0)
    qkv = torch.stack([q, k, v], dim=2)
    torch.testing.assert_close(flash_attn_qkvpacked_func(qkv, causal=True, softcap=3.0), want)
    kv = torch.stack([k, v], dim=2)
    torch.testing.assert_close(flash_attn_kvpacked_func(q, kv, causal=True, softcap=3.0), want)
    q, k, v = _qkv(2, 3, 5, 6, 2, 8, seed=6)
    kv = torch.stack([k, v], dim=2)
    _check(flash_attn_kvpacked_func(q, kv, causal=True), reference(q, k, v, causal=True))


def test_output_layout_and_dtype():
    q, k, v = _qkv(2, 3, 5, 6, 3, 8)
    out = flash_attn_func(q, k, v)
    assert out.shape == q.shape and out.is_contiguous()
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        qd, kd, vd = (x.to(dtype) for x in (q, k, v))
        for kwargs in ({}, {"softcap": 2.0}, {"causal": True, "alibi_slopes": torch.rand(6)}):
            got = flash_attn_func(qd, kd, vd, **kwargs)
            assert got.dtype == dtype and got.shape == q.shape
            tol = 1e-12 if dtype == torch.float64 else 3e-2
            torch.testing.assert_close(
                got.double(), reference(qd, kd, vd, **kwargs), rtol=tol, atol=tol
            )


def test_gradients_are_finite_and_correct():
    # float64 gradcheck, including rows that see nothing (causal, seqlen_q > seqlen_k)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    for kwargs in ({"causal": True}, {"causal": True, "softcap": 1.0}, {"window_size": (0, 0)}):
        assert torch.autograd.gradcheck(
            lambda q, k, v, kw=kwargs: flash_attn_func(q, k, v, **kw), (q, k, v)
        )
    q32 = torch.randn(2, 5, 4, 8, requires_grad=True)
    kv32 = torch.randn(2, 2, 2, 8, requires_grad=True)
    flash_attn_func(q32, kv32, kv32, causal=True).sum().backward()
    assert torch.isfinite(q32.grad).all() and torch.isfinite(kv32.grad).all()
    assert torch.equal(q32.grad[:, :3], torch.zeros_like(q32.grad[:, :3]))


def test_dropout_uses_sdpa_dropout():
    q, k, v = _qkv(2, 6, 6, 2, 2, 8)
    plain = flash_attn_func(q, k, v)
    for kwargs in ({}, {"softcap": 2.0}):
        torch.manual_seed(0)
        a = flash_attn_func(q, k, v, dropout_p=0.5, **kwargs)
        torch.manual_seed(0)
        b = flash_attn_func(q, k, v, dropout_p=0.5, **kwargs)
        assert torch.equal(a, b)
        assert not torch.allclose(a, flash_attn_func(q, k, v, **kwargs))
    assert torch.equal(flash_attn_func(q, k, v, dropout_p=0.0), plain)


def test_deterministic_is_accepted():
    q, k, v = _qkv(1, 3, 3, 2, 2, 4)
    torch.testing.assert_close(
        flash_attn_func(q, k, v, deterministic=True), flash_attn_func(q, k, v)
    )


def test_return_attn_probs_is_not_in_the_fallback():
    q, k, v = _qkv(1, 3, 3, 2, 2, 4)
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        flash_attn_func(q, k, v, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), return_attn_probs=True)


# ---------------------------------------------------------------------------------------
# varlen
# ---------------------------------------------------------------------------------------


def _varlen_reference(q, k, v, cu_q, cu_k, alibi_slopes=None, **kwargs) -> torch.Tensor:
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for n in range(len(cq) - 1):
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[n]
        part = reference(
            q[cq[n] : cq[n + 1]].unsqueeze(0),
            k[ck[n] : ck[n + 1]].unsqueeze(0),
            v[ck[n] : ck[n + 1]].unsqueeze(0),
            alibi_slopes=slopes,
            **kwargs,
        )
        out[cq[n] : cq[n + 1]] = part[0]
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
def test_varlen(causal: bool, hq: int, hk: int):
    lens_q, lens_k = [3, 1, 4], [2, 5, 4]
    cu_q = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 2, 7, 11], dtype=torch.int32)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(sum(lens_q), hq, 8, generator=g)
    k = torch.randn(sum(lens_k), hk, 8, generator=g)
    v = torch.randn(sum(lens_k), hk, 8, generator=g)
    got = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    _check(got, _varlen_reference(q, k, v, cu_q, cu_k, causal=causal))
    # each sequence alone, through the dense function
    for n in range(3):
        a, b = int(cu_q[n]), int(cu_q[n + 1])
        c, d = int(cu_k[n]), int(cu_k[n + 1])
        dense = flash_attn_func(q[a:b][None], k[c:d][None], v[c:d][None], causal=causal)[0]
        torch.testing.assert_close(got[a:b], dense)


@settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(rng=st.randoms(use_true_random=False))
def test_varlen_random_calls_match_the_reference(rng: random.Random):
    (q, k, v, cu_q, cu_k, max_q, max_k), kwargs = gen_flash_attn_varlen_func(rng)
    got = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    _check(got, _varlen_reference(q, k, v, cu_q, cu_k, **kwargs))


def test_varlen_padding_and_empty_sequences():
    # rows past cu_seqlens_q[-1] are padding (zeros); a sequence may be empty
    cu_q = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 4, 4], dtype=torch.int32)
    q, k, v = torch.randn(7, 2, 4), torch.randn(6, 2, 4), torch.randn(6, 2, 4)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3)
    assert out.shape == (7, 2, 4)
    _check(out[:2], reference(q[None, :2], k[None, :3], v[None, :3])[0])
    assert torch.equal(out[2:], torch.zeros(5, 2, 4))  # sequence 2 has no keys; then padding


def test_varlen_fallback_limits():
    cu = torch.tensor([0, 2], dtype=torch.int32)
    q = torch.randn(2, 2, 4)
    with pytest.raises(NotImplementedError, match="block_table"):
        flash_attn_varlen_func(
            q, q[None], q[None], cu, cu, 2, 2, block_table=torch.zeros(1, 1, dtype=torch.int32)
        )
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        flash_attn_varlen_func(q, q, q, cu, cu, 2, 2, return_attn_probs=True)


def test_gqa_without_sdpa_enable_gqa(monkeypatch: pytest.MonkeyPatch):
    # torch < 2.5 has no enable_gqa: the fallback repeats the key/value heads instead
    from nnscaler_ops_flash_attn import fallback

    monkeypatch.setattr(fallback, "_SDPA_HAS_GQA", False)
    q, k, v = _qkv(2, 3, 5, 6, 2, 8, seed=9)
    for kwargs in ({}, {"causal": True}, {"alibi_slopes": torch.rand(6)}):
        _check(flash_attn_func(q, k, v, **kwargs), reference(q, k, v, **kwargs))
