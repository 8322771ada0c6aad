"""RVD layouts and the pure planner that moves a tensor between them.

- `Layout`: ``R(r)V(v)D(d...)@[devices]`` over a known full shape, with
  `piece`, `materialize` and `assemble`;
- `Primitive`, `Step`, `Plan`: the vocabulary of plans; the
  built-in primitives are a plugin (`nnscaler.layout.primitives`) registered
  through ``nnscaler_register_adapters``;
- `plan`: the cheapest composition of registered primitives, pure and cached;
- `execute`, `execute_adjoint`: the single-process simulator.

Nothing here talks to ``torch.distributed``; see ``docs/layouts.md``.
"""

from __future__ import annotations

from nnscaler.layout.execute import execute, execute_adjoint, run_step
from nnscaler.layout.layout import Layout, LayoutError, Piece, assemble, materialize, piece
from nnscaler.layout.planner import plan
from nnscaler.layout.steps import TRANSITIONS, Group, Plan, Primitive, Step

__all__ = [
    "TRANSITIONS",
    "Group",
    "Layout",
    "LayoutError",
    "Piece",
    "Plan",
    "Primitive",
    "Step",
    "assemble",
    "execute",
    "execute_adjoint",
    "materialize",
    "piece",
    "plan",
    "run_step",
]
