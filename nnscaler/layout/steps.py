"""The vocabulary of plans: primitives, device groups, steps and plans.

A `Primitive` is a small frozen value: its forward semantics on the list of
tensors of one device group, its cost, and the *name* of its adjoint primitive (looked
up in the same registry). A `Step` applies one primitive to disjoint device
groups with one set of parameters; a `Plan` is the tuple of steps that turns a
tensor in layout ``src`` into the same tensor in layout ``dst``.

Nothing here communicates (a primitive's runtime side, `Primitive.run_step`, is called by
the runtime, which passes it the process groups' ranks): the simulator (`nnscaler.layout.execute`) runs steps on
per-device tensors in one process, and the runtime runs the same steps over process
groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from nnscaler.layout.layout import Layout

__all__ = ["TRANSITIONS", "Group", "Plan", "Primitive", "Step"]

#: The layout moves a primitive can declare in `Primitive.transition`. ``"A->B"``
#: moves a factor ``k`` of the device grid from axis A to axis B (R, V, or a D dim) over
#: groups of ``k`` devices; ``"move"`` is a point-to-point copy (with sums) between any
#: two layouts; ``"broadcast"`` sends one piece to many devices.
TRANSITIONS: tuple[str, ...] = (
    "V->R",
    "V->D",
    "D->R",
    "D->D",
    "R->D",
    "R->V",
    "D->V",
    "move",
    "broadcast",
)


@attrs.frozen(kw_only=True)
class Primitive:
    """A communication (or local) primitive over one device group.

    Subclasses implement `forward` and `cost`; both receive the step's
    parameters as keywords. ``adjoint`` names the primitive that computes the transpose
    of this one (``<forward(x), y> == <x, adjoint.forward(y)>`` summed over devices) and
    `adjoint_params` maps this primitive's parameters to the adjoint's.
    ``transition`` (one of `TRANSITIONS`, or ``None``) tells the planner which
    layout move this primitive performs; the planner only uses primitives that declare
    one. ``exact_adjoint`` is ``False`` for the rare primitive whose declared backward is
    a convention, not the transpose (see ``identity_allreduce``).
    """

    name: str
    adjoint: str
    transition: str | None = None
    exact_adjoint: bool = True

    def forward(
        self, inputs: Sequence[torch.Tensor], *, n_out: int, **params: Any
    ) -> list[torch.Tensor]:
        """The tensors of the ``n_out`` output devices of one group, from its inputs."""
        raise NotImplementedError(f"primitive {self.name!r} does not define forward()")

    def cost(self, group: Group, numel: int, **params: Any) -> float:
        """Elements sent or received by the busiest device of ``group`` (each input holds
        ``numel`` elements)."""
        return 0.0

    def adjoint_params(self, **params: Any) -> dict[str, Any]:
        """The adjoint's parameters for a step with these ``params`` (default: the same)."""
        return dict(params)

    #: the runtime side: whether `run_step`'s groups need a process group (a collective,
    #: ``src == dst``); point-to-point and local steps leave it False
    needs_process_group: ClassVar[bool] = False

    def run_step(self, step: Step, rank: int, x: torch.Tensor | None,
                 ctx: dict[str, Any]) -> torch.Tensor | None:
        """The runtime side: this rank's part of ``step`` on ``x``, its tensor before the
        step (None if it holds none); returns its tensor after (None if it then holds
        none). ``ctx`` has the ``dtype`` and ``device`` of the plan's tensors.

        A primitive registered through ``nnscaler_register_adapters`` brings both of its
        sides in that one registration: the planner composes `forward`, `cost` and the
        adjoint; the runtime (`nnscaler.runtime.execute_plan`) calls `run_step`. A
        subclass of a built-in primitive inherits the built-in's runtime and need not
        define it."""
        raise NotImplementedError(f"primitive {self.name!r} does not define run_step()")


@attrs.frozen
class Group:
    """One device group of a step: inputs are read from ``src`` (and consumed there),
    outputs written to ``dst``. Collectives have ``src == dst``."""

    src: tuple[int, ...] = attrs.field(converter=tuple)
    dst: tuple[int, ...] = attrs.field(converter=tuple)

    @classmethod
    def of(cls, devices: Sequence[int]) -> Group:
        """A collective group: the same devices in and out."""
        return cls(tuple(devices), tuple(devices))

    def swapped(self) -> Group:
        return Group(self.dst, self.src)

    def __str__(self) -> str:
        def show(xs: tuple[int, ...]) -> str:
            return "[" + ",".join(map(str, xs)) + "]"

        if self.src == self.dst:
            return show(self.src)
        return f"{show(self.src)}->{show(self.dst)}"


def _freeze(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(params.items())


def _short(value: Any) -> str:
    text = repr(value)
    if len(text) <= 40:
        return text
    size = f" of {len(value)}" if isinstance(value, (tuple, list)) else ""
    return f"<{type(value).__name__}{size}>"


@attrs.frozen(kw_only=True)
class Step:
    """One primitive applied to disjoint device groups, with the layouts around it.

    ``before``/``after`` describe the tensor before and after the step (a step may start
    from a relabelled but equivalent description of the previous step's ``after``).
    ``cost`` is elements sent or received by the busiest device.
    """

    primitive: Primitive
    adjoint: Primitive
    groups: tuple[Group, ...]
    params: tuple[tuple[str, Any], ...] = ()
    before: Layout
    after: Layout
    cost: float = 0.0

    @property
    def name(self) -> str:
        return self.primitive.name

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    def adjoint_step(self) -> Step:
        """The step that runs the adjoint of this one, from the dual of ``after`` back to
        the dual of ``before``."""
        groups = tuple(g.swapped() for g in self.groups)
        params = self.primitive.adjoint_params(**self.kwargs)
        after = self.before.dual()
        before = self.after.dual()
        cost = max(
            (self.adjoint.cost(g, before.piece_numel, **params) for g in groups), default=0.0
        )
        return Step(
            primitive=self.adjoint,
            adjoint=self.primitive,
            groups=groups,
            params=_freeze(params),
            before=before,
            after=after,
            cost=cost,
        )

    def __str__(self) -> str:
        args = ", ".join(f"{k}={_short(v)}" for k, v in self.params)
        groups = " ".join(map(str, self.groups))
        return f"{self.name}({args}) on {groups}"


@attrs.frozen(kw_only=True)
class Plan:
    """The steps that move a tensor from layout ``src`` to layout ``dst``.

    ``cost`` estimates communication: elements sent or received by the busiest device,
    summed over steps (`cost_bytes` multiplies by the element size).
    """

    src: Layout
    dst: Layout
    steps: tuple[Step, ...] = ()

    @property
    def cost(self) -> float:
        return sum(step.cost for step in self.steps)

    def cost_bytes(self, itemsize: int) -> float:
        """`cost` in bytes for elements of ``itemsize`` bytes."""
        return self.cost * itemsize

    @property
    def names(self) -> tuple[str, ...]:
        """The primitive names of the steps, in order."""
        return tuple(step.name for step in self.steps)

    def adjoint(self) -> Plan:
        """The plan for gradients: adjoint steps in reverse order, from ``dst.dual()`` to
        ``src.dual()``."""
        return Plan(
            src=self.dst.dual(),
            dst=self.src.dual(),
            steps=tuple(step.adjoint_step() for step in reversed(self.steps)),
        )

    def __str__(self) -> str:
        head = f"plan {self.src} -> {self.dst} (cost {self.cost:g} elements/device)"
        return "\n".join([head, *(f"  {i}. {s}" for i, s in enumerate(self.steps, 1))])
