"""The value types of a [`Program`][nnscaler.codegen.Program], the analysis code generation
writes from: the op steps, what each step reads, the adapters, the held leaves and the
outputs. `nnscaler.codegen.program` builds them; `nnscaler.codegen.emit` reads them.
"""

from __future__ import annotations

from typing import Any

import attrs

from nnscaler.codegen.pipeline import PipelinePlan, map_layout
from nnscaler.graph import IRGraph
from nnscaler.ir import FullTensor, Op, TensorKind
from nnscaler.layout import Layout, Plan

#: Names generated code uses at module level or as locals of every method.
RESERVED = frozenset({
    "self", "torch", "boundary", "Adapter", "ParallelModule", "nnscaler", "init_params",
    "GenModel", "_out", "Pipeline", "Piece", "parse_schedule", "anchored", "SCHEDULE",
})

@attrs.define(eq=False)
class AdapterSpec:
    """One layout change of one tensor: ``plan`` from ``src`` to ``dst`` (plan devices)."""

    index: int
    full: FullTensor
    src: Layout
    dst: Layout
    plan: Plan
    no_grad: bool
    result: str  # the local variable of the result
    label: str = ""  # what it moves, for the comment: the source variable or attribute

    @property
    def requires_grad(self) -> bool:
        return self.full.requires_grad and not self.no_grad

    def takes_part(self, device: int) -> bool:
        return device in self.src.devices or device in self.dst.devices


@attrs.define(eq=False)
class Read:
    """A tensor an op step reads, in one slot: through ``adapter`` or directly.

    ``first_part``: a weight the op reads in value parts (a row-parallel linear's bias)
    where the argument may be ``None``: the device of value part 0 passes the weight it
    holds, the others pass ``None`` (Megatron's bias on the first part; no adapter)."""

    full: FullTensor
    layout: Layout
    adapter: AdapterSpec | None
    first_part: bool = False


@attrs.define(eq=False)
class OpStep:
    """Consecutive instances of one traced op (at most one per device), the adapters to
    run before them and what each input slot reads."""

    origin: Op
    instances: dict[int, Op]
    adapters: list[AdapterSpec]
    reads: list[Read]
    no_grad: bool
    #: a collective part op: by device, the devices of the parts its instance there
    #: talks to, in part order (its ``group``)
    part_devices: dict[int, tuple[int, ...]] | None = None


@attrs.define(eq=False)
class Leaf:
    """A parameter, buffer or constant (``name``: its attribute), or a forward input
    (``name``: its local variable, ``access``: the expression on the forward's
    arguments). ``layout`` is where its pieces live.

    In a pipeline, ``layout`` is on the devices of pipeline device ``group`` (that of its
    first reader); every pipeline device in ``groups`` (those whose stages read it) holds
    the same pieces lane by lane (see `nnscaler.codegen.pipeline`)."""

    full: FullTensor
    layout: Layout
    name: str
    access: str = ""
    group: int = 0
    groups: set[int] = attrs.field(factory=set)

    @property
    def kind(self) -> TensorKind:
        return self.full.kind


@attrs.define(eq=False)
class Output:
    """One graph output tensor, brought to ``layout`` (``R(plan_ngpus)``)."""

    full: FullTensor
    layout: Layout
    adapter: AdapterSpec | None


@attrs.define(eq=False)
class Program:
    """Everything `nnscaler.codegen.emit` needs to write any rank's file."""

    graph: IRGraph
    plan_ngpus: int
    runtime_ngpus: int
    end2end: bool
    inference_only: bool
    reducer_config: dict[str, Any]
    args: list[tuple[str, str | None]]  # forward arguments: (name, default source or None)
    steps: list[OpStep]
    outputs: list[Output]
    output_adapters: list[AdapterSpec]
    leaves: dict[FullTensor, Leaf]  # params, buffers, constants (held) and inputs
    variables: dict[FullTensor, str]  # activation -> local variable
    adapters: list[AdapterSpec]
    process_groups: list[tuple[int, ...]]
    reducer_groups: list[tuple[int, ...]]
    pipeline: PipelinePlan | None = None
    #: ``torch.compile``'s keywords (``ComputeConfig.compiler``), None when compile is off
    compile_config: dict[str, Any] | None = None
    #: what produced the plan, for the file's header: ``module`` (class path), ``policy``
    #: (name) and ``config`` (compute config fields beyond the sizes and reducer options)
    origin: dict[str, Any] = attrs.field(factory=dict)

    @property
    def nunits(self) -> int:
        return self.runtime_ngpus // self.plan_ngpus

    def unit_ranks(self, unit: int) -> tuple[int, ...]:
        return tuple(unit * self.plan_ngpus + d for d in range(self.plan_ngpus))

    def holders(self, layout: Layout, device: int) -> tuple[int, ...]:
        """The runtime ranks that hold the same piece as ``device`` does in ``layout``
        (every replica, in every scale unit), sorted."""
        box = layout.box(device)
        same = [d for d in layout.devices if layout.box(d) == box]
        return tuple(sorted(u * self.plan_ngpus + d for u in range(self.nunits) for d in same))

    def held_layouts(self, leaf: Leaf) -> list[Layout]:
        """Every layout ``leaf`` is held in: its layout, and in a pipeline its copy on
        every pipeline device whose stages read it."""
        pipe = self.pipeline
        if pipe is None or leaf.kind is TensorKind.INPUT:
            return [leaf.layout]
        src = pipe.groups[leaf.group]
        return [map_layout(leaf.layout, src, pipe.groups[g]) for g in sorted(leaf.groups)]

    def held_layout(self, leaf: Leaf, device: int) -> Layout | None:
        """The layout of ``leaf`` that holds ``device``'s piece, or None."""
        for layout in self.held_layouts(leaf):
            if device in layout.devices:
                return layout
        return None

    def leaf_holders(self, leaf: Leaf, device: int) -> tuple[int, ...]:
        """The runtime ranks holding the same piece of ``leaf`` as ``device``: replicas
        in every held copy (the stages of a tied weight) and every scale unit."""
        layout = self.held_layout(leaf, device)
        if layout is None:
            return ()
        box = layout.box(device)
        same = [d for lay in self.held_layouts(leaf) for d in lay.devices if lay.box(d) == box]
        return tuple(sorted({u * self.plan_ngpus + d for u in range(self.nunits) for d in same}))
