"""flash_attn_segmented_func computes attention over padded and packed batches exactly, in
the dense layout, and refuses the batches that flash-attn's packed layout cannot hold.

The reference is the definition, in float64 with an explicit mask: token ``i`` sees token
``j`` of its row when both carry the same nonzero id and the causal / window rules allow
it in positions of the row; rows that see nothing are zero.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nnscaler_ops_flash_attn import (
    flash_attn_func,
    flash_attn_segmented_func,
    flash_attn_varlen_func,
    kernels,
)
from nnscaler_ops_flash_attn.annotations import gen_flash_attn_segmented_func

# float32 results against the float64 definition: the project's parity tolerance
RTOL, ATOL = 1e-5, 1e-6


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_ids: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    _, seqlen, nheads, headdim = q.shape
    group = nheads // k.shape[2]
    k, v = k.repeat_interleave(group, 2).double(), v.repeat_interleave(group, 2).double()
    scale = headdim**-0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    ids = segment_ids.long()
    keep = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] != 0)
    i, j = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None, :]
    left, right = window_size
    right = 0 if causal else right
    if left >= 0:
        keep = keep & (j >= i - left)
    if right >= 0:
        keep = keep & (j <= i + right)
    probs = torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", probs, v).float()


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_random_batches_match_the_definition(rng: random.Random):
    (q, k, v, segment_ids), options = gen_flash_attn_segmented_func(rng)
    out = flash_attn_segmented_func(q, k, v, segment_ids, **options)
    torch.testing.assert_close(out, reference(q, k, v, segment_ids, **options), rtol=RTOL,
                               atol=ATOL)


def _qkv(batch: int = 2, seqlen: int = 6, nheads: int = 4, nheads_k: int = 2):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen, nheads, 8, generator=g)
    k = torch.randn(batch, seqlen, nheads_k, 8, generator=g)
    v = torch.randn(batch, seqlen, nheads_k, 8, generator=g)
    return q, k, v


def test_plain_batch_is_one_flash_attn_func_call(monkeypatch: pytest.MonkeyPatch):
    q, k, v = _qkv()
    calls = []
    real = kernels.flash_attn_varlen_func
    monkeypatch.setattr(kernels, "flash_attn_varlen_func",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ids = torch.tensor([[3] * 6, [1] * 6])
    out = flash_attn_segmented_func(q, k, v, ids, causal=True)
    assert calls == []  # no gathering: the dense kernel
    torch.testing.assert_close(out, flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)
    flash_attn_segmented_func(q, k, v, torch.tensor([[1] * 6, [1] * 5 + [0]]), causal=True)
    assert calls == [1]


def test_bool_padding_mask_and_zero_rows():
    q, k, v = _qkv()
    mask = torch.tensor([[True] * 4 + [False] * 2, [False] * 3 + [True] * 3])
    out = flash_attn_segmented_func(q, k, v, mask, causal=True)
    torch.testing.assert_close(out, reference(q, k, v, mask, causal=True), rtol=RTOL, atol=ATOL)
    assert out[0, 4:].abs().sum() == 0 and out[1, :3].abs().sum() == 0
    empty = flash_attn_segmented_func(q, k, v, torch.zeros(2, 6, dtype=torch.int32))
    assert empty.abs().sum() == 0


def test_gradients_match_the_definition():
    q, k, v = (t.double().requires_grad_() for t in _qkv())
    ids = torch.tensor([[1, 1, 2, 2, 2, 0], [0, 0, 1, 1, 1, 1]])
    out = flash_attn_segmented_func(q, k, v, ids, causal=True, window_size=(1, -1))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = reference(q, k, v, ids, causal=True, window_size=(1, -1)).double()
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, exp in zip(grads, want, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)


def test_meta_tensors_give_the_shape():
    """A trace on the meta device (shapes only) runs every function without reading data."""
    q = torch.empty(2, 5, 4, 8, device="meta")
    k = torch.empty(2, 5, 2, 8, device="meta")
    ids = torch.empty(2, 5, dtype=torch.int32, device="meta")
    out = flash_attn_segmented_func(q, k, k, ids, causal=True, window_size=(2, -1))
    assert out.shape == (2, 5, 4, 8) and out.device.type == "meta"
    out = flash_attn_func(q, k, k, causal=True, window_size=(2, -1))
    assert out.shape == (2, 5, 4, 8) and out.device.type == "meta"
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out = flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 5, 5, causal=True)
    assert out.shape == (5, 4, 8) and out.device.type == "meta"


@pytest.mark.parametrize(
    "ids, window, message",
    [
        ([[1, 1, 2, 2, 1, 1]], (-1, -1), "segment id 1 starts again at row 0, token 4"),
        ([[1, 1, 0, 1, 1, 0]], (2, -1), "has padding inside it"),
        ([[1, 1, -1, 1, 1, 1]], (-1, -1), "must be >= 0"),
    ],
)
def test_batches_the_packed_layout_cannot_hold_are_refused(ids, window, message):
    q, k, v = _qkv(batch=1)
    with pytest.raises(ValueError, match=message):
        flash_attn_segmented_func(q, k, v, torch.tensor(ids), causal=True, window_size=window)


def test_padding_inside_a_sequence_is_exact_without_a_window():
    q, k, v = _qkv(batch=1)
    ids = torch.tensor([[1, 1, 0, 1, 2, 2]])
    out = flash_attn_segmented_func(q, k, v, ids, causal=True)
    torch.testing.assert_close(out, reference(q, k, v, ids, causal=True), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "segment_ids, message",
    [
        (torch.ones(2, 5, dtype=torch.int32), r"segment_ids must have shape \(batch, seqlen\)"),
        (torch.ones(2, 6), "must hold integers"),
    ],
)
def test_bad_segment_ids_are_named(segment_ids, message):
    q, k, v = _qkv()
    with pytest.raises((ValueError, TypeError), match=message):
        flash_attn_segmented_func(q, k, v, segment_ids)


def test_one_sequence_length_only():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="one sequence length"):
        flash_attn_segmented_func(q, k[:, :4], v[:, :4], torch.ones(2, 6, dtype=torch.int32))


class _FlashAttnStandIn:
    """flash-attn's two entry points as the op calls them on CUDA, with flash-attn 2.6's
    keyword names and argument types checked, computed by the fallback (no GPU here)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def flash_attn_func(self, q, k, v, *, dropout_p, softmax_scale, causal, window_size,
                        alibi_slopes, deterministic, return_attn_probs, softcap=0.0):
        self.calls.append("flash_attn_func")
        return kernels.fallback.attention(
            q, k, v, kernels.checks.Options(dropout_p, softmax_scale, causal, window_size,
                                            softcap, alibi_slopes))

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, *, dropout_p, softmax_scale, causal, window_size,
                               alibi_slopes, deterministic, return_attn_probs, softcap=0.0):
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        lengths = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        assert max_seqlen_q == int(lengths.max())  # the exact longest, not a bound
        self.calls.append("flash_attn_varlen_func")
        return kernels.fallback.varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            kernels.checks.Options(dropout_p, softmax_scale, causal, window_size, softcap,
                                   alibi_slopes))


def test_the_flash_attn_path_gets_flash_attn_arguments(monkeypatch: pytest.MonkeyPatch):
    """Where flash-attn runs (CUDA), the op calls its functions with their own argument
    names and types: int32 offsets, Python int lengths."""
    stand_in = _FlashAttnStandIn()
    monkeypatch.setattr(kernels, "_use_flash_attn", lambda q: stand_in)
    q, k, v = _qkv(batch=2, seqlen=6)
    ids = torch.tensor([[1, 1, 2, 2, 2, 0], [0, 0, 5, 5, 5, 5]])
    out = flash_attn_segmented_func(q, k, v, ids, causal=True, softcap=3.0, window_size=(1, 1))
    assert stand_in.calls == ["flash_attn_varlen_func"]
    want = reference(q, k, v, ids, causal=True, softcap=3.0, window_size=(1, 1))
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
    plain = flash_attn_segmented_func(q, k, v, torch.ones(2, 6, dtype=torch.int32), causal=True)
    assert stand_in.calls[-1] == "flash_attn_func"
    torch.testing.assert_close(plain, reference(q, k, v, torch.ones(2, 6), causal=True),
                               rtol=RTOL, atol=ATOL)
