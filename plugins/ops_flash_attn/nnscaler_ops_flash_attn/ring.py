"""flash-attention's kernels inside nnscaler's ring attention.

nnscaler's context-parallel attention (ring and zigzag ring) attends this device's
queries to one key/value block at a time and merges the blocks by their log-sum-exp
(`nnscaler.ops.builtin.attention_kernels`). `FlashBlockKernel` runs those blocks with
flash-attention's forward and backward (``flash_attn.flash_attn_interface``'s
``_flash_attn_forward`` / ``_flash_attn_backward``, and the varlen pair for packed
sequences): the forward gives the block's output and log-sum-exp, the backward takes the
whole attention's output and log-sum-exp, as the ring needs. The plugin registers it
through ``nnscaler_register_attention_kernels`` (`nnscaler_ops_flash_attn.plugin`); the
ring picks it for CUDA tensors in float16 or bfloat16 with head dims flash-attention
takes (equal for queries, keys and values, a multiple of 8, at most 256) when
``flash_attn`` imports, and runs nnscaler's math kernel otherwise.

flash-attn 2.6 and 2.7+ differ in these private functions: 2.7 splits ``window_size``
into ``window_size_left`` and ``window_size_right``, and 2.6's forward also returns the
padded inputs. Both are handled here; releases before 2.6 (no ``softcap``) are not taken.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType

import torch

from nnscaler.extend import BlockKernel, Packed
from nnscaler_ops_flash_attn import kernels

__all__ = ["FlashBlockKernel"]

HALF = (torch.float16, torch.bfloat16)


def _interface() -> ModuleType:
    return importlib.import_module("flash_attn.flash_attn_interface")


def _version(module: ModuleType) -> tuple[int, ...]:
    """``(major, minor)`` of the ``flash_attn`` package ``module`` belongs to."""
    fa = importlib.import_module(module.__name__.split(".")[0])
    parts = str(getattr(fa, "__version__", "0")).split(".")
    return tuple(int(p) for p in (parts + ["0", "0"])[:2] if p.isdigit())


def _window(module: ModuleType) -> dict:
    """No window (full or causal attention), in this release's keywords."""
    if _version(module) >= (2, 7):
        return {"window_size_left": -1, "window_size_right": -1}
    return {"window_size": (-1, -1)}


def _out_lse(result: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, softmax_lse)`` of a forward's result (4 items from 2.7 on, 8 in 2.6)."""
    return (result[0], result[1]) if len(result) == 4 else (result[0], result[5])


def _bshd(x: torch.Tensor) -> torch.Tensor:  # (B, H, L, E) -> flash-attn's (B, L, H, E)
    return x.transpose(1, 2).contiguous()


def _thd(x: torch.Tensor) -> torch.Tensor:  # (1, H, T, E) -> flash-attn's (T, H, E)
    return x[0].transpose(0, 1).contiguous()


class FlashBlockKernel(BlockKernel):
    """flash-attention as ring attention's block kernel (see the module docs).
    ``devices`` and ``dtypes`` are where it applies (CUDA, half precision: flash-attn's
    own limits)."""

    name = "flash_attn"

    def __init__(self, *, devices: tuple[str, ...] = ("cuda",),
                 dtypes: tuple[torch.dtype, ...] = HALF) -> None:
        self.devices, self.dtypes = devices, dtypes

    def accepts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        e = q.shape[-1]
        return (q.device.type in self.devices and q.dtype in self.dtypes
                and k.dtype == v.dtype == q.dtype and k.shape[-1] == v.shape[-1] == e
                and e % 8 == 0 and e <= 256 and kernels.flash_attn_available()
                and _version(_interface()) >= (2, 6))

    def forward(self, q, k, v, *, causal, scale, packed: Packed | None = None):
        fi = _interface()
        opts = dict(causal=causal, **_window(fi), softcap=0.0, alibi_slopes=None,
                    return_softmax=False)
        if packed is None:
            out, lse = _out_lse(fi._flash_attn_forward(_bshd(q), _bshd(k), _bshd(v), 0.0,
                                                       scale, **opts))
            return out.transpose(1, 2), lse
        out, lse = _out_lse(fi._flash_attn_varlen_forward(  # 2.6 has no default block_table
            _thd(q), _thd(k), _thd(v), packed.cu_q, packed.cu_k, packed.max_q, packed.max_k,
            0.0, scale, **opts, block_table=None))
        # a sequence with no key in this block: flash-attn writes lse +inf, the ring -inf
        lse = lse.masked_fill(lse == math.inf, -math.inf)
        return out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale,
                 packed: Packed | None = None):
        fi = _interface()
        lay = _bshd if packed is None else _thd
        q2, k2, v2 = lay(q), lay(k), lay(v)
        dq, dk, dv = torch.empty_like(q2), torch.empty_like(k2), torch.empty_like(v2)
        opts = dict(causal=causal, **_window(fi), softcap=0.0, alibi_slopes=None,
                    deterministic=False, rng_state=None)
        if packed is None:
            fi._flash_attn_backward(lay(dout), q2, k2, v2, lay(out), lse.contiguous(), dq, dk,
                                    dv, 0.0, scale, **opts)
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        fi._flash_attn_varlen_backward(lay(dout), q2, k2, v2, lay(out), lse[0].contiguous(),
                                       dq, dk, dv, packed.cu_q, packed.cu_k, packed.max_q,
                                       packed.max_k, 0.0, scale, **opts)
        return tuple(g.transpose(0, 1).unsqueeze(0) for g in (dq, dk, dv))
