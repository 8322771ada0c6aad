"""The ``ring-flash`` check: nnscaler's ring attention with flash-attention's block kernel.

Four parts of a ring (threads joined by a ``PartGroup``, on the one GPU) run the ring's
forward and backward (`ring_forward` / `ring_backward` of
`nnscaler.ops.builtin.context_parallel`) in bf16 with the plugin's `FlashBlockKernel`,
plain ring and zigzag, causal, GQA. Parity: the output and the query/key/value gradients
against ``scaled_dot_product_attention`` in float32 on the whole sequence, whose error
must stay within twice that of ``flash_attn_func`` on the whole sequence in bf16 (plus
1e-3): splitting the sequence adds no error beyond the half-precision kernel's own. Time:
the ring's forward + backward on flash-attention against the same ring on the math kernel
(matmuls in tiles). SKIP where flash_attn does not import or there is no CUDA.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import torch
import torch.nn.functional as F
from gpu_common import Context, Result

PARTS, HEADS, KV_HEADS, DIM = 4, 8, 2, 128
SEQ = {"cuda": 8192, "cpu": 256}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _run_ring(kernel, q, k, v, dout, *, zigzag: bool):
    """Forward + backward of the ring on ``PARTS`` threads; outputs and gradients in the
    order of the whole sequence."""
    from nnscaler.ops.builtin.context_parallel import (
        from_zigzag,
        ring_backward,
        ring_forward,
        ring_steps,
        to_zigzag,
    )
    from nnscaler.ops.partgroup import run_parts

    def part(p: int):
        def run(group):
            mine = [t.chunk(PARTS, -2)[p] for t in (q, k, v, dout)]
            if zigzag:
                mine = [to_zigzag(t, group, -2) for t in mine]
            step = ring_steps(PARTS, p, mine[0].shape[-2], zigzag=zigzag, causal=True)
            out, lse = ring_forward(kernel, *mine[:3], group, step, DIM ** -0.5)
            res = (out, *ring_backward(kernel, mine[3], *mine[:3], out, lse, group, step,
                                       DIM ** -0.5))
            return [from_zigzag(t, group, -2) for t in res] if zigzag else list(res)
        return run

    parts = run_parts([part(p) for p in range(PARTS)])
    return [torch.cat([r[i] for r in parts], -2) for i in range(4)]


def ring_flash(ctx: Context) -> list[Result]:
    if not ctx.cuda or importlib.util.find_spec("flash_attn") is None:
        return [Result("SKIP", "ring-flash", "needs flash_attn and CUDA (pip install "
                       "'./plugins/ops_flash_attn[cuda]')")]
    from flash_attn import flash_attn_func
    from nnscaler_ops_flash_attn.ring import FlashBlockKernel

    from nnscaler.ops.builtin.attention_kernels import MATH

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    seq = SEQ[ctx.device]
    q = torch.randn(1, HEADS, seq, DIM, device=dev, generator=g)
    k, v = (torch.randn(1, KV_HEADS, seq, DIM, device=dev, generator=g) for _ in range(2))
    dout = torch.randn(1, HEADS, seq, DIM, device=dev, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    want = [ref.detach(), *torch.autograd.grad(ref, leaves, dout)]
    half = [t.bfloat16() for t in (q, k, v, dout)]
    whole = [t.transpose(1, 2).contiguous().requires_grad_(True) for t in half[:3]]
    w_out = flash_attn_func(*whole, causal=True)
    w_grads = torch.autograd.grad(w_out, whole, half[3].transpose(1, 2))
    base = [_rel(a.transpose(1, 2), b) for a, b in zip([w_out.detach(), *w_grads], want)]
    kernel = FlashBlockKernel()
    figures: dict[str, Any] = {"seq": seq, "parts": PARTS, "whole_flash_error": base}
    problems = []
    for zigzag in (False, True):
        name = "zigzag" if zigzag else "ring"
        got = _run_ring(kernel, *half, zigzag=zigzag)
        errors = [_rel(a, b) for a, b in zip(got, want)]
        figures[f"{name}_error"] = errors
        bad = [f"{w} {e:.2e} > {2 * b + 1e-3:.2e}" for w, e, b in zip(
            ("out", "dq", "dk", "dv"), errors, base) if e > 2 * b + 1e-3]
        problems += [f"{name}: {x}" for x in bad]
    times = {}
    for label, kern in (("flash", kernel), ("math", MATH)):
        _run_ring(kern, *half, zigzag=True)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            _run_ring(kern, *half, zigzag=True)
        torch.cuda.synchronize()
        times[label] = (time.perf_counter() - t0) / 3
    figures.update(times=times, speedup=times["math"] / times["flash"], problems=problems)
    line = (f"{PARTS} parts, {seq} tokens, bf16 causal GQA: max rel. error out/dq/dk/dv "
            f"zigzag {'/'.join(f'{e:.1e}' for e in figures['zigzag_error'])} (whole "
            f"flash_attn_func {'/'.join(f'{e:.1e}' for e in base)}); zigzag fwd+bwd "
            f"{times['flash'] * 1e3:.1f} ms on flash-attention vs {times['math'] * 1e3:.1f} ms "
            f"on the math kernel ({figures['speedup']:.1f}x)")
    if problems:
        line += "; " + "; ".join(problems)
    return [Result("FAIL" if problems else "PASS", "ring-flash", line, figures)]
