"""``run_plan``: run a planned graph on one process, every op instance on its own pieces.

The simulator is the reference that plans are tested against: a partitioned, replicated
graph must compute what the module computes. It runs the op instances in program order.
For each piece an instance reads, it assembles the region of the full tensor from the
pieces written so far (summing value parts, placing index ranges, see
`nnscaler.graph.pieces`) and cuts the piece: a value part ``p`` of ``n`` holds the
whole value when ``p == 0`` and zeros otherwise, so the parts sum to the value. Leaves
(parameters, buffers, constants, inputs) are the module's and the arguments' own tensors,
so autograd runs through the pieces back to the module's parameters.

The parts of a split that talk to each other (a collective part op, e.g. a cross-entropy
over classes split in parts) run together, as threads joined by a
`PartGroup`.

Devices are not simulated: every instance runs here, whatever its device. Moving pieces
between devices is the layout layer's job, with its own simulator.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from nnscaler.anno.partgroup import PartGroup, run_parts
from nnscaler.graph.check import written_by
from nnscaler.graph.errors import RunPlanError
from nnscaler.graph.graph import IRGraph, as_irgraph
from nnscaler.graph.pieces import Gap, Ranges, ValueKey, cover
from nnscaler.ir import (
    CURRENT_DEVICE,
    FullTensor,
    Graph,
    Op,
    SubTensor,
    default_device,
    leaf_values,
)


def _slices(ranges: Ranges, within: Ranges) -> tuple[slice, ...]:
    """``ranges`` as slices of a tensor that holds the region ``within``."""
    return tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(ranges, within, strict=True))


def _cut(value: torch.Tensor, ranges: Ranges, within: Ranges) -> torch.Tensor:
    return value if ranges == within else value[_slices(ranges, within)]


def _same_shape(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return a == b or (a == (1,) and b == ()) or (a == () and b == (1,))


_NOT_RUN = object()


def _call_part(op: Op, inputs: list[Any], kwargs: dict[str, Any], group: PartGroup) -> Any:
    return op.call(inputs, {**kwargs, "group": group})


def run_plan(
    graph: Graph,
    module: torch.nn.Module | Mapping[str, torch.Tensor],
    forward_args: Mapping[str, Any],
    *,
    device: torch.device | str | None = None,
) -> Any:
    """Run every op instance of ``graph`` on its pieces and return the forward's outputs.

    ``module`` is the traced module (or its ``name -> tensor`` parameters and buffers) and
    ``forward_args`` the forward's arguments, as for `nnscaler.ir.run_graph`. Raises
    `RunPlanError` when a piece cannot be formed (run
    `check_plan` first for the full diagnosis).
    """
    return _PlanRun(as_irgraph(graph), module, forward_args, device).run_all()


class _PlanRun:
    """One run of `run_plan`: the pieces written so far and the regions assembled."""

    def __init__(self, g: IRGraph, module: torch.nn.Module | Mapping[str, torch.Tensor],
                 forward_args: Mapping[str, Any], device: torch.device | str | None) -> None:
        self.g = g
        self.leaves = leaf_values(g, module, forward_args)
        self.device = default_device(self.leaves) if device is None else torch.device(device)
        self.written: dict[FullTensor, list[tuple[SubTensor, ValueKey, torch.Tensor]]] = {}
        self.regions: dict[tuple[FullTensor, Ranges], torch.Tensor] = {}
        pieces_of: dict[Op, list[SubTensor]] = {}
        for op in g.ops:
            pieces_of.setdefault(g.origin(op), []).extend(op.input_tensors() + op.output_tensors())
        self.whole = {o for o, pieces in pieces_of.items() if all(p.is_whole for p in pieces)}
        self.ran_in_place: set[Op] = set()
        self.ran_together: set[Op] = set()

    # -- reading pieces -----------------------------------------------------------------
    def who(self, reader: Op | None) -> str:
        return "the graph's output" if reader is None else self.g.describe(reader)

    def region(self, full: FullTensor, ranges: Ranges, reader: Op | None) -> torch.Tensor:
        """The whole value of ``full`` over ``ranges``, for ``reader`` (None: the output)."""
        if full in self.leaves:
            return _cut(self.leaves[full], ranges, full.whole().indmap)
        key = (full, ranges)
        if key in self.regions:
            return self.regions[key]
        entries = self.written.get(full, [])
        found = cover(ranges, [e[0] for e in entries], [e[1] for e in entries])
        if isinstance(found, Gap):
            raise RunPlanError(f"{self.who(reader)} reads {full} over {list(ranges)}, but the "
                               f"pieces written before it do not form it at {found}; "
                               f"check_plan(graph, ndevices) explains which op is missing")
        sums = []
        for cell in found:
            terms = [_cut(entries[i][2], cell.ranges, entries[i][0].indmap) for i in cell.picks]
            value = terms[0]
            for term in terms[1:]:
                value = value + term
            sums.append((cell.ranges, value))
        if len(sums) == 1:  # one cell: the region itself (a single piece: its very tensor)
            total = sums[0][1]
        else:
            first = sums[0][1]
            total = torch.zeros([b - a for a, b in ranges], dtype=first.dtype, device=first.device)
            for cell_ranges, value in sums:
                total[_slices(cell_ranges, ranges)] = value
        self.regions[key] = total
        return total

    def read(self, piece: SubTensor, reader: Op | None) -> torch.Tensor:
        value = self.region(piece.full, piece.indmap, reader)
        part, _ = piece.valmap
        return value if part == 0 else torch.zeros_like(value)

    def plain(self, leaf: Any, reader: Op | None) -> Any:
        """The value of one argument leaf: a piece read for ``reader``, the device, or a
        constant."""
        if isinstance(leaf, SubTensor):
            return self.read(leaf, reader)
        return self.device if leaf is CURRENT_DEVICE else leaf

    # -- running ops --------------------------------------------------------------------
    def run_all(self) -> Any:
        grad_on = torch.is_grad_enabled()
        try:
            for op in self.g.ops:
                torch.set_grad_enabled(grad_on and not op.no_grad)
                if op in self.ran_together:
                    continue
                if op.opdef is not None and op.opdef.collective:
                    self.run_together(op)
                else:
                    self.run(op)
        finally:
            torch.set_grad_enabled(grad_on)
        return pytree.tree_map(lambda leaf: self.plain(leaf, None), self.g.outputs)

    def run(self, op: Op, computed: Any = _NOT_RUN) -> None:
        """Run one instance (or take its ``computed`` result) and record what it wrote."""
        origin = self.g.origin(op)
        mutated = {before: after for before, after in op.mutations}
        # An in-place op whose instances all hold whole pieces runs once, on the very
        # tensors (so that writes through views reach their base, as in run_graph); its
        # replicas write the same pieces. Otherwise each instance writes its own copy.
        in_place = bool(mutated) and origin in self.whole
        if in_place and origin in self.ran_in_place:
            return
        if in_place:
            self.ran_in_place.add(origin)
        read_fulls = {p.full for p in op.input_tensors()}
        through_view = [b for b in mutated if b.full not in read_fulls]
        if through_view and not in_place:
            raise RunPlanError(
                f"{self.g.describe(op)} writes {through_view[0].full} in place through a view; "
                f"the simulator follows such writes only when every instance of the op is whole"
            )
        values: dict[SubTensor, torch.Tensor] = {}

        def value_of(leaf: Any) -> Any:
            if isinstance(leaf, SubTensor):
                if leaf not in values:
                    value = self.read(leaf, op)
                    if leaf in mutated and not in_place:
                        value = value.clone()  # each instance writes its own copy
                    values[leaf] = value
                return values[leaf]
            return self.plain(leaf, op)

        inputs = pytree.tree_map(value_of, list(op.inputs))
        kwargs = pytree.tree_map(value_of, dict(op.kwargs))
        result = op.call(inputs, kwargs) if computed is _NOT_RUN else computed
        produced = self.outputs_of(op, result)
        self.add_mutations(op, produced, values, mutated)
        for piece, key in written_by(self.g, op):
            self.written.setdefault(piece.full, []).append((piece, key, produced[piece]))

    def outputs_of(self, op: Op, result: Any) -> dict[SubTensor, torch.Tensor]:
        """The pieces ``op`` wrote, from its result, checked against the graph."""
        results = pytree.tree_leaves(result)
        if len(results) != len(op.outputs):
            raise RunPlanError(f"{self.g.describe(op)} returned {len(results)} values where the "
                               f"graph records {len(op.outputs)}")
        produced: dict[SubTensor, torch.Tensor] = {}
        for ir, value in zip(op.outputs, results, strict=True):
            if not isinstance(ir, SubTensor):
                continue
            if not isinstance(value, torch.Tensor) or not _same_shape(tuple(value.shape), ir.shape):
                got = (f"shape {list(value.shape)}" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                raise RunPlanError(f"{self.g.describe(op)} should write the piece {ir} of shape "
                                   f"{list(ir.shape)} but returned {got}")
            produced.setdefault(ir, value.reshape(ir.shape))
        return produced

    def add_mutations(self, op: Op, produced: dict[SubTensor, torch.Tensor],
                      values: dict[SubTensor, torch.Tensor],
                      mutated: dict[SubTensor, SubTensor]) -> None:
        """Add to ``produced`` the new values of the tensors ``op`` wrote in place."""
        for before, after in op.mutations:
            if after in produced:
                continue
            if before in values:
                produced[after] = values[before]
                continue
            # written through a view: the base must share the view's storage
            value = self.read(before, op)
            storage = value.untyped_storage().data_ptr()
            if not any(values[b].untyped_storage().data_ptr() == storage
                       for b in mutated if b in values):
                raise RunPlanError(
                    f"{self.g.describe(op)} writes {before.full} in place through a view, but "
                    f"here the view's value was assembled from pieces, so the write cannot "
                    f"reach its base; keep the ops between the base and the write whole"
                )
            produced[after] = value

    def run_together(self, op: Op) -> None:
        """The parts of a split that talk to each other (a collective part op) run at
        once, as threads joined by a PartGroup (nnscaler.anno.partgroup.run_parts)."""
        parts = self.g.split_parts(op)
        calls = []
        for part in parts:
            if part.mutations:
                raise RunPlanError(f"{self.g.describe(part)} is a collective part op that "
                                   f"writes in place, which the simulator does not follow")
            inputs = pytree.tree_map(lambda leaf, p=part: self.plain(leaf, p), list(part.inputs))
            kwargs = pytree.tree_map(lambda leaf, p=part: self.plain(leaf, p), dict(part.kwargs))
            calls.append(functools.partial(_call_part, part, inputs, kwargs))
        for part, result in zip(parts, run_parts(calls), strict=True):
            self.ran_together.add(part)
            self.run(part, result)
