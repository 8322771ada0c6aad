"""Autograd-aware collectives over ``torch.distributed``.

Every collective takes this rank's tensor and ``ranks``, the global ranks of the group
**in layout order** (member ``m`` is ``ranks[m]``; it decides which chunk a member gets
and the order of concatenation, as in `nnscaler.layout.primitives`). The group's
communicator comes from `nnscaler.runtime.get_group`, so every multi-rank group
must have been created with `nnscaler.runtime.ensure_groups` first.

Gradient conventions (``grad=``):

- ``"replicated"`` (docs/internals/design.md, "Gradient layouts"; Megatron's): the gradient of a
  replicated tensor is replicated. ``all_reduce`` has identity backward,
  ``identity_allreduce`` has all-reduce backward, ``all_gather`` keeps its own chunk of
  the gradient, ``chunk`` all-gathers it, ``broadcast`` has identity backward.
- ``"exact"``: the backward is the transpose under the per-device dot product, the
  adjoint that `nnscaler.layout.primitives` declares: ``all_reduce`` ->
  ``all_reduce``, ``all_gather`` -> ``reduce_scatter``, ``chunk`` -> ``pad``,
  ``broadcast`` -> ``reduce`` (to the root).

``reduce_scatter`` (backward ``all_gather``), ``all_to_all`` (backward: the inverse
``all_to_all``) and ``send_recv`` (backward: the reverse send) are the same under both.
The hand-written collectives default to ``"replicated"``;
`nnscaler.runtime.execute_plan`, which runs the adapters of generated code,
defaults to ``"exact"`` (see its docstring).

Backends: gloo in torch 2.13 supports ``all_gather_single`` (formerly
``all_gather_into_tensor``), ``reduce_scatter_single`` (formerly
``reduce_scatter_tensor``) and ``all_to_all_single``, as NCCL does, so one code path
serves both. Point-to-point transfers are batched with ``batch_isend_irecv``.
Uneven chunks are not supported: split sizes must divide the dims, except in
``all_to_all_uneven``, the token exchange of expert parallelism, which takes its sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from nnscaler.errors import CollectiveError
from nnscaler.runtime.groups import get_group

__all__ = [
    "CollectiveError",
    "GradConvention",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_uneven",
    "broadcast",
    "chunk",
    "identity_allreduce",
    "reduce_scatter",
    "send_recv",
]

GradConvention = Literal["replicated", "exact"]
_CONVENTIONS = ("replicated", "exact")

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------------------------
# Plain (non-autograd) building blocks: one rank's side of each operation
# ---------------------------------------------------------------------------------------


def this_rank() -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise CollectiveError(
            "collectives need a running default process group, but torch.distributed is "
            "not initialized. Fix: call nnscaler.runtime.init_distributed() first."
        )
    return dist.get_rank()


def position(ranks: Sequence[int], rank: int, what: str) -> int:
    """The member index of ``rank`` in ``ranks``; an error if it is not a member."""
    try:
        return list(ranks).index(rank)
    except ValueError:
        raise CollectiveError(
            f"{what}: rank {rank} is not a member of the group {list(ranks)}. Fix: call "
            f"the collective only on the ranks of its group."
        ) from None


def block(t: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    """Chunk ``index`` of ``parts`` equal chunks of ``t`` along ``dim`` (a view)."""
    if not -t.dim() <= dim < max(t.dim(), 1):
        raise CollectiveError(
            f"dim {dim} is out of range for a tensor of shape {tuple(t.shape)}. Fix: pass a "
            f"dim in [{-t.dim()}, {t.dim()})."
        )
    size = t.shape[dim]
    if size % parts:
        raise CollectiveError(
            f"cannot cut dim {dim} of size {size} into {parts} equal chunks (tensor shape "
            f"{tuple(t.shape)}); uneven sizes are not supported. Fix: make the group size "
            f"divide the dim."
        )
    step = size // parts
    return t.narrow(dim, index * step, step)


def _rows(ranks: Sequence[int]) -> list[int]:
    """For each member (layout order), its row in a buffer ordered by group rank."""
    order = sorted(ranks)
    return [order.index(r) for r in ranks]


def raw_all_reduce(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    if len(ranks) > 1:
        dist.all_reduce(out, group=get_group(ranks))
    return out


def raw_all_gather(x: torch.Tensor, ranks: Sequence[int], dim: int) -> torch.Tensor:
    k = len(ranks)
    if k == 1:
        return x.clone()
    flat = x.contiguous().reshape(-1)
    buf = x.new_empty((k, flat.numel()))
    _all_gather_single(buf.view(-1), flat, group=get_group(ranks))
    return torch.cat([buf[row].view(x.shape) for row in _rows(ranks)], dim)


def raw_reduce_scatter(x: torch.Tensor, ranks: Sequence[int], dim: int, rank: int) -> torch.Tensor:
    k = len(ranks)
    if k == 1:
        return x.clone()
    pieces = [block(x, dim, m, k) for m in range(k)]
    member = {row: m for m, row in enumerate(_rows(ranks))}
    stacked = torch.stack([pieces[member[row]] for row in range(k)]).contiguous()
    out = x.new_empty(pieces[0].shape)
    _reduce_scatter_single(out.view(-1), stacked.view(-1), group=get_group(ranks))
    return out


def raw_all_to_all(
    x: torch.Tensor, ranks: Sequence[int], src_dim: int, dst_dim: int
) -> torch.Tensor:
    k = len(ranks)
    if k == 1:
        return x.clone()
    pieces = [block(x, dst_dim, m, k) for m in range(k)]
    rows = _rows(ranks)
    member = {row: m for m, row in enumerate(rows)}
    stacked = torch.stack([pieces[member[row]] for row in range(k)]).contiguous()
    out = torch.empty_like(stacked)
    dist.all_to_all_single(out.view(-1), stacked.view(-1), group=get_group(ranks))
    return torch.cat([out[row] for row in rows], src_dim).contiguous()


def raw_chunk(x: torch.Tensor, ranks: Sequence[int], dim: int, rank: int) -> torch.Tensor:
    k = len(ranks)
    return block(x, dim, position(ranks, rank, "chunk"), k).clone()


def raw_pad(x: torch.Tensor, ranks: Sequence[int], dim: int, rank: int) -> torch.Tensor:
    k = len(ranks)
    shape = list(x.shape)
    shape[dim] *= k
    out = x.new_zeros(shape)
    block(out, dim, position(ranks, rank, "pad"), k).copy_(x)
    return out


def raw_value_split(x: torch.Tensor, ranks: Sequence[int], rank: int) -> torch.Tensor:
    return x.clone() if position(ranks, rank, "value_split") == 0 else torch.zeros_like(x)


def raw_broadcast(x: torch.Tensor, ranks: Sequence[int], root: int) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    if len(ranks) > 1:
        dist.broadcast(out, src=root, group=get_group(ranks))
    return out


def raw_reduce(x: torch.Tensor, ranks: Sequence[int], root: int, rank: int) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    if len(ranks) > 1:
        dist.reduce(out, dst=root, group=get_group(ranks))
    return out if rank == root else torch.zeros_like(x)


def p2p(
    sends: Sequence[tuple[torch.Tensor, int, int]], recvs: Sequence[tuple[torch.Tensor, int, int]]
) -> None:
    """Post every ``(tensor, peer, tag)`` send and receive at once and wait for all."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, tag=tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, peer, tag in recvs]
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def raw_all_to_all_uneven(x: torch.Tensor, ranks: Sequence[int], send_splits: Sequence[int],
                          recv_splits: Sequence[int]) -> torch.Tensor:
    """Rows of ``x`` to each member (``send_splits[m]`` rows to member ``m``, in order);
    returns the rows received, ``recv_splits[m]`` from member ``m``, in member order."""
    if len(ranks) == 1:
        return x.clone()
    rows = _rows(ranks)
    member = {row: m for m, row in enumerate(rows)}
    sent = torch.split(x, list(send_splits))
    ordered = torch.cat([sent[member[row]] for row in range(len(ranks))]).contiguous()
    send = [int(send_splits[member[row]]) for row in range(len(ranks))]
    recv = [int(recv_splits[member[row]]) for row in range(len(ranks))]
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, ordered, recv, send, group=get_group(ranks))
    got = torch.split(out, recv)
    return torch.cat([got[row] for row in rows]) if len(got) else out


# ---------------------------------------------------------------------------------------
# Autograd functions
# ---------------------------------------------------------------------------------------


class _Comm(torch.autograd.Function):
    """Forward ``fwd(x)``, backward ``bwd(grad)``: one rank's side of a collective."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        fwd: Callable[[torch.Tensor], torch.Tensor],
        bwd: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return ctx.bwd(grad.contiguous()), None, None


def _check(grad: str) -> str:
    if grad not in _CONVENTIONS:
        raise CollectiveError(
            f"grad must be one of {list(_CONVENTIONS)}, got {grad!r}. Fix: 'replicated' "
            f"(the convention of docs/internals/design.md: the gradient of a replicated tensor is replicated) or "
            f"'exact' (the transpose, as nnscaler.layout.execute_adjoint computes)."
        )
    return grad


def _ranks(ranks: Sequence[int], what: str) -> tuple[tuple[int, ...], int]:
    ranks = tuple(int(r) for r in ranks)
    rank = this_rank()
    position(ranks, rank, what)
    return ranks, rank


def all_reduce(
    x: torch.Tensor, ranks: Sequence[int], *, grad: GradConvention = "replicated"
) -> torch.Tensor:
    """V -> R: every member gets the sum. Backward: identity (``replicated``) or
    all-reduce (``exact``)."""
    ranks, _ = _ranks(ranks, "all_reduce")
    if _check(grad) == "exact":
        return _Comm.apply(
            x, lambda t: raw_all_reduce(t, ranks), lambda g: raw_all_reduce(g, ranks)
        )
    return _Comm.apply(x, lambda t: raw_all_reduce(t, ranks), lambda g: g.clone())


def identity_allreduce(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Identity forward, all-reduce backward: the edge adapter of a replicated tensor
    consumed by partitioned ops under the replicated convention."""
    ranks, _ = _ranks(ranks, "identity_allreduce")
    return _Comm.apply(x, lambda t: t.clone(), lambda g: raw_all_reduce(g, ranks))


def all_gather(
    x: torch.Tensor, ranks: Sequence[int], dim: int, *, grad: GradConvention = "replicated"
) -> torch.Tensor:
    """D -> R: every member gets the concatenation along ``dim`` in member order.
    Backward: own chunk (``replicated``) or reduce-scatter (``exact``)."""
    ranks, rank = _ranks(ranks, "all_gather")

    def fwd(t: torch.Tensor) -> torch.Tensor:
        return raw_all_gather(t, ranks, dim)

    if _check(grad) == "exact":
        return _Comm.apply(x, fwd, lambda g: raw_reduce_scatter(g, ranks, dim, rank))
    return _Comm.apply(x, fwd, lambda g: raw_chunk(g, ranks, dim, rank))


def reduce_scatter(x: torch.Tensor, ranks: Sequence[int], dim: int) -> torch.Tensor:
    """V -> D: member ``m`` gets chunk ``m`` (along ``dim``) of the sum. Backward:
    all-gather."""
    ranks, rank = _ranks(ranks, "reduce_scatter")
    return _Comm.apply(
        x,
        lambda t: raw_reduce_scatter(t, ranks, dim, rank),
        lambda g: raw_all_gather(g, ranks, dim),
    )


def chunk(
    x: torch.Tensor, ranks: Sequence[int], dim: int, *, grad: GradConvention = "replicated"
) -> torch.Tensor:
    """R -> D (local): member ``m`` keeps chunk ``m`` along ``dim``. Backward: all-gather
    (``replicated``) or pad with zeros (``exact``, local)."""
    ranks, rank = _ranks(ranks, "chunk")

    def fwd(t: torch.Tensor) -> torch.Tensor:
        return raw_chunk(t, ranks, dim, rank)

    if _check(grad) == "exact":
        return _Comm.apply(x, fwd, lambda g: raw_pad(g, ranks, dim, rank))
    return _Comm.apply(x, fwd, lambda g: raw_all_gather(g, ranks, dim))


def all_to_all(x: torch.Tensor, ranks: Sequence[int], src_dim: int, dst_dim: int) -> torch.Tensor:
    """D(src_dim) -> D(dst_dim): member ``n`` gets ``cat_m(chunk_n(x_m, dst_dim), src_dim)``.
    Backward: the inverse all-to-all (dims swapped)."""
    ranks, _ = _ranks(ranks, "all_to_all")
    return _Comm.apply(
        x,
        lambda t: raw_all_to_all(t, ranks, src_dim, dst_dim),
        lambda g: raw_all_to_all(g, ranks, dst_dim, src_dim),
    )


def all_to_all_uneven(x: torch.Tensor, ranks: Sequence[int], send_splits: Sequence[int],
                      recv_splits: Sequence[int]) -> torch.Tensor:
    """Uneven all-to-all along dim 0: ``send_splits[m]`` rows of ``x`` go to member ``m``
    and ``recv_splits[m]`` rows come from it (the sizes every member agreed on first).
    Backward: the same exchange the other way (sizes swapped)."""
    ranks, _ = _ranks(ranks, "all_to_all_uneven")
    send, recv = [int(s) for s in send_splits], [int(r) for r in recv_splits]
    return _Comm.apply(
        x,
        lambda t: raw_all_to_all_uneven(t, ranks, send, recv),
        lambda g: raw_all_to_all_uneven(g, ranks, recv, send),
    )


def broadcast(
    x: torch.Tensor, ranks: Sequence[int], root: int, *, grad: GradConvention = "replicated"
) -> torch.Tensor:
    """Every member gets the root's tensor (``root`` is a global rank in ``ranks``; the
    other members pass a tensor of the same shape and dtype, whose value is ignored).
    Backward: identity (``replicated``) or the sum of the gradients on the root and zeros
    elsewhere (``exact``)."""
    ranks, rank = _ranks(ranks, "broadcast")
    position(ranks, root, "broadcast (root)")

    def fwd(t: torch.Tensor) -> torch.Tensor:
        return raw_broadcast(t, ranks, root)

    if _check(grad) == "exact":
        return _Comm.apply(x, fwd, lambda g: raw_reduce(g, ranks, root, rank))
    return _Comm.apply(x, fwd, lambda g: g.clone())


def send_recv(
    x: torch.Tensor | None,
    src: int,
    dst: int,
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Point-to-point move from global rank ``src`` to ``dst``; call it on both.

    On ``src`` pass the tensor; it returns an empty tensor that carries the backward
    (include it in ``backward`` with an empty gradient, so the gradient is received).
    On ``dst`` pass ``None`` with ``shape`` (and ``dtype``/``device`` if not the
    defaults); it returns the received tensor. Backward sends the gradient back.
    """
    rank = this_rank()
    if src == dst:
        raise CollectiveError(
            f"send_recv: src and dst are both rank {src}. Fix: use the tensor directly."
        )
    if rank == src:
        if x is None:
            raise CollectiveError(
                f"send_recv: the source rank {src} must pass the tensor, got None."
            )
        like = x

        def fwd(t: torch.Tensor) -> torch.Tensor:
            p2p([(t, dst, 0)], [])
            return t.new_empty(0)

        def bwd(g: torch.Tensor) -> torch.Tensor:
            buf = torch.empty_like(like, memory_format=torch.contiguous_format)
            p2p([], [(buf, dst, 0)])
            return buf

        return _Comm.apply(x, fwd, bwd)
    if rank == dst:
        if shape is None:
            raise CollectiveError(
                f"send_recv: the destination rank {dst} must pass shape= (the tensor it "
                f"receives), got None."
            )
        dt = dtype or torch.get_default_dtype()
        anchor = torch.empty(0, dtype=dt, device=device, requires_grad=torch.is_grad_enabled())

        def fwd_recv(t: torch.Tensor) -> torch.Tensor:
            buf = torch.empty(tuple(shape), dtype=dt, device=device)
            p2p([], [(buf, src, 0)])
            return buf

        def bwd_send(g: torch.Tensor) -> torch.Tensor:
            p2p([(g, src, 0)], [])
            return anchor.new_empty(0)

        return _Comm.apply(anchor, fwd_recv, bwd_send)
    raise CollectiveError(
        f"send_recv: rank {rank} is neither the source {src} nor the destination {dst}. "
        f"Fix: call it only on those two ranks."
    )
