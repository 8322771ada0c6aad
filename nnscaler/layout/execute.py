"""The simulator: run a plan's steps on per-device tensors held in one process.

It is the reference semantics of a plan. The runtime runs the same steps over process
groups; the tests compare both with the single-device tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nnscaler.layout.layout import LayoutError, check_pieces
from nnscaler.layout.steps import Plan, Step

__all__ = ["execute", "execute_adjoint", "run_step"]


def run_step(step: Step, state: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Apply one step to ``state`` (device -> tensor) and return the new state.

    Each group reads (and consumes) the tensors of its ``src`` devices and writes its
    ``dst`` devices; devices outside every group keep their tensors.
    """
    new = dict(state)
    written: dict[int, torch.Tensor] = {}
    kwargs = step.kwargs
    for group in step.groups:
        missing = [d for d in group.src if d not in state]
        if missing:
            raise LayoutError(
                f"step {step} reads devices {missing}, which hold no tensor at this point "
                f"(devices holding one: {sorted(state)})."
            )
        outs = step.primitive.forward([state[d] for d in group.src], n_out=len(group.dst), **kwargs)
        if len(outs) != len(group.dst):
            raise LayoutError(
                f"primitive {step.name!r} returned {len(outs)} tensors for group {group} "
                f"of {len(group.dst)} output devices; forward() must return one per output."
            )
        for d in group.src:
            new.pop(d, None)
        for d, t in zip(group.dst, outs):
            if d in written:
                raise LayoutError(f"step {step} writes device {d} twice; groups must be disjoint.")
            written[d] = t
    clash = sorted(d for d in written if d in new)
    if clash:
        raise LayoutError(
            f"step {step} writes devices {clash} that still hold a tensor it does not read; "
            f"a group must list every device it overwrites in its src."
        )
    new.update(written)
    return new


def execute(plan: Plan, per_device: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Run ``plan`` forward: the pieces of ``plan.src`` in, the pieces of ``plan.dst`` out
    (a dict by device, in ``plan.dst`` order)."""
    if not isinstance(plan, Plan):
        raise LayoutError(f"execute(): expected a Plan, got {type(plan).__name__}.")
    check_pieces(per_device, plan.src, f"execute() of plan {plan.src} -> {plan.dst}")
    state = dict(per_device)
    for step in plan.steps:
        state = run_step(step, state)
    if set(state) != set(plan.dst.devices):
        raise LayoutError(
            f"plan {plan.src} -> {plan.dst} ended with tensors on devices {sorted(state)} "
            f"instead of {sorted(plan.dst.devices)}; a primitive in it is inconsistent."
        )
    out = {dev: state[dev] for dev in plan.dst.devices}
    check_pieces(out, plan.dst, f"result of plan {plan.src} -> {plan.dst}")
    return out


def execute_adjoint(plan: Plan, grads: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Run the adjoint of ``plan``: gradients on ``plan.dst``'s devices in (their layout
    is ``plan.dst.dual()``), gradients on ``plan.src``'s devices out, the adjoint steps in
    reverse order. ``<execute(P, a), b> == <a, execute_adjoint(P, b)>``."""
    if not isinstance(plan, Plan):
        raise LayoutError(f"execute_adjoint(): expected a Plan, got {type(plan).__name__}.")
    return execute(plan.adjoint(), grads)
