"""flash-attention's block kernel inside nnscaler's ring attention, on CPU: a stand-in
``flash_attn`` module (flash-attn's private forward/backward signatures, computed by
nnscaler's math kernel, recording every call) replaces the package in ``sys.modules``,
and `FlashBlockKernel` is told to take CPU float32. The ring must call it with the right
blocks and causal flags (zigzag order included) and give exactly the math ring's
results; packed blocks go to the varlen functions; both signatures of flash-attn 2.6 and
2.7 are spoken, and older releases are not taken."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from nnscaler_ops_flash_attn import kernels
from nnscaler_ops_flash_attn.ring import FlashBlockKernel

from nnscaler.ops.builtin.attention_kernels import MATH, Packed, select_kernel
from nnscaler.ops.builtin.context_parallel import ring_backward, ring_forward, ring_steps, to_zigzag
from nnscaler.ops.partgroup import run_parts
from nnscaler.testing import run_distributed

CPU_KERNEL = dict(devices=("cpu",), dtypes=(torch.float32,))
V26 = ("window_size", "softcap", "alibi_slopes")
V27 = ("window_size_left", "window_size_right", "softcap", "alibi_slopes")


def _b(x):  # flash-attn's (B, L, H, E) -> nnscaler's (B, H, L, E)
    return x.transpose(1, 2)


def _t(x):  # flash-attn's (T, H, E) -> (1, H, T, E)
    return x.transpose(0, 1).unsqueeze(0)


def stand_in(version: str) -> tuple[types.ModuleType, types.ModuleType, list]:
    """``flash_attn`` and its ``flash_attn_interface`` for ``version``; the list records
    ``(function, queries, keys, causal)`` of every call."""
    calls: list = []
    keys = V27 if version >= "2.7" else V26
    old = version < "2.7"  # 2.6's forward returns the padded inputs too

    def check(kw):
        missing = [k for k in keys if k not in kw]
        extra = [k for k in ("window_size", "window_size_left") if k in kw and k not in keys]
        if missing or extra:
            raise TypeError(f"flash-attn {version}: missing {missing}, unexpected {extra}")

    def result(out, lse):
        empty = torch.empty(0)
        return (out, lse, empty, empty) if not old else (out, None, None, None, out, lse,
                                                         empty, empty)

    def fwd(q, k, v, dropout_p, softmax_scale, causal, **kw):
        check(kw)
        calls.append(("fwd", q.shape[1], k.shape[1], causal))
        out, lse = MATH.forward(_b(q), _b(k), _b(v), causal=causal, scale=softmax_scale)
        return result(_b(out).contiguous(), lse)

    def bwd(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, softmax_scale, causal, **kw):
        check(kw)
        calls.append(("bwd", q.shape[1], k.shape[1], causal))
        grads = MATH.backward(_b(dout), _b(q), _b(k), _b(v), _b(out), lse, causal=causal,
                              scale=softmax_scale)
        for buf, g in zip((dq, dk, dv), grads, strict=True):
            buf.copy_(_b(g))

    def varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, **kw):
        check(kw)
        if "block_table" not in kw:  # 2.6 gives it no default
            raise TypeError("missing block_table")
        calls.append(("varlen_fwd", q.shape[0], k.shape[0], causal))
        packed = Packed(cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k)
        out, lse = MATH.forward(_t(q), _t(k), _t(v), causal=causal, scale=softmax_scale,
                                packed=packed)
        lse = lse[0].masked_fill(lse[0] == float("-inf"), float("inf"))  # flash-attn's way
        return result(out[0].transpose(0, 1).contiguous(), lse)

    def varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p,
                   softmax_scale, causal, **kw):
        check(kw)
        calls.append(("varlen_bwd", q.shape[0], k.shape[0], causal))
        packed = Packed(cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k)
        grads = MATH.backward(_t(dout), _t(q), _t(k), _t(v), _t(out), lse.unsqueeze(0),
                              causal=causal, scale=softmax_scale, packed=packed)
        for buf, g in zip((dq, dk, dv), grads, strict=True):
            buf.copy_(g[0].transpose(0, 1))

    fa = types.ModuleType("flash_attn")
    fa.__version__ = version
    fi = types.ModuleType("flash_attn.flash_attn_interface")
    fi._flash_attn_forward, fi._flash_attn_backward = fwd, bwd
    fi._flash_attn_varlen_forward, fi._flash_attn_varlen_backward = varlen_fwd, varlen_bwd
    fa.flash_attn_interface = fi
    return fa, fi, calls


@pytest.fixture
def flash(monkeypatch):
    """Install a flash-attn 2.7 stand-in; returns its call list."""
    def install(version="2.7.4"):
        fa, fi, calls = stand_in(version)
        monkeypatch.setitem(sys.modules, "flash_attn", fa)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fi)
        kernels._flash_attn_module.cache_clear()
        return calls
    yield install
    kernels._flash_attn_module.cache_clear()


def _qkv(seed=0, b=2, hq=4, hk=2, length=8, e=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, length, e, generator=g) for h in (hq, hk, hk, hq)]


def _ring(kernel, q, k, v, dout, n, *, zigzag, causal):
    def part(p):
        def run(group):
            mine = [t.chunk(n, -2)[p] for t in (q, k, v, dout)]
            if zigzag:
                mine = [to_zigzag(t, group, -2) for t in mine]
            step = ring_steps(n, p, mine[0].shape[-2], zigzag=zigzag, causal=causal)
            out, lse = ring_forward(kernel, *mine[:3], group, step, 0.5)
            return (out, *ring_backward(kernel, mine[3], *mine[:3], out, lse, group, step, 0.5))
        return run
    return run_parts([part(p) for p in range(n)])


@pytest.mark.parametrize("zigzag,causal", [(True, True), (False, True), (False, False)])
def test_the_ring_on_flash_attention_is_the_math_ring(flash, zigzag, causal):
    calls = flash()
    q, k, v, dout = _qkv()
    got = _ring(FlashBlockKernel(**CPU_KERNEL), q, k, v, dout, 2, zigzag=zigzag, causal=causal)
    want = _ring(MATH, q, k, v, dout, 2, zigzag=zigzag, causal=causal)
    for mine, theirs in zip(got, want, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    c, h = 4, 2  # chunk and half-chunk of 2 parts of 8 tokens
    if causal and zigzag:  # part 0: its diagonal, then its late half x part 1's block;
        # part 1: its diagonal, then all its queries x part 0's early half
        blocks = [(c, c, True), (c, c, True), (h, c, False), (c, h, False)]
    elif causal:  # part 1 also attends part 0's block; part 0 skips part 1's
        blocks = [(c, c, True), (c, c, True), (c, c, False)]
    else:
        blocks = [(c, c, False)] * 4
    for fn in ("fwd", "bwd"):
        assert sorted(x[1:] for x in calls if x[0] == fn) == sorted(blocks)


def test_the_signatures_of_flash_attn_2_6(flash):
    calls = flash("2.6.3")
    q, k, v, dout = _qkv(seed=1)
    kernel = FlashBlockKernel(**CPU_KERNEL)
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.3)
    want_out, want_lse = MATH.forward(q, k, v, causal=True, scale=0.3)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.3)
    want = MATH.backward(dout, q, k, v, out, lse, causal=True, scale=0.3)
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [c[0] for c in calls] == ["fwd", "bwd"]


def test_packed_blocks_run_the_varlen_kernels(flash):
    """The last sequence has no key in this block: flash-attn's +inf log-sum-exp is the
    ring's -inf."""
    calls = flash()
    q, _, _, dout = _qkv(seed=2, b=1, length=7)
    _, k, v, _ = _qkv(seed=3, b=1, length=5)
    packed = Packed(cu_q=torch.tensor([0, 3, 5, 7], dtype=torch.int32),
                    cu_k=torch.tensor([0, 3, 5, 5], dtype=torch.int32), max_q=3, max_k=3)
    kernel = FlashBlockKernel(**CPU_KERNEL)
    out, lse = kernel.forward(q, k, v, causal=False, scale=0.5, packed=packed)
    want_out, want_lse = MATH.forward(q, k, v, causal=False, scale=0.5, packed=packed)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=False, scale=0.5, packed=packed)
    want = MATH.backward(dout, q, k, v, out, lse, causal=False, scale=0.5, packed=packed)
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [c[0] for c in calls] == ["varlen_fwd", "varlen_bwd"]


def test_where_the_kernel_applies(flash):
    from nnscaler.plugins import NNScalerPluginManager

    q, k, v, _ = _qkv()
    kernel = FlashBlockKernel()
    assert not kernel.accepts(q, k, v)  # CPU float32: not flash-attn's
    assert not kernel.accepts(*(t.half() for t in (q, k, v)))  # CPU
    pm = NNScalerPluginManager(autoload=True)
    assert isinstance(pm.attention_kernels.get("flash_attn"), FlashBlockKernel)
    assert select_kernel(q, k, v, pm.attention_kernels) is MATH
    flash()
    cpu = FlashBlockKernel(**CPU_KERNEL)
    assert cpu.accepts(q, k, v)
    assert not cpu.accepts(q, k, v[..., :4])  # value head dim differs
    assert not cpu.accepts(q[..., :6], k[..., :6], v[..., :6])  # not a multiple of 8
    flash("2.5.9")  # before softcap
    assert not cpu.accepts(q, k, v)


def _worker(rank, world, version):
    """The op on processes: the stand-in kernel registered, the ring takes it."""
    from nnscaler.ops.builtin.context_parallel import context_parallel_attention
    from nnscaler.plugins import get_plugin_manager
    from nnscaler.runtime.partgroup import ProcessPartGroup

    fa, fi, calls = stand_in(version)
    sys.modules.update({"flash_attn": fa, "flash_attn.flash_attn_interface": fi})
    kernels._flash_attn_module.cache_clear()
    get_plugin_manager().attention_kernels.register("flash_attn_cpu", FlashBlockKernel(**CPU_KERNEL))
    group = ProcessPartGroup(list(range(world)))
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 3, 8]))
    packed = (doc[:, None] == doc[None]) & torch.ones(16, 16, dtype=torch.bool).tril()
    for strategy, causal, mask in (("zigzag", True, None), ("ring", False, None),
                                   ("ring", False, packed)):
        q, k, v, up = _qkv(seed=4, length=16)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=causal,
                                              enable_gqa=True)
        want_grads = torch.autograd.grad((want * up).sum(), leaves)
        mine = [t.chunk(world, -2)[rank].clone().requires_grad_(True) for t in (q, k, v)]
        rows = None if mask is None else mask.chunk(world, -2)[rank]
        out = context_parallel_attention(*mine, rows, is_causal=causal, enable_gqa=True,
                                         strategy=strategy, group=group)
        grads = torch.autograd.grad((out * up.chunk(world, -2)[rank]).sum(), mine)
        torch.testing.assert_close(out, want.chunk(world, -2)[rank], rtol=1e-5, atol=1e-6)
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, w.chunk(world, -2)[rank], rtol=1e-5, atol=1e-6)
    return sorted({c[0] for c in calls})


def test_context_parallel_attention_on_processes_runs_flash_attention():
    """Causal (zigzag), full, and packed documents given as a mask (the varlen kernels)."""
    for got in run_distributed(_worker, 2, "2.7.4"):
        assert got == ["bwd", "fwd", "varlen_bwd", "varlen_fwd"]
