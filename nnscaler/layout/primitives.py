"""The built-in communication primitives, registered as a plugin.

This module is an ordinary nnscaler plugin: `nnscaler_register_adapters` puts
every primitive of `BUILTIN_PRIMITIVES` into the adapter registry, exactly as a
third-party plugin would add its own. Forward semantics (``k`` = group size, ``x_m`` =
input of member ``m``) and the exact adjoint of each:

===================  ==========  ==========================================  ===================
name                 transition  forward                                     adjoint
===================  ==========  ==========================================  ===================
all_reduce           V->R        every member gets ``sum_m x_m``             all_reduce
reduce_scatter       V->D        member m gets chunk m of ``sum x`` on dim   all_gather
all_gather           D->R        every member gets ``cat(x, dim)``           reduce_scatter
all_to_all           D->D        member n gets ``cat_m(chunk_n(x_m, dst),    all_to_all (dims
                                 src)``                                      swapped)
chunk                R->D        member m keeps chunk m of ``x_m`` (local)   pad
pad                  D->V        member m: zeros with ``x_m`` at block m     chunk
value_split          R->V        member 0 keeps ``x_0``, others zeros        value_split
move                 move        point-to-point copies of boxes, summed      move (reversed)
broadcast            broadcast   every output gets ``x_0`` (other inputs     reduce
                                 are dropped)
reduce               --          output 0 gets ``sum x``, others zeros       broadcast
identity_allreduce   --          identity (backward: all-reduce)             all_reduce (*)
===================  ==========  ==========================================  ===================

(*) ``identity_allreduce`` is the replicated-gradient convention's edge adapter
(docs/internals/design.md, "Gradient layouts"): forward identity on a replicated tensor, backward all-reduce
of the partial gradients. Under the per-device dot product its backward is *not* the
transpose (the transpose of identity is identity); it is the transpose when the input
replicas count once. The planner never uses it.

Costs are elements sent or received by the busiest device, for ring algorithms.
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from nnscaler.errors import RegistrationError
from nnscaler.hookspecs import hookimpl
from nnscaler.layout.layout import LayoutError
from nnscaler.layout.steps import TRANSITIONS, Group, Primitive
from nnscaler.registry import Registry

__all__ = [
    "BUILTIN_PRIMITIVES",
    "AllGather",
    "AllReduce",
    "AllToAll",
    "Broadcast",
    "Chunk",
    "IdentityAllReduce",
    "Move",
    "Pad",
    "Reduce",
    "ReduceScatter",
    "ValueSplit",
    "check_adjoints",
    "nnscaler_register_adapters",
    "validate_primitive",
]


def _sum(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(operator.add, inputs[1:], inputs[0].clone())


def _block(t: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    size = t.shape[dim]
    if size % parts:
        raise LayoutError(
            f"cannot cut dim {dim} of size {size} into {parts} equal chunks (tensor shape "
            f"{tuple(t.shape)}). Fix: the layout's split counts must divide the shape."
        )
    step = size // parts
    return t.narrow(dim, index * step, step)


def _same_count(name: str, inputs: Sequence[torch.Tensor], n_out: int) -> int:
    if n_out != len(inputs) or not inputs:
        raise LayoutError(
            f"{name} is a collective: it needs as many outputs as inputs (at least one), "
            f"got {len(inputs)} inputs and {n_out} outputs. Fix: give the group the same "
            f"devices in src and dst."
        )
    return len(inputs)


@attrs.frozen(kw_only=True)
class AllReduce(Primitive):
    name: str = "all_reduce"
    adjoint: str = "all_reduce"
    transition: str | None = "V->R"

    def forward(
        self, inputs: Sequence[torch.Tensor], *, n_out: int, **params: Any
    ) -> list[torch.Tensor]:
        _same_count(self.name, inputs, n_out)
        total = _sum(inputs)
        return [total.clone() for _ in inputs]

    def cost(self, group: Group, numel: int, **params: Any) -> float:
        k = len(group.src)
        return 2 * (k - 1) / k * numel


@attrs.frozen(kw_only=True)
class ReduceScatter(Primitive):
    name: str = "reduce_scatter"
    adjoint: str = "all_gather"
    transition: str | None = "V->D"

    def forward(
        self, inputs: Sequence[torch.Tensor], *, n_out: int, dim: int, **params: Any
    ) -> list[torch.Tensor]:
        k = _same_count(self.name, inputs, n_out)
        total = _sum(inputs)
        return [_block(total, dim, m, k).clone() for m in range(k)]

    def cost(self, group: Group, numel: int, **params: Any) -> float:
        k = len(group.src)
        return (k - 1) / k * numel


@attrs.frozen(kw_only=True)
class AllGather(Primitive):
    name: str = "all_gather"
    adjoint: str = "reduce_scatter"
    transition: str | None = "D->R"

    def forward(
        self, inputs: Sequence[torch.Tensor], *, n_out: int, dim: int, **params: Any
    ) -> list[torch.Tensor]:
        _same_count(self.name, inputs, n_out)
        full = torch.cat(list(inputs), dim)
        return [full.clone() for _ in inputs]

    def cost(self, group: Group, numel: int, **params: Any) -> float:
        return (len(group.src) - 1) * numel


@attrs.frozen(kw_only=True)
class AllToAll(Primitive):
    name: str = "all_to_all"
    adjoint: str = "all_to_all"
    transition: str | None = "D->D"

    def forward(
        self,
        inputs: Sequence[torch.Tensor],
        *,
        n_out: int,
        src_dim: int,
        dst_dim: int,
        **params: Any,
    ) -> list[torch.Tensor]:
        k = _same_count(self.name, inputs, n_out)
        return [
            torch.cat([_block(x, dst_dim, n, k) for x in inputs], src_dim).contiguous()
            for n in range(k)
        ]

    def cost(self, group: Group, numel: int, **params: Any) -> float:
        k = len(group.src)
        return (k - 1) / k * numel

    def adjoint_params(self, *, src_dim: int, dst_dim: int, **params: Any) -> dict[str, Any]:
        return {**params, "src_dim": dst_dim, "dst_dim": src_dim}


@attrs.frozen(kw_only=True)
class Chunk(Primitive):
    name: str = "chunk"
    adjoint: str = "pad"
    transition: str | None = "R->D"

    def forward(
        self, inputs: Sequence[torch.Tensor], *, n_out: int, dim: int, **params: Any
    ) -> list[torch.Tensor]:
        k = _same_count(self.name, inputs, n_out)
        return [_block(x, dim, m, k).clone() for m, x in enumerate(inputs)]


@attrs.frozen(kw_only=True)
class Pad(Primitive):
    name: str = "pad"
    adjoint: str = "chunk"
    transition: str | None = "D->V"

    def forward(
        self, inputs: Sequence[torch.Tensor], *, n_out: int, dim: int, **params: Any
    ) -> list[torch.Tensor]:
        k = _same_count(self.name, inputs, n_out)
        out = []
        for m, x in enumerate(inputs):
            shape = list(x.shape)
            shape[dim] *= k
            y = torch.zeros(shape, dtype=x.dtype, device=x.device)
            _block(y, dim, m, k).copy_(x)
            out.append(y)
        return out


@attrs.frozen(kw_only=True)
class ValueSplit(Primitive):
    name: str = "value_split"
    adjoint: str = "value_split"
    transition: str | None = "R->V"

    def forward(
        self, inputs: Sequence[torch.Tensor], *, n_out: int, **params: Any
    ) -> list[torch.Tensor]:
        _same_count(self.name, inputs, n_out)
        return [inputs[0].clone()] + [torch.zeros_like(x) for x in inputs[1:]]


@attrs.frozen(kw_only=True)
class IdentityAllReduce(Primitive):
    name: str = "identity_allreduce"
    adjoint: str = "all_reduce"
    transition: str | None = None
    exact_adjoint: bool = False

    def forward(
        self, inputs: Sequence[torch.Tensor], *, n_out: int, **params: Any
    ) -> list[torch.Tensor]:
        _same_count(self.name, inputs, n_out)
        return [x.clone() for x in inputs]


@attrs.frozen(kw_only=True)
class Broadcast(Primitive):
    name: str = "broadcast"
    adjoint: str = "reduce"
    transition: str | None = "broadcast"

    def forward(
        self, inputs: Sequence[torch.Tensor], *, n_out: int, **params: Any
    ) -> list[torch.Tensor]:
        if not inputs:
            raise LayoutError("broadcast needs its root's tensor as the first input, got none.")
        return [inputs[0].clone() for _ in range(n_out)]

    def cost(self, group: Group, numel: int, **params: Any) -> float:
        return float(numel) if set(group.dst) - {group.src[0]} else 0.0


@attrs.frozen(kw_only=True)
class Reduce(Primitive):
    name: str = "reduce"
    adjoint: str = "broadcast"
    transition: str | None = None

    def forward(
        self, inputs: Sequence[torch.Tensor], *, n_out: int, **params: Any
    ) -> list[torch.Tensor]:
        if not inputs or n_out < 1:
            raise LayoutError(
                f"reduce needs at least one input and one output, got {len(inputs)} and {n_out}."
            )
        total = _sum(inputs)
        return [total] + [torch.zeros_like(total) for _ in range(n_out - 1)]

    def cost(self, group: Group, numel: int, **params: Any) -> float:
        return float(numel) if set(group.src) - {group.dst[0]} else 0.0


#: One transfer of a move: ``(src member, box in its tensor, dst member, box in its tensor)``
#: with boxes as ``((start, stop), ...)`` in the members' local coordinates.
Transfer = tuple[int, tuple[tuple[int, int], ...], int, tuple[tuple[int, int], ...]]


def _region(box: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _box_numel(box: Sequence[tuple[int, int]]) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


@attrs.frozen(kw_only=True)
class Move(Primitive):
    """Point-to-point copies between any devices: ``out[j][dst_box] += in[i][src_box]``
    for every transfer, outputs starting from zeros. Its adjoint is itself with every
    transfer reversed, so one primitive covers send/recv, gathers to one device and the
    general reshard."""

    name: str = "move"
    adjoint: str = "move"
    transition: str | None = "move"

    def forward(
        self,
        inputs,
        *,
        n_out,
        transfers: tuple[Transfer, ...],
        in_shapes: tuple[tuple[int, ...], ...],
        out_shapes: tuple[tuple[int, ...], ...],
        **params,
    ):
        if len(out_shapes) != n_out or len(in_shapes) != len(inputs):
            raise LayoutError(
                f"move: the step gives {len(in_shapes)} input and {len(out_shapes)} output "
                f"shapes for a group of {len(inputs)} inputs and {n_out} outputs."
            )
        if not inputs:
            raise LayoutError("move needs at least one input tensor (for its dtype), got none.")
        like = inputs[0]
        outs = [torch.zeros(s, dtype=like.dtype, device=like.device) for s in out_shapes]
        for i, src_box, j, dst_box in transfers:
            outs[j][_region(dst_box)] += inputs[i][_region(src_box)]
        return outs

    def cost(self, group: Group, numel: int, **params: Any) -> float:
        sent: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        for i, src_box, j, _ in params.get("transfers", ()):
            a, b = group.src[i], group.dst[j]
            if a != b:
                sent[a] += _box_numel(src_box)
                recv[b] += _box_numel(src_box)
        return float(max([*sent.values(), *recv.values()], default=0))

    def adjoint_params(
        self,
        *,
        transfers: tuple[Transfer, ...],
        in_shapes: tuple[tuple[int, ...], ...],
        out_shapes: tuple[tuple[int, ...], ...],
        **params: Any,
    ) -> dict[str, Any]:
        return {
            **params,
            "transfers": tuple((j, db, i, sb) for i, sb, j, db in transfers),
            "in_shapes": out_shapes,
            "out_shapes": in_shapes,
        }


#: Every built-in primitive, in registration order.
BUILTIN_PRIMITIVES: tuple[Primitive, ...] = (
    AllReduce(),
    ReduceScatter(),
    AllGather(),
    AllToAll(),
    Chunk(),
    Pad(),
    ValueSplit(),
    Move(),
    Broadcast(),
    Reduce(),
    IdentityAllReduce(),
)


def validate_primitive(name: str, obj: Any) -> None:
    """The adapter registry's ``validate``: ``obj`` is a hashable `Primitive`
    registered under its own name, with a transition of `TRANSITIONS` (or None) and
    an adjoint name. (That the adjoint is registered is `check_adjoints`'s job, once
    every plugin has registered.)"""
    if not isinstance(obj, Primitive):
        raise TypeError(
            f"it is a {type(obj).__name__}, not a nnscaler.layout.Primitive. Fix: subclass "
            f"Primitive (a frozen attrs class with name, adjoint, transition, forward and "
            f"cost) and register an instance"
        )
    if obj.name != name:
        raise ValueError(
            f"it is registered as {name!r} but its name is {obj.name!r}; steps and "
            f"adjoints refer to primitives by name. "
            f"Fix: registry.register(prim.name, prim)"
        )
    if obj.transition is not None and obj.transition not in TRANSITIONS:
        raise ValueError(
            f"its transition {obj.transition!r} is not one of {list(TRANSITIONS)} (or None "
            f"for a primitive the planner never chooses)"
        )
    if not isinstance(obj.adjoint, str) or not obj.adjoint:
        raise ValueError(
            f"its adjoint {obj.adjoint!r} is not the name of a primitive. Fix: name the "
            f"primitive that computes its transpose (itself for all_reduce)"
        )
    try:
        hash(obj)
    except TypeError as e:
        raise TypeError(
            f"it is not hashable ({e}); plans are cached on their primitives. Fix: make it "
            f"a frozen attrs class with hashable fields (tuples, not lists)"
        ) from None


def check_adjoints(registry: Registry) -> None:
    """The adapter registry's ``validate_all``: every primitive's adjoint is registered."""
    for name, prim in registry.items():
        if prim.adjoint not in registry:
            raise RegistrationError(
                f"{registry.registrant(name)!r} registered adapter {name!r}, whose adjoint "
                f"{prim.adjoint!r} no plugin registered (registered: "
                f"{', '.join(sorted(registry))}). Fix: register {prim.adjoint!r} too, or "
                f"name a registered primitive as the adjoint"
            )


@hookimpl
def nnscaler_register_adapters(registry: Registry) -> None:
    """Register the built-in primitives under their names."""
    for prim in BUILTIN_PRIMITIVES:
        registry.register(prim.name, prim)
