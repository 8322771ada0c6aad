"""Block kernels: one block of queries attended to one block of keys, with the
log-sum-exp of every query row, the unit that ring attention merges.

A kernel is a `BlockKernel`: ``forward(q, k, v, *, causal, scale, packed=None) -> (out,
lse)`` and the matching ``backward(dout, q, k, v, out, lse, *, causal, scale,
packed=None) -> (dq, dk, dv)``, on ``scaled_dot_product_attention``'s layout:

- ``q`` ``(B, Hq, L, E)``, ``k`` ``(B, Hk, S, E)``, ``v`` ``(B, Hk, S, Ev)``, with ``Hk``
  dividing ``Hq`` (query head ``i`` reads key/value head ``i // (Hq / Hk)``);
- ``out`` ``(B, Hq, L, Ev)``; ``lse`` ``(B, Hq, L)``, the log-sum-exp of each query row's
  scaled scores, in float32 or wider;
- ``causal``: the block is a diagonal one (``L == S``, queries and keys the same
  positions): query ``i`` sees keys ``j <= i``. The ring asks for nothing else, so
  flash-attention's bottom-right alignment and ``scaled_dot_product_attention``'s
  top-left one agree;
- ``packed`` (`Packed`): the rows are packed sequences (flash-attention's varlen layout,
  ``B == 1``): sequence ``m`` is query rows ``cu_q[m]:cu_q[m + 1]`` and key rows
  ``cu_k[m]:cu_k[m + 1]``, and no row sees another sequence's keys. A query row that sees
  no key has ``out`` 0 and ``lse`` ``-inf``;
- ``backward`` takes the *whole* attention's ``out`` and ``lse`` (merged over every
  block of keys), not the block's own: the probabilities ``exp(score - lse)`` are then
  the whole softmax's and the block's gradients are exact shares of the whole op's.

`MATH` computes blocks with matmuls (`nnscaler.ops.builtin.attention_blocks`, in tiles
of bounded memory), on any device and dtype. Other kernels come from plugins through the
``nnscaler_register_attention_kernels`` hook (``plugins/ops_flash_attn`` registers
flash-attention's); `select_kernel` takes the last registered kernel that ``accepts``
the tensors, so a plugin's kernel wins where it applies and `MATH` runs everywhere else.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from nnscaler.ops.builtin.attention_blocks import BlockAttention

__all__ = ["MATH", "BlockKernel", "MathKernel", "Packed", "select_kernel", "validate_kernel"]


@attrs.frozen
class Packed:
    """Packed sequences of one block (flash-attention's varlen arguments): ``cu_q`` and
    ``cu_k`` are int32 cumulative lengths (``nseqs + 1`` each, from 0), ``max_q`` and
    ``max_k`` the longest sequence of each."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    def spans(self) -> list[tuple[int, int, int, int]]:
        """``(q_start, q_stop, k_start, k_stop)`` of every sequence."""
        q, k = self.cu_q.tolist(), self.cu_k.tolist()
        return [(q[m], q[m + 1], k[m], k[m + 1]) for m in range(len(q) - 1)]


class BlockKernel:
    """The interface of a block kernel (see the module docs). ``name`` is what it is
    registered under; ``accepts`` says whether it can run these tensors (device, dtype,
    head dims): `select_kernel` asks it before every ring."""

    name = "block kernel"

    def accepts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                scale: float, packed: Packed | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                 scale: float, packed: Packed | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _check_block(q: torch.Tensor, k: torch.Tensor, causal: bool) -> int:
    """The grouped-query factor of a block call; a causal block must be diagonal."""
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"a causal block is a diagonal one (as many queries as keys); got "
                         f"{q.shape[-2]} queries and {k.shape[-2]} keys")
    return q.shape[-3] // k.shape[-3]


class MathKernel(BlockKernel):
    """Blocks by matmuls in tiles (`BlockAttention`): any device, any float dtype."""

    name = "math"

    def accepts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        return True

    def forward(self, q, k, v, *, causal, scale, packed=None):
        if packed is not None:
            return self._packed_forward(q, k, v, causal=causal, scale=scale, packed=packed)
        repeat = _check_block(q, k, causal)
        att = BlockAttention(q, [(0, q.shape[-2])], scale=scale, causal=causal, mask=None,
                             repeat=repeat)
        att.add(k, v, [(0, k.shape[-2])])
        return att.result(v.shape[-1]), att.lse().squeeze(-1)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, packed=None):
        if packed is not None:
            return self._packed_backward(dout, q, k, v, out, lse, causal=causal,
                                         scale=scale, packed=packed)
        repeat = _check_block(q, k, causal)
        att = BlockAttention(q, [(0, q.shape[-2])], scale=scale, causal=causal, mask=None,
                             repeat=repeat)
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        dk, dv = att.grad_block(k, v, [(0, k.shape[-2])], dout=dout, delta=delta,
                                lse=lse.unsqueeze(-1), dq=dq)
        return dq, dk, dv

    def _packed_forward(self, q, k, v, *, causal, scale, packed):
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        for qa, qb, ka, kb in packed.spans():
            if qb == qa or kb == ka:  # no query, or no key: the rows stay 0 / -inf
                continue
            o, m = self.forward(q[..., qa:qb, :], k[..., ka:kb, :], v[..., ka:kb, :],
                                causal=causal, scale=scale)
            out[..., qa:qb, :], lse[..., qa:qb] = o, m
        return out, lse

    def _packed_backward(self, dout, q, k, v, out, lse, *, causal, scale, packed):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for qa, qb, ka, kb in packed.spans():
            if qb == qa or kb == ka:
                continue
            rows, cols = slice(qa, qb), slice(ka, kb)
            g = self.backward(dout[..., rows, :], q[..., rows, :], k[..., cols, :],
                              v[..., cols, :], out[..., rows, :], lse[..., rows],
                              causal=causal, scale=scale)
            dq[..., rows, :], dk[..., cols, :], dv[..., cols, :] = g
        return dq, dk, dv


#: the built-in kernel, registered as ``"math"`` by `nnscaler.ops.builtin`
MATH = MathKernel()


def validate_kernel(name: str, obj: Any) -> None:
    """The ``validate`` of the attention-kernel registry: a `BlockKernel`-like object."""
    missing = [m for m in ("accepts", "forward", "backward") if not callable(getattr(obj, m, None))]
    if missing:
        raise TypeError(
            f"it has no {', '.join(missing)}; an attention kernel is an object with "
            f"accepts(q, k, v), forward(q, k, v, *, causal, scale, packed=None) and "
            f"backward(dout, q, k, v, out, lse, *, causal, scale, packed=None). Fix: "
            f"subclass nnscaler.extend.BlockKernel")


def select_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  registry: Any = None) -> BlockKernel:
    """The kernel that runs the blocks of these tensors: the last registered (a plugin's
    before the built-in) whose ``accepts`` is true; `MATH` when none is."""
    if registry is None:
        from nnscaler.registry import active_registry

        registry = active_registry("attention_kernels")
    for name in reversed(registry.names()):
        kernel = registry.get(name)
        if kernel.accepts(q, k, v):
            return kernel
    return MATH
