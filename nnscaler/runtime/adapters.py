"""Run a layout `Plan` on this rank's piece, with autograd.

`execute_plan` is what generated code calls for an adapter. Run on every rank of
the plan, its results are exactly those of `nnscaler.layout.execute` on the list
of pieces, and its backward those of `nnscaler.layout.execute_adjoint` (with
``grad="exact"``, the default) or of the replicated-gradient convention of docs/internals/design.md (with
``grad="replicated"``: the incoming gradients are whole on every device of ``dst``, the
outgoing ones whole on every device of ``src``).

Each step is run by the implementation registered for its primitive's name, else by the
primitive's own runtime side (`Primitive.run_step`, which a plugin primitive defines and
registers with the primitive through the ``nnscaler_register_adapters`` hook), else (a
subclass of a built-in primitive under another name) by the built-in it extends:
collectives over the group's cached process group, point-to-point ``move``,
``broadcast`` and ``reduce`` over the default group with ``batch_isend_irecv``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from nnscaler.layout import Plan, Primitive, Step
from nnscaler.layout import plan as make_plan
from nnscaler.layout.primitives import (
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Chunk,
    IdentityAllReduce,
    Move,
    Pad,
    Reduce,
    ReduceScatter,
    ValueSplit,
)
from nnscaler.runtime import collectives as C
from nnscaler.runtime.collectives import CollectiveError, GradConvention

__all__ = ["execute_plan", "plan_groups", "register_step_impl"]

#: ``impl(step, rank, x, ctx) -> output or None``: this rank's side of one step. ``x`` is
#: this rank's tensor before the step (``None`` if it holds none); ``ctx`` carries the
#: ``dtype`` and ``device`` of the plan's tensors.
StepImpl = Callable[[Step, int, "torch.Tensor | None", dict[str, Any]], "torch.Tensor | None"]

_IMPLS: dict[str, StepImpl] = {}
_COLLECTIVE: set[str] = set()  # names whose groups need a process group (src == dst)
_BASES = (
    (AllReduce, "all_reduce"),
    (ReduceScatter, "reduce_scatter"),
    (AllGather, "all_gather"),
    (AllToAll, "all_to_all"),
    (Chunk, "chunk"),
    (Pad, "pad"),
    (ValueSplit, "value_split"),
    (IdentityAllReduce, "identity_allreduce"),
    (Move, "move"),
    (Broadcast, "broadcast"),
    (Reduce, "reduce"),
)


def register_step_impl(name: str, impl: StepImpl, *, collective: bool = False) -> None:
    """Run steps of the primitive ``name`` with ``impl``: the built-in primitives' runtime.

    A plugin primitive brings its runtime side with it instead: it defines
    `Primitive.run_step` (and ``needs_process_group``) and is registered once, through the
    ``nnscaler_register_adapters`` hook (docs/plugins.md). This function stays for code
    that registered a runtime here before; ``collective=True`` means the groups have
    ``src == dst`` and need a process group."""
    _IMPLS[name] = impl
    if collective:
        _COLLECTIVE.add(name)


def _impl_of(step: Step) -> tuple[StepImpl, bool]:
    """How this rank runs ``step``, and whether its groups need a process group: the
    implementation registered for its primitive's name, else the primitive's own
    `run_step`, else the built-in primitive it subclasses."""
    prim = step.primitive
    if prim.name in _IMPLS:
        return _IMPLS[prim.name], prim.name in _COLLECTIVE
    if type(prim).run_step is not Primitive.run_step:
        return prim.run_step, bool(prim.needs_process_group)
    for cls, name in _BASES:
        if isinstance(prim, cls):
            return _IMPLS[name], name in _COLLECTIVE
    raise CollectiveError(
        f"no runtime implementation for primitive {prim.name!r} ({type(prim).__name__}) in "
        f"step {step}; implemented: {sorted(_IMPLS)}. Fix: subclass a built-in primitive, or "
        f"define {type(prim).__name__}.run_step (the primitive's runtime side, registered "
        f"with it through the nnscaler_register_adapters hook; see docs/plugins.md)."
    )


def _collective(
    fn: Callable[[torch.Tensor, tuple[int, ...], int, dict[str, Any]], torch.Tensor],
) -> StepImpl:
    def impl(
        step: Step, rank: int, x: torch.Tensor | None, ctx: dict[str, Any]
    ) -> torch.Tensor | None:
        for group in step.groups:
            if rank in group.src or rank in group.dst:
                if group.src != group.dst:
                    raise CollectiveError(
                        f"step {step}: {step.name} is a collective, so its groups need the "
                        f"same devices in and out, got {group}."
                    )
                if x is None:
                    raise CollectiveError(
                        f"step {step} reads rank {rank}, which holds no tensor at this point."
                    )
                return fn(x, group.src, rank, step.kwargs)
        return x

    return impl


for _name, _fn in {
    "all_reduce": lambda x, g, r, kw: C.raw_all_reduce(x, g),
    "identity_allreduce": lambda x, g, r, kw: x.clone(),
    "reduce_scatter": lambda x, g, r, kw: C.raw_reduce_scatter(x, g, kw["dim"], r),
    "all_gather": lambda x, g, r, kw: C.raw_all_gather(x, g, kw["dim"]),
    "all_to_all": lambda x, g, r, kw: C.raw_all_to_all(x, g, kw["src_dim"], kw["dst_dim"]),
    "chunk": lambda x, g, r, kw: C.raw_chunk(x, g, kw["dim"], r),
    "pad": lambda x, g, r, kw: C.raw_pad(x, g, kw["dim"], r),
    "value_split": lambda x, g, r, kw: C.raw_value_split(x, g, r),
}.items():
    register_step_impl(
        _name,
        _collective(_fn),
        collective=_name not in ("chunk", "pad", "value_split", "identity_allreduce"),
    )


def _region(box: Any) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _move(
    step: Step, rank: int, x: torch.Tensor | None, ctx: dict[str, Any]
) -> torch.Tensor | None:
    kw = step.kwargs
    sends: list[tuple[torch.Tensor, int, int]] = []
    recvs: list[tuple[torch.Tensor, int, int]] = []
    adds: list[tuple[Any, torch.Tensor]] = []  # (dst_box, value), in transfer order
    out: torch.Tensor | None = None
    reads = False
    tag = 0
    for group in step.groups:
        reads = reads or rank in group.src
        if rank in group.dst:
            j = group.dst.index(rank)
            out = torch.zeros(kw["out_shapes"][j], dtype=ctx["dtype"], device=ctx["device"])
        for i, src_box, j, dst_box in kw["transfers"]:
            s, d = group.src[i], group.dst[j]
            tag += 1
            if s == rank and d == rank:
                adds.append((dst_box, x[_region(src_box)]))  # type: ignore[index]
            elif s == rank:
                sends.append((x[_region(src_box)], d, tag))  # type: ignore[index]
            elif d == rank:
                shape = tuple(b - a for a, b in src_box)
                buf = torch.empty(shape, dtype=ctx["dtype"], device=ctx["device"])
                recvs.append((buf, s, tag))
                adds.append((dst_box, buf))
    if reads and x is None:
        raise CollectiveError(f"step {step} reads rank {rank}, which holds no tensor.")
    C.p2p(sends, recvs)
    for dst_box, value in adds:
        out[_region(dst_box)] += value  # type: ignore[index]
    if out is not None:
        return out
    return None if reads else x


def _broadcast(
    step: Step, rank: int, x: torch.Tensor | None, ctx: dict[str, Any]
) -> torch.Tensor | None:
    sends: list[tuple[torch.Tensor, int, int]] = []
    recvs: list[tuple[torch.Tensor, int, int]] = []
    out: torch.Tensor | None = None
    reads = False
    for tag, group in enumerate(step.groups):
        root = group.src[0]
        reads = reads or rank in group.src
        if rank == root:
            if x is None:
                raise CollectiveError(f"step {step}: root rank {rank} holds no tensor.")
            sends += [(x, d, tag) for d in group.dst if d != rank]
        if rank in group.dst:
            if rank == root:
                out = x.clone()  # type: ignore[union-attr]
            else:
                out = torch.empty(step.after.piece_shape, dtype=ctx["dtype"], device=ctx["device"])
                recvs.append((out, root, tag))
    C.p2p(sends, recvs)
    if out is not None:
        return out
    return None if reads else x


def _reduce(
    step: Step, rank: int, x: torch.Tensor | None, ctx: dict[str, Any]
) -> torch.Tensor | None:
    sends: list[tuple[torch.Tensor, int, int]] = []
    recvs: list[tuple[torch.Tensor, int, int]] = []
    terms: list[torch.Tensor] = []
    out: torch.Tensor | None = None
    reads = False
    shape = step.after.piece_shape
    for tag, group in enumerate(step.groups):
        root = group.dst[0]
        if rank in group.src:
            reads = True
            if x is None:
                raise CollectiveError(f"step {step} reads rank {rank}, which holds no tensor.")
            if rank != root:
                sends.append((x, root, tag))
        if rank == root:
            for s in group.src:
                if s == rank:
                    terms.append(x)  # type: ignore[arg-type]
                else:
                    buf = torch.empty(shape, dtype=ctx["dtype"], device=ctx["device"])
                    recvs.append((buf, s, tag))
                    terms.append(buf)
        elif rank in group.dst:
            out = torch.zeros(shape, dtype=ctx["dtype"], device=ctx["device"])
    C.p2p(sends, recvs)
    if terms:
        out = terms[0].clone()
        for t in terms[1:]:
            out += t
    if out is not None:
        return out
    return None if reads else x


register_step_impl("move", _move)
register_step_impl("broadcast", _broadcast)
register_step_impl("reduce", _reduce)


# ---------------------------------------------------------------------------------------
# Whole plans
# ---------------------------------------------------------------------------------------


def _check_grad(grad: str) -> None:
    if grad not in ("exact", "replicated"):
        raise CollectiveError(
            f"grad must be 'exact' or 'replicated', got {grad!r}. Fix: 'exact' gives what "
            f"nnscaler.layout.execute_adjoint gives; 'replicated' is the convention of docs/internals/design.md."
        )


def _backward_plans(plan: Plan, grad: str) -> list[Plan]:
    """The plans the backward runs, in order."""
    _check_grad(grad)
    return list(_backward_plans_of(plan, grad))


@functools.lru_cache(maxsize=4096)
def _backward_plans_of(plan: Plan, grad: str) -> tuple[Plan, ...]:
    # every backward of an adapter asks again: derive the adjoints once per plan
    adjoint = plan.adjoint()
    if grad == "exact":
        return (adjoint,)
    to_exact = make_plan(plan.dst.replicated(), plan.dst.dual())
    to_replicated = make_plan(plan.src.dual(), plan.src.replicated())
    return (to_exact, adjoint, to_replicated)


def plan_groups(plan: Plan, *, grad: GradConvention = "exact") -> list[tuple[int, ...]]:
    """The process groups (sorted rank tuples, first-use order) that running ``plan``
    forward and backward needs. Pass them, on every rank, to
    `nnscaler.runtime.ensure_groups`."""
    out: list[tuple[int, ...]] = []
    for p in [plan, *_backward_plans(plan, grad)]:
        for step in p.steps:
            if not _impl_of(step)[1]:
                continue
            for group in step.groups:
                key = tuple(sorted(group.src))
                if len(key) > 1 and key not in out:
                    out.append(key)
    return out


def _run(
    plans: list[Plan], rank: int, x: torch.Tensor | None, ctx: dict[str, Any]
) -> torch.Tensor | None:
    for p in plans:
        for step in p.steps:
            x = _impl_of(step)[0](step, rank, x, ctx)
        if (x is not None) != (rank in p.dst.devices):
            raise CollectiveError(
                f"plan {p.src} -> {p.dst} left rank {rank} "
                f"{'with' if x is not None else 'without'} a tensor; a step implementation "
                f"is inconsistent with its primitive."
            )
    return x


class _PlanFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, plan: Plan, rank: int, grad: str, info: dict[str, Any]
    ) -> torch.Tensor:
        ctx.plan, ctx.rank, ctx.grad, ctx.info = plan, rank, grad, info
        ctx.in_shape = tuple(x.shape)
        local = x if rank in plan.src.devices else None
        out = _run([plan], rank, local, info)
        if out is None:
            return x.new_empty(0)
        return out.clone() if out is x else out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        plan: Plan = ctx.plan
        local = g.contiguous() if ctx.rank in plan.dst.devices else None
        info = {**ctx.info, "dtype": g.dtype, "device": g.device}
        out = _run(_backward_plans(plan, ctx.grad), ctx.rank, local, info)
        if out is None:
            out = g.new_zeros(ctx.in_shape)
        return out, None, None, None, None


def execute_plan(
    plan: Plan,
    tensor: torch.Tensor | None,
    *,
    rank: int | None = None,
    grad: GradConvention = "exact",
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """Run ``plan`` on this rank's piece; every rank of ``plan.src`` or ``plan.dst`` calls it.

    ``tensor`` is this rank's piece of ``plan.src`` (``None`` on a rank that holds none;
    then pass ``dtype``/``device`` unless they are the defaults). Returns this rank's
    piece of ``plan.dst``; on a rank of ``src`` that is not in ``dst``, an empty tensor
    that carries the backward (include it in ``backward`` with an empty gradient so that
    this rank receives its gradient); ``None`` on a rank outside the plan.

    Backward: ``grad="exact"`` runs ``plan.adjoint()`` (gradients in ``dst.dual()`` in,
    ``src.dual()`` out, as ``execute_adjoint``); ``grad="replicated"`` takes gradients in
    ``dst.replicated()`` and gives them in ``src.replicated()`` (the convention of docs/internals/design.md).
    Every multi-rank group must exist: ``ensure_groups(plan_groups(plan, grad=grad))``
    on every rank first.
    """
    if not isinstance(plan, Plan):
        raise CollectiveError(
            f"execute_plan(): expected a nnscaler.layout.Plan, got {type(plan).__name__}."
        )
    _check_grad(grad)
    if rank is None:
        rank = C.this_rank()
    in_src = rank in plan.src.devices
    if rank not in plan.dst.devices and not in_src:
        return None
    if in_src:
        if tensor is None:
            raise CollectiveError(
                f"execute_plan(): rank {rank} holds a piece of {plan.src} but got None. Fix: "
                f"pass this rank's piece (shape {plan.src.piece_shape})."
            )
        if tuple(tensor.shape) != plan.src.piece_shape:
            raise CollectiveError(
                f"execute_plan(): rank {rank} got a tensor of shape {tuple(tensor.shape)}, but "
                f"layout {plan.src!r} gives it a piece of shape {plan.src.piece_shape}. Fix: "
                f"pass the piece that materialize(full, plan.src) gives this rank."
            )
        x = tensor
    else:
        x = torch.empty(
            0,
            dtype=dtype or torch.get_default_dtype(),
            device=device,
            requires_grad=torch.is_grad_enabled(),
        )
    info = {"dtype": x.dtype, "device": x.device}
    return _PlanFunction.apply(x, plan, rank, grad, info)
