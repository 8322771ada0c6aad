"""Attention over blocks of keys, merged by the log-sum-exp rule.

The context-parallel strategies (`nnscaler.ops.builtin.context_parallel`) hold the
sequence in pieces: a part's queries are one or more *segments* of the whole sequence, and
the keys and values arrive block by block. `BlockAttention` attends a part's queries to
one block at a time and keeps, per query segment, the running maximum ``m`` of the scores
(a constant, detached), the sum ``den`` of ``exp(score - m)`` and the numerator
``num = sum exp(score - m) * v``; merging a block rescales both by ``exp(m_old - m_new)``.
The result ``num / den`` does not depend on ``m``, so the gradient taken through the
merge with ``m`` held constant is exact.

Positions are global: a segment ``(start, stop)`` covers the tokens ``start..stop-1`` of
the whole sequence. Under causal masking (query ``i`` sees keys ``j <= i``, the top-left
aligned mask of ``scaled_dot_product_attention`` with ``L == S``) a pair of segments is
skipped when every key lies after every query, and computed without a mask when every key
lies before every query.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["TILE", "BlockAttention", "Segment", "additive_mask", "reduce_to", "tiles"]

#: global token range ``(start, stop)`` of a piece of the sequence
Segment = tuple[int, int]

#: the most tokens of a query or key tile: one product's scores are at most TILE x TILE
#: per head, whatever the chunk (the transient memory of a block stays bounded)
TILE = 512


def tiles(segments: Sequence[Segment], size: int | None = None) -> list[Segment]:
    """``segments`` cut into consecutive pieces of at most ``size`` (`TILE`) tokens."""
    size = TILE if size is None else size
    return [(s, min(s + size, b)) for a, b in segments for s in range(a, b, size)]


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``scaled_dot_product_attention``'s mask as scores to add: a boolean mask (``True``:
    attend) becomes 0 / -inf; a float mask is added as it is."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def reduce_to(grad: torch.Tensor, shape: torch.Size, repeat: int = 1) -> torch.Tensor:
    """The gradient of a tensor of ``shape`` that was broadcast (and its heads, dim -3,
    repeated ``repeat`` times each) to ``grad``'s shape: summed back."""
    if repeat > 1:
        grad = grad.unflatten(-3, (grad.shape[-3] // repeat, repeat)).sum(-3)
    extra = grad.dim() - len(shape)
    if extra:
        grad = grad.sum(tuple(range(extra)))
    dims = tuple(d for d, n in enumerate(shape) if n == 1 and grad.shape[d] != 1)
    return grad.sum(dims, keepdim=True) if dims else grad


class BlockAttention:
    """One part's queries ``q`` (``(..., Lq, E)``, holding ``segments`` in that order),
    attended block by block (`add`); `result` is the attention output.

    ``mask`` is an additive mask whose rows are this part's query rows (or one row that
    broadcasts) and whose columns are the whole sequence (or one column); ``repeat`` is the
    grouped-query factor (query head ``i`` reads key head ``i // repeat``).
    """

    def __init__(self, q: torch.Tensor, segments: Sequence[Segment], *, scale: float,
                 causal: bool, mask: torch.Tensor | None, repeat: int = 1) -> None:
        self.q, self.segments, self.scale = q, tiles(segments), scale
        self.causal, self.mask, self.repeat = causal, mask, repeat
        self.acc: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = (
            [None] * len(self.segments))
        self.pairs = 0  # (query segment, key segment) products computed

    def _rows(self) -> list[tuple[int, Segment]]:
        out, off = [], 0
        for seg in self.segments:
            out.append((off, seg))
            off += seg[1] - seg[0]
        return out

    def add(self, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment]) -> None:
        """Attend to the keys ``k`` and values ``v`` that hold ``segments``."""
        if self.repeat > 1:
            k = k.repeat_interleave(self.repeat, dim=-3)
            v = v.repeat_interleave(self.repeat, dim=-3)
        for i, qoff, qs, koff, ks in self._pairs(segments):
            n = ks[1] - ks[0]
            self._pair(i, qoff, qs, k[..., koff:koff + n, :], v[..., koff:koff + n, :], ks)

    def _scores(self, q: torch.Tensor, qoff: int, qs: Segment, k: torch.Tensor,
                ks: Segment) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) * self.scale
        if self.mask is not None:
            m = self.mask
            if m.shape[-2] != 1:
                m = m[..., qoff:qoff + qs[1] - qs[0], :]
            if m.shape[-1] != 1:
                m = m[..., ks[0]:ks[1]]
            scores = scores + m
        if self.causal and ks[1] - 1 > qs[0]:  # some key after some query
            qpos = torch.arange(qs[0], qs[1], device=q.device).unsqueeze(-1)
            kpos = torch.arange(ks[0], ks[1], device=q.device)
            scores = scores.masked_fill(kpos > qpos, float("-inf"))
        return scores

    def _pairs(self, segments: Sequence[Segment]):
        """``(query segment index, its row offset, its segment, key offset, key segment)``
        for every pair that is not wholly masked."""
        koff = 0
        rows = self._rows()
        for ks in tiles(segments):
            for i, (qoff, qs) in enumerate(rows):
                if not (self.causal and ks[0] > qs[1] - 1):  # some key not after every query
                    yield i, qoff, qs, koff, ks
            koff += ks[1] - ks[0]

    def _pair(self, i: int, qoff: int, qs: Segment, k: torch.Tensor, v: torch.Tensor,
              ks: Segment) -> None:
        q = self.q[..., qoff:qoff + qs[1] - qs[0], :]
        scores = self._scores(q, qoff, qs, k, ks)
        top = scores.detach().amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        p = torch.exp(scores - top)
        num, den = p @ v, p.sum(-1, keepdim=True)
        self.pairs += 1
        acc = self.acc[i]
        if acc is None:
            self.acc[i] = (top, num, den)
            return
        top0, num0, den0 = acc
        new = torch.maximum(top0, top)
        a, b = torch.exp(top0 - new), torch.exp(top - new)
        self.acc[i] = (new, num0 * a + num * b, den0 * a + den * b)

    def lse(self) -> torch.Tensor:
        """The log-sum-exp of every query row's scores (``(..., Lq, 1)``)."""
        parts = [top + den.log() for top, _, den in self.acc]  # type: ignore[misc]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def grad_block(self, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment], *,
                   dout: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor,
                   dq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The backward of `add` for one block, by recomputation (no autograd): adds this
        block's share to ``dq`` in place and returns its ``(dk, dv)`` (the block's
        shape). ``delta`` is ``sum(dout * out, -1)`` of every query row, ``lse`` `lse`."""
        r = self.repeat
        kr = k.repeat_interleave(r, dim=-3) if r > 1 else k
        vr = v.repeat_interleave(r, dim=-3) if r > 1 else v
        dk = torch.zeros(torch.broadcast_shapes(kr.shape, (*dout.shape[:-2], *kr.shape[-2:])),
                         dtype=k.dtype, device=k.device)
        dv = torch.zeros(torch.broadcast_shapes(vr.shape, (*dout.shape[:-2], *vr.shape[-2:])),
                         dtype=v.dtype, device=v.device)
        for _, qoff, qs, koff, ks in self._pairs(segments):
            rows, cols = slice(qoff, qoff + qs[1] - qs[0]), slice(koff, koff + ks[1] - ks[0])
            q = self.q[..., rows, :]
            p = torch.exp(self._scores(q, qoff, qs, kr[..., cols, :], ks) - lse[..., rows, :])
            do = dout[..., rows, :]
            dv[..., cols, :] += p.transpose(-2, -1) @ do
            ds = p * (do @ vr[..., cols, :].transpose(-2, -1) - delta[..., rows, :])
            dq[..., rows, :] += (ds @ kr[..., cols, :]) * self.scale
            dk[..., cols, :] += (ds.transpose(-2, -1) @ q) * self.scale
        return reduce_to(dk, k.shape, r), reduce_to(dv, v.shape, r)

    def result(self, ev: int) -> torch.Tensor:
        """The output ``(..., Lq, Ev)``; a query row that saw no key is NaN, as in
        ``scaled_dot_product_attention``."""
        outs = []
        for acc, seg in zip(self.acc, self.segments, strict=True):
            if acc is None:  # no key at all for this segment
                shape = (*self.q.shape[:-2], seg[1] - seg[0], ev)
                outs.append(torch.full(shape, float("nan"), dtype=self.q.dtype,
                                       device=self.q.device))
                continue
            _, num, den = acc
            outs.append(num / den)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
