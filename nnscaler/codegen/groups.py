"""The process groups every rank creates, and the parameter holder sets.

``torch.distributed.new_group`` is collective over the whole job, so every generated
file carries the same list, in the same order: the groups of every adapter (forward and
backward) in every scale unit, the scale units themselves when an input needs its
gradient summed or a pipeline shares its outputs, and the reducers' groups (ZeRO's
sub-groups included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from nnscaler.codegen.errors import CodegenError
from nnscaler.codegen.layouts import relabel_invariant, unit_plan
from nnscaler.ir import TensorKind
from nnscaler.runtime import plan_groups, zero_groups

if TYPE_CHECKING:
    from nnscaler.codegen.program_types import Program


def process_groups(p: Program) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The process groups every rank creates (same list, same order, on every rank), and
    the holder sets of the parameters (one reducer each), in a global order."""
    groups: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()

    def add(ranks: Sequence[int]) -> None:
        key = tuple(sorted(ranks))
        if len(key) > 1 and key not in seen:
            seen.add(key)
            groups.append(key)

    invariant = relabel_invariant()
    # where plans are renamed between units, so are their groups (sorted tuples shifted by
    # the unit's offset stay sorted, in the same order): found once, in unit 0
    first = [plan_groups(spec.plan, grad="exact") for spec in p.adapters] if invariant \
        else None
    for unit in range(p.nunits):
        offset = unit * p.plan_ngpus
        for k, spec in enumerate(p.adapters):
            if first is not None:
                for ranks in first[k]:
                    add([r + offset for r in ranks])
                continue
            for ranks in plan_groups(unit_plan(spec.plan, offset), grad="exact"):
                add(ranks)
    for unit in range(p.nunits):  # the parts of collective part ops
        offset = unit * p.plan_ngpus
        for step in p.steps:
            for devices in (step.part_devices or {}).values():
                add([offset + d for d in devices])
    if p.pipeline is not None or any(
            f.requires_grad for f in p.leaves if f.kind is TensorKind.INPUT):
        # inputs' gradients are summed over the unit; a pipeline's outputs are shared in it
        for unit in range(p.nunits):
            add(p.unit_ranks(unit))
    holder_sets: set[tuple[int, ...]] = set()
    if not p.inference_only:
        for leaf in p.leaves.values():
            if leaf.kind is TensorKind.PARAMETER and leaf.full.requires_grad:
                for layout in p.held_layouts(leaf):
                    for device in layout.devices:
                        holder_sets.add(p.leaf_holders(leaf, device))
    reducer_groups = sorted(holder_sets, key=lambda hs: (len(hs), hs))
    ngroups = p.reducer_config["zero_ngroups"]
    for hs in reducer_groups:
        add(hs)
        if p.reducer_config["use_zero"] and ngroups > 1 and len(hs) > 1:
            if len(hs) % ngroups:
                raise CodegenError(
                    f"zero_ngroups={ngroups} must divide the number of ranks that hold each "
                    f"parameter piece, but the ranks {list(hs)} hold some pieces together "
                    f"({len(hs)} ranks); choose a zero_ngroups that divides {len(hs)}, or 1"
                )
            for rank in hs:
                zg = zero_groups(hs, ngroups, rank)
                add(zg.zero_ranks)
                add(zg.cross_ranks)
    return groups, reducer_groups
