"""Context parallelism: ``scaled_dot_product_attention`` split along the sequence.

Each part holds one contiguous chunk of the queries, keys and values (``L == S``, chunk
``p`` of ``n`` on part ``p``); the parts run `context_parallel_attention`, a part op
whose parts talk through their `PartGroup`, by one of four strategies:

``"ring"``
    The key/value chunks go around the parts (``send_recv`` to the next part, ``n - 1``
    steps) and each part merges its partial results by the log-sum-exp rule
    (`BlockAttention`). The backward is autograd's: every received block's gradient goes
    back the way the block came, so the gradient blocks travel the ring backwards.
``"zigzag"``
    The ring under causal masking, balanced: the parts first swap halves of their chunks
    so that part ``p`` holds half-chunks ``p`` and ``2n - 1 - p`` (one early, one late),
    run the ring, and swap the output back. Every part then computes the same number of
    query/key products; in a plain causal ring part ``n - 1`` computes ``n`` blocks while
    part 0 computes one. The sequence must divide by ``2 n``.
``"ulysses"``
    An all-to-all (``n - 1`` ``send_recv`` rounds) turns the sequence split into a split
    of the heads, each part attends its heads over the whole sequence, and a second
    all-to-all turns it back. The key/value heads must divide by ``n``.
``"allgather"``
    Every part gathers all keys and values and attends its own queries: the simplest
    plan, with ``n`` times the key/value memory.

On processes, without a mask (or with a mask of packed documents in the plain ring:
`nnscaler.ops.builtin.attention_documents`), the ring runs each step on a block kernel
(`nnscaler.ops.builtin.attention_kernels`: the math kernel, or a plugin's such as
flash-attention's) and merges the blocks' outputs by their log-sum-exp (`ring_forward`,
`ring_backward`; the steps by `ring_steps` and `document_steps`).

Split ``scaled_dot_product_attention`` along the key's sequence dim (``idx=1``) for the
ring (zigzag when causal and the sequence divides by ``2 n``) and along the value's
(``idx=2``) for Ulysses; `nnscaler.policies.sequence` does this by name.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch
import torch.nn.functional as F

from nnscaler.anno.partgroup import SINGLE, PartGroup, ThreadPartGroup
from nnscaler.anno.transform import Replicate, Split, TransformRule
from nnscaler.errors import ContextParallelError
from nnscaler.ops.builtin._common import is_tensor
from nnscaler.ops.builtin.attention_blocks import (
    BlockAttention,
    Segment,
    additive_mask,
    reduce_to,
)
from nnscaler.ops.builtin.attention_documents import (
    Documents,
    block_pack,
    documents_of,
    flat,
    unflat,
)
from nnscaler.ops.builtin.attention_kernels import select_kernel
from nnscaler.ops.builtin.nn import f64
from nnscaler.ops.registry import OpRegistry

__all__ = [
    "CONTEXT_PARALLEL_ATTENTION",
    "STRATEGIES",
    "ContextParallelError",
    "context_parallel_attention",
    "sequence_rules",
]

CONTEXT_PARALLEL_ATTENTION = "nnscaler.ops.builtin.context_parallel.context_parallel_attention"
STRATEGIES = ("ring", "zigzag", "ulysses", "allgather")
_OP = "context_parallel_attention"


# -- moving pieces between the parts -----------------------------------------------------


def _zig(c: int, n: int) -> int:
    """The part that holds half-chunk ``c`` (of ``2 n``) in zigzag order."""
    return c if c < n else 2 * n - 1 - c


def to_zigzag(x: torch.Tensor, group: PartGroup, dim: int) -> torch.Tensor:
    """Part ``p`` holds half-chunks ``2p, 2p+1`` along ``dim``; return half-chunks
    ``p, 2n-1-p`` (two ``send_recv`` rounds; each round's destinations are a permutation)."""
    n, i = group.size, group.index
    got: dict[int, torch.Tensor] = {}
    for parity, half in enumerate(x.chunk(2, dim)):
        src = next(q for q in range(n) if _zig(2 * q + parity, n) == i)
        got[2 * src + parity] = group.send_recv(half, _zig(2 * i + parity, n), src)
    return torch.cat([got[i], got[2 * n - 1 - i]], dim)


def from_zigzag(x: torch.Tensor, group: PartGroup, dim: int) -> torch.Tensor:
    """The inverse of `to_zigzag`."""
    n, i = group.size, group.index
    lo, hi = x.chunk(2, dim)
    out = []
    for parity in (0, 1):
        c, piece = (i, lo) if i % 2 == parity else (2 * n - 1 - i, hi)
        out.append(group.send_recv(piece, c // 2, _zig(2 * i + parity, n)))
    return torch.cat(out, dim)


def all_to_all(pieces: list[torch.Tensor], group: PartGroup) -> list[torch.Tensor]:
    """Send ``pieces[j]`` to part ``j``; return what every part sent here, in part order
    (``n - 1`` rounds of ``send_recv``, round ``t`` shifting by ``t``)."""
    n, i = group.size, group.index
    out: list[torch.Tensor] = [pieces[i]] * n
    for t in range(1, n):
        out[(i - t) % n] = group.send_recv(pieces[(i + t) % n], (i + t) % n, (i - t) % n)
    return out


# -- the part op -----------------------------------------------------------------------


def _fail(rule: str, seen: str, fix: str) -> ContextParallelError:
    return ContextParallelError(f"{_OP}: {rule}; got {seen}. {fix}")


def _check(query, key, value, mask, dropout_p, strategy, group, enable_gqa) -> int:
    """Validate a call; return the grouped-query factor."""
    if strategy not in STRATEGIES:
        raise _fail(f"strategy is one of {STRATEGIES}", repr(strategy), "Pick one of them")
    if dropout_p:
        raise _fail("attention split along the sequence has no dropout (the parts cannot "
                    "draw the whole op's random mask)", f"dropout_p={dropout_p}",
                    "Pass dropout_p=0.0, or do not split the sequence")
    if query.dim() < 2 or key.shape[-2] != query.shape[-2]:
        raise _fail("queries and keys must hold chunks of one sequence (L == S)",
                    f"query {tuple(query.shape)}, key {tuple(key.shape)}",
                    "Split self-attention only")
    if strategy == "zigzag" and query.shape[-2] % 2:
        raise _fail(f"zigzag needs an even chunk (the sequence divisible by 2 x {group.size} "
                    f"parts)", f"a chunk of {query.shape[-2]} tokens",
                    "Pad the sequence to a multiple of 2 x the degree, or use strategy='ring'")
    if is_tensor(mask) and mask.dim() >= 2 and mask.shape[-1] not in (1, key.shape[-2] * group.size):
        raise _fail("a mask split along the sequence keeps every key column (or one that "
                    "broadcasts)", f"mask {tuple(mask.shape)} for {key.shape[-2] * group.size} keys",
                    "Pass the mask with all key columns")
    repeat = 1
    if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
    return repeat


def context_parallel_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
    enable_gqa=False, strategy="ring", group=SINGLE,
):
    """``scaled_dot_product_attention`` on this part's chunk of the sequence (chunk
    ``group.index`` of ``group.size``, queries, keys and values alike), the parts joined
    by ``group``: returns this chunk of the whole op's output. ``attn_mask`` holds this
    chunk's rows (or one row) and every key column (or one); ``strategy`` is one of
    `STRATEGIES` (see the module docs)."""
    repeat = _check(query, key, value, attn_mask, dropout_p, strategy, group, enable_gqa)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    mask = additive_mask(attn_mask if is_tensor(attn_mask) else None, query.dtype)
    if mask is not None and mask.dim() < 2:
        mask = mask.reshape(1, -1)
    n, i, c = group.size, group.index, query.shape[-2]
    opts = dict(scale=scale, causal=bool(is_causal), repeat=repeat)
    if strategy == "ulysses":
        return _ulysses(query, key, value, mask, group, opts)
    if strategy == "allgather":
        att = BlockAttention(query, [(i * c, (i + 1) * c)], mask=mask, **opts)
        keys, values = group.all_gather(key), group.all_gather(value)
        for j in range(n):
            att.add(keys[j], values[j], [(j * c, (j + 1) * c)])
        return att.result(value.shape[-1])
    if strategy == "zigzag":
        h = c // 2
        query, key, value = (to_zigzag(t, group, -2) for t in (query, key, value))
        if mask is not None and mask.shape[-2] != 1:
            mask = to_zigzag(mask, group, -2)

        def segments(p: int) -> list[Segment]:
            return [(p * h, (p + 1) * h), ((2 * n - 1 - p) * h, (2 * n - p) * h)]
    else:
        def segments(p: int) -> list[Segment]:
            return [(p * c, (p + 1) * c)]
    out = _ring(query, key, value, mask, group, segments, opts, zigzag=strategy == "zigzag")
    return from_zigzag(out, group, -2) if strategy == "zigzag" else out


def _ring(query, key, value, mask, group, segments, opts, *, zigzag: bool) -> torch.Tensor:
    """The ring on this part's pieces: by autograd through ``send_recv`` where the parts
    are threads of one process (their backward runs in one thread, so it cannot talk),
    or where the mask takes gradients; without a mask, on whole batches of heads, by
    `_KernelRing` (blocks by the kernel `select_kernel` picks); otherwise by
    `_RingAttention`. Both keep only their own chunk for the backward."""
    if isinstance(group, ThreadPartGroup) or (mask is not None and mask.requires_grad):
        return _ring_autograd(query, key, value, mask, group, segments, opts)
    if not _kernel_shapes(query, key, value, opts["repeat"]):
        return _RingAttention.apply(query, key, value, mask, group, segments, opts)
    n, i, c = group.size, group.index, query.shape[-2]
    step = None
    if mask is None:
        step = ring_steps(n, i, c, zigzag=zigzag, causal=opts["causal"])
    elif not zigzag and not opts["causal"]:  # packed documents, read from the mask
        docs = documents_of(mask, query.shape[0], c, i * c)
        step = None if docs is None else document_steps(docs, n, i, query.device)
    if step is not None:
        kernel = select_kernel(query, key, value)
        return _KernelRing.apply(query, key, value, group, step, kernel, opts["scale"])
    return _RingAttention.apply(query, key, value, mask, group, segments, opts)


# -- the ring on block kernels -----------------------------------------------------------

#: ``(query rows, key rows, diagonal)`` of this part's queries and the block in hand
Step = tuple[slice, slice, bool]


def _kernel_shapes(query, key, value, repeat: int) -> bool:
    """Whole batches of heads, as a block kernel takes them: ``(B, H, L, E)`` with one
    batch size, key and value heads alike, ``repeat`` query heads to each (1 unless
    ``enable_gqa``: other shapes go the way that raises as the whole op does)."""
    if not (query.dim() == key.dim() == value.dim() == 4):
        return False
    return (query.shape[0] == key.shape[0] == value.shape[0]
            and key.shape[1] == value.shape[1] and query.shape[1] == key.shape[1] * repeat)


def ring_steps(n: int, i: int, chunk: int, *, zigzag: bool, causal: bool):
    """What part ``i`` of ``n`` computes with the key/value block of part ``src``:
    a `Step`, or None (every key after every query). The cases (``h = chunk / 2``;
    in zigzag order part ``p`` holds half-chunks ``p`` and ``2n - 1 - p``)::

        case                     src < i               src == i       src > i
        1 not causal             all x all             all x all      all x all
        2 causal ring            all x all             diagonal       nothing
        3 causal zigzag          all x keys[:h]        diagonal       queries[h:] x all

    Case 3: an earlier part's early half-chunk precedes both of ours and its late one
    follows both; a later part's early half-chunk precedes only our late one, and its
    late one precedes it too. The diagonal step of zigzag is the causal mask of the
    part's own two half-chunks, in their order."""
    every, h = slice(0, chunk), chunk // 2

    def step(src: int) -> Step | None:
        if not causal:
            return every, every, False
        if src == i:
            return every, every, True
        if not zigzag:
            return (every, every, False) if src < i else None
        return (every, slice(0, h), False) if src < i else (slice(h, chunk), every, False)
    return step


def document_steps(docs: Documents, n: int, i: int, device: torch.device):
    """`ring_steps` for packed documents (`documents_of`): every step takes all the
    rows and keys, as sequences (the fourth item, a `BlockPack`); the diagonal block is
    causal where the documents are, and under causal masking later blocks are skipped."""
    packs: dict[int, Any] = {}
    every = slice(0, docs.chunk)

    def step(src: int):
        if docs.causal and src > i:
            return None
        if src not in packs:
            packs[src] = block_pack(docs, src, device)
        pack = packs[src]
        return None if pack is None else (every, every, docs.causal and src == i, pack)
    return step


def _block_forward(kernel, query, k, v, s, scale):
    rows, cols, diag, *pack = s
    if not pack:
        return kernel.forward(query[..., rows, :], k[..., cols, :], v[..., cols, :],
                              causal=diag, scale=scale)
    b, keys = query.shape[0], pack[0].keys
    o, m = kernel.forward(flat(query), flat(k)[..., keys, :], flat(v)[..., keys, :],
                          causal=diag, scale=scale, packed=pack[0].packed)
    return unflat(o, b), unflat(m, b)


def _block_backward(kernel, dout, query, k, v, out, lse, s, scale):
    rows, cols, diag, *pack = s
    if not pack:
        return kernel.backward(dout[..., rows, :], query[..., rows, :], k[..., cols, :],
                               v[..., cols, :], out[..., rows, :], lse[..., rows],
                               causal=diag, scale=scale)
    b, keys = query.shape[0], pack[0].keys
    fk, fv = flat(k), flat(v)
    gq, gk, gv = kernel.backward(flat(dout), flat(query), fk[..., keys, :], fv[..., keys, :],
                                 flat(out), flat(lse), causal=diag, scale=scale,
                                 packed=pack[0].packed)
    return (unflat(gq, b), unflat(torch.zeros_like(fk).index_add_(-2, keys, gk), b),
            unflat(torch.zeros_like(fv).index_add_(-2, keys, gv), b))


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, o: torch.Tensor,
           m: torch.Tensor) -> None:
    """Merge a block's ``(o, m)`` into rows ``rows`` of ``(out, lse)`` by the
    log-sum-exp rule, in place (a row that saw no key has ``lse`` -inf and stays so)."""
    old_o, old_m = out[..., rows, :], lse[..., rows]
    top = torch.maximum(old_m, m)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    a, b = torch.exp(old_m - top), torch.exp(m - top)
    den = a + b
    lse[..., rows] = top + den.log()
    den = torch.where(den > 0, den, torch.ones_like(den))
    out[..., rows, :] = (old_o * a.unsqueeze(-1) + o * b.unsqueeze(-1)) / den.unsqueeze(-1)


def _wide(x: torch.Tensor) -> torch.dtype:
    """The dtype partial results add up in: float32 for half precision."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def ring_forward(kernel, query, key, value, group: PartGroup, step, scale: float):
    """The ring's forward on a block kernel: ``(out, lse)`` of this part's queries
    (``out`` in the queries' dtype, ``lse`` as the kernel gives it, widened)."""
    n, i = group.size, group.index
    out = lse = None
    k, v = key, value
    for t in range(n):
        s = step((i - t) % n)
        if s is not None:
            rows = s[0]
            o, m = _block_forward(kernel, query, k, v, s, scale)
            if out is None:  # the first step computed covers every row
                out, lse = o.to(_wide(o)), m.to(torch.promote_types(m.dtype, _wide(o)))
            else:
                _merge(out, lse, rows, o.to(out.dtype), m.to(lse.dtype))
        if t < n - 1:
            k, v = _shift(group, k, v)
    return out.to(query.dtype), lse


def ring_backward(kernel, dout, query, key, value, out, lse, group: PartGroup, step,
                  scale: float):
    """The ring's backward on a block kernel: the key/value blocks go around again, and
    each block's gradients travel with it (added up in `_wide` precision) until a last
    step takes them home; returns ``(dq, dk, dv)``."""
    n, i = group.size, group.index
    dq = torch.zeros(query.shape, dtype=_wide(query), device=query.device)
    k, v = key, value
    dk = torch.zeros(key.shape, dtype=_wide(key), device=key.device)
    dv = torch.zeros(value.shape, dtype=_wide(value), device=value.device)
    for t in range(n):
        s = step((i - t) % n)
        if s is not None:
            rows, cols = s[0], s[1]
            gq, gk, gv = _block_backward(kernel, dout, query, k, v, out, lse, s, scale)
            dq[..., rows, :] += gq
            dk[..., cols, :] += gk
            dv[..., cols, :] += gv
        if t < n - 1:
            k, v, dk, dv = _shift(group, k, v, dk, dv)
    if n > 1:  # the block held now is part i + 1's: its gradients go home
        dk, dv = _shift(group, dk, dv)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


class _KernelRing(torch.autograd.Function):
    """`ring_forward` and `ring_backward` as one autograd op: the forward keeps this
    part's queries, keys, values, output and log-sum-exp."""

    @staticmethod
    def forward(ctx, query, key, value, group, step, kernel, scale):  # type: ignore[override]
        with torch.no_grad():
            out, lse = ring_forward(kernel, query, key, value, group, step, scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.step, ctx.kernel, ctx.scale = group, step, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        with torch.no_grad():
            grads = ring_backward(ctx.kernel, dout.contiguous(), query, key, value, out, lse,
                                  ctx.group, ctx.step, ctx.scale)
        return (*grads, None, None, None, None)


def _shift(group: PartGroup, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Pass every ``x`` to the next part, from the previous one."""
    n, i = group.size, group.index
    return [group.send_recv(x, (i + 1) % n, (i - 1) % n) for x in xs]


def _ring_autograd(query, key, value, mask, group, segments, opts) -> torch.Tensor:
    n, i = group.size, group.index
    att = BlockAttention(query, segments(i), mask=mask, **opts)
    for t in range(n):
        att.add(key, value, segments((i - t) % n))
        if t < n - 1:
            key, value = _shift(group, key, value)
    return att.result(value.shape[-1])


class _RingAttention(torch.autograd.Function):
    """Ring attention with its own backward: the forward keeps this part's queries,
    keys, values, output and log-sum-exp (nothing of the other parts' blocks); the
    backward sends the key/value blocks around the ring again, recomputes each block's
    probabilities, and passes each block's key/value gradients along with it, so after
    a last step every part holds the gradients of its own keys and values."""

    @staticmethod
    def forward(ctx, query, key, value, mask, group, segments, opts):  # type: ignore[override]
        n, i = group.size, group.index
        with torch.no_grad():
            att = BlockAttention(query, segments(i), mask=mask, **opts)
            k, v = key, value
            for t in range(n):
                att.add(k, v, segments((i - t) % n))
                if t < n - 1:
                    k, v = _shift(group, k, v)
            out = att.result(value.shape[-1])
            lse = att.lse()
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mask, ctx.group, ctx.segments, ctx.opts = mask, group, segments, opts
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        group, segments = ctx.group, ctx.segments
        n, i = group.size, group.index
        with torch.no_grad():
            att = BlockAttention(query, segments(i), mask=ctx.mask, **ctx.opts)
            delta = (dout * out).sum(-1, keepdim=True)
            dq = torch.zeros(torch.broadcast_shapes(query.shape, (*dout.shape[:-1],
                                                                  query.shape[-1])),
                             dtype=query.dtype, device=query.device)
            k, v = key, value
            dk = torch.zeros_like(key)
            dv = torch.zeros_like(value)
            for t in range(n):
                gk, gv = att.grad_block(k, v, segments((i - t) % n), dout=dout, delta=delta,
                                        lse=lse, dq=dq)
                dk, dv = dk + gk, dv + gv
                if t < n - 1:
                    k, v, dk, dv = _shift(group, k, v, dk, dv)
            if n > 1:  # the block held now is part i + 1's: its gradients go home
                dk, dv = _shift(group, dk, dv)
        return reduce_to(dq, query.shape), dk, dv, None, None, None, None


def _ulysses(query, key, value, mask, group, opts) -> torch.Tensor:
    n = group.size
    if query.dim() < 3:
        raise _fail("Ulysses splits the heads (dim -3)", f"query {tuple(query.shape)} without "
                    "a head dim", "Use strategy='ring'")
    hq, hk = query.shape[-3], key.shape[-3]
    if hk % n or hq % n:
        raise _fail(f"Ulysses gives each of the {n} parts whole heads: the query and "
                    f"key/value heads must divide by {n}", f"{hq} query and {hk} key/value heads",
                    f"Use strategy='ring' (or zigzag), or a degree that divides {hk}")

    def heads_to_seq(t: torch.Tensor) -> torch.Tensor:  # (.., H, c, E) -> (.., H/n, L, E)
        return torch.cat(all_to_all(list(t.chunk(n, -3)), group), -2)

    q, k, v = heads_to_seq(query), heads_to_seq(key), heads_to_seq(value)
    if mask is not None:
        if mask.shape[-2] != 1:  # gather every part's rows
            mask = torch.cat(list(group.all_gather(mask)), -2)
        if mask.dim() >= 3 and mask.shape[-3] != 1:
            mask = mask.chunk(n, -3)[group.index]
    out = F.scaled_dot_product_attention(q, k, v, mask, is_causal=opts["causal"],
                                         scale=opts["scale"], enable_gqa=opts["repeat"] > 1)
    back = all_to_all(list(out.chunk(n, -2)), group)  # (.., H/n, c, Ev) from every part
    return torch.cat(back, -3)


# -- the split rules of scaled_dot_product_attention ------------------------------------


def sequence_rules(bound: Any) -> list[TransformRule]:
    """Self-attention (``L == S``) splits along the sequence: splitting the key's sequence
    dim (``idx=1``) runs the ring (zigzag when causal and the sequence divides by twice
    the parts), the value's (``idx=2``) Ulysses (the ring where the heads do not divide
    by the parts)."""
    shapes = bound.input_shapes
    q, k, v = shapes[:3]
    mask = shapes[3] if len(shapes) > 3 else None
    if q is None or k is None or v is None or len(q) < 2 or q[-2] != k[-2] or k[-2] != v[-2]:
        return []
    if mask is not None and len(mask) >= 1 and mask[-1] not in (1, k[-2]):
        return []
    length = q[-2]
    mask_place = None
    if mask is not None:
        mask_place = Split(len(mask) - 2) if len(mask) >= 2 and mask[-2] != 1 else Replicate()
    rest = [None] * (len(shapes) - 4)
    # Split(-2) is the same split as Split(ndim - 2) but not the same request: a rule
    # answers the request whose input it names with the positive dim (the key's for the
    # ring, the value's for Ulysses), and the query's stays the annotation's own.
    ring_in = (Split(-2), Split(len(k) - 2), Split(-2), mask_place, *rest)
    ulysses_in = (Split(-2), Split(-2), Split(len(v) - 2), mask_place, *rest)

    def ring(kwargs: dict, idx: int, dim: int, num: int, part: int) -> dict:
        zig = kwargs.get("is_causal") and length % (2 * num) == 0
        return {**kwargs, "strategy": "zigzag" if zig else "ring"}

    def ulysses(kwargs: dict, idx: int, dim: int, num: int, part: int) -> dict:
        # every num that divides the sequence is a legal split; where the heads do not
        # divide it the parts run the ring (asked for by name, Ulysses raises instead:
        # `nnscaler.policies.sequence.attention_split`, the op's strategy argument)
        heads_divide = q[-3] % num == 0 and k[-3] % num == 0
        return {**kwargs, "strategy": "ulysses" if heads_divide else ring(
            kwargs, idx, dim, num, part)["strategy"]}

    out = (Split(len(q) - 2),)
    rules = [TransformRule(inputs=ring_in, outputs=out, modifier=ring,
                           part_op=CONTEXT_PARALLEL_ATTENTION)]
    if len(q) >= 3 and len(k) >= 3:
        rules.append(TransformRule(inputs=ulysses_in, outputs=out, modifier=ulysses,
                                   part_op=CONTEXT_PARALLEL_ATTENTION))
    return rules


def _part_anno(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
               scale=None, enable_gqa=False, **_: Any) -> str:
    """The whole op's annotation with the query length ``^`` too: a part holds its chunk
    and the group's positions, so its sequence splits no further. A mask holds every key
    column of the whole sequence (``t``), not only the part's ``s`` keys."""
    from nnscaler.ops.builtin.attention import sdpa_anno

    anno = sdpa_anno(query, key, value, attn_mask, dropout_p, True, scale=scale,
                     enable_gqa=enable_gqa)
    if not (is_tensor(attn_mask) and attn_mask.dim() >= 1
            and attn_mask.shape[-1] not in (1, key.shape[-2])):
        return anno
    inputs, out = anno.split(" -> ")
    fields = inputs.split(", ")
    if not fields[3].endswith(" s^"):
        return anno
    fields[3] = fields[3][:-len("s^")] + "t^"
    return f"{', '.join(fields)} -> {out}"


def _gen(rng: random.Random) -> tuple[tuple, dict]:
    b, hk = rng.choice((1, 2)), rng.choice((1, 2))
    hq = hk * rng.choice((1, 2))
    length, e = rng.choice((2, 4, 8)), rng.choice((2, 4))
    q, k, v = f64(rng, b, hq, length, e), f64(rng, b, hk, length, e), f64(rng, b, hk, length, e)
    kw: dict[str, Any] = {"enable_gqa": hq != hk, "is_causal": rng.random() < 0.5}
    return (q, k, v), kw


def register(registry: OpRegistry) -> None:
    registry.register(context_parallel_attention, _part_anno, name=CONTEXT_PARALLEL_ATTENTION,
                      input_gen_fn=_gen, collective=True)
