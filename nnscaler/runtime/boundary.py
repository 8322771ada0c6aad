"""The edges of a parallel module, and the adapters generated code runs inside it.

Inside a parallel module gradients follow the *exact adjoint* convention
(``docs/internals/parallel-runtime.md``): the gradient of a replicated tensor is held as
shares that sum to it. Two functions make that agree with what the user sees:

- `output`: every output of the module is replicated on the devices of the scale
  unit and every rank calls ``backward`` with the whole gradient; the backward keeps it
  on the ``first`` device and gives zeros elsewhere, so the shares sum to it once. Its
  ``anchors`` are tensors of this rank that reach no output (e.g. the empty result of an
  adapter that only sends): they get a zero gradient, so that their backward (which
  takes part in collectives) runs on this rank too.
- `input`: a forward argument that requires grad arrives replicated on every rank
  of the unit; its gradient is all-reduced over ``ranks``, so every rank holds all of it.

`Adapter` is what generated code instantiates for each layout change: the two
layouts (in ``str(Layout)`` form, over runtime ranks), the full shape and dtype; the plan
is made on first use and run with `nnscaler.runtime.execute_plan` on this rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.gendir import gencode_name
from nnscaler.layout import Layout, Plan
from nnscaler.layout import plan as make_plan
from nnscaler.runtime.adapters import execute_plan, plan_groups
from nnscaler.runtime.collectives import CollectiveError, raw_all_reduce
from nnscaler.runtime.compiling import outside_compiled
from nnscaler.runtime.device import current_device

__all__ = ["Adapter", "check_inputs", "input", "output"]


class _Output(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, first: bool, t: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.first = first
        ctx.anchors = [(a.shape, a.dtype, a.device) for a in anchors]
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grad = g if ctx.first else torch.zeros_like(g)
        zeros = [torch.zeros(shape, dtype=dtype, device=device)
                 for shape, dtype, device in ctx.anchors]
        return (None, grad, *zeros)


class _Input(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, ranks: tuple[int, ...]) -> torch.Tensor:  # type: ignore[override]
        ctx.ranks = ranks
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return raw_all_reduce(g.contiguous(), ctx.ranks), None


@outside_compiled
def output(t: Any, first: bool, anchors: Sequence[torch.Tensor] = ()) -> Any:
    """An output of the module: identity forward; backward keeps the gradient on the
    ``first`` device of the output's layout and gives zeros elsewhere (and zeros to
    ``anchors``). Non-tensors pass through."""
    if not isinstance(t, torch.Tensor) or not torch.is_grad_enabled():
        return t
    live = [a for a in anchors if isinstance(a, torch.Tensor) and a.requires_grad]
    if not t.requires_grad and not live:
        return t
    return _Output.apply(bool(first), t, *live)


@outside_compiled
def input(t: Any, ranks: Sequence[int]) -> Any:  # noqa: A001 - the contract's name
    """A forward argument that requires grad: identity forward; backward all-reduces the
    gradient over ``ranks`` (the scale unit's ranks). Other values pass through."""
    ranks = tuple(int(r) for r in ranks)
    if (not isinstance(t, torch.Tensor) or not t.requires_grad or not torch.is_grad_enabled()
            or len(ranks) < 2):
        return t
    return _Input.apply(t, ranks)


def data_input(t: Any, name: str) -> Any:
    """A floating-point forward argument that did not require grad when the module was
    traced: the generated code does not sum its gradient over the scale unit (it holds
    shares there), so a value that requires grad now would get a wrong gradient. Raise
    instead; other values pass through."""
    if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
        from nnscaler.runtime.module import ParallelModuleError

        raise ParallelModuleError(
            f"the forward argument {name!r} requires grad, but its dummy value did not when "
            f"the module was parallelized, so the generated code does not sum its gradient "
            f"over the devices of the scale unit (the gradient would be wrong). Parallelize "
            f"with a dummy that requires grad, like the real one (e.g. "
            f"{name.split('[')[0]!r}: x.detach().requires_grad_()), or detach the input"
        )
    return t


def _fmt(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)} and dtype {value.dtype}"
    return f"{value!r} ({type(value).__name__})"


def _same_constant(value: Any, traced: Any) -> bool:
    if traced is None or value is None:
        return value is traced
    if isinstance(value, torch.Tensor) or isinstance(value, bool) != isinstance(traced, bool):
        return False
    try:
        return bool(value == traced)
    except Exception:  # noqa: BLE001 - values that cannot be compared are not the same
        return False


def check_inputs(expected: dict[str, tuple[Any, ...]]) -> None:
    """The forward arguments against what the module was traced with, before anything
    runs (no collective has started, so every rank that sees a difference stops here).

    ``expected`` maps each argument (``"x"``, ``"batch['ids']"``) to ``(value, shape,
    dtype)`` for a tensor, or ``(value, traced)`` for a Python value that the generated
    code holds as a constant. The generated program is specialised to these: the plan's
    splits, layouts and message sizes follow from the traced shapes, so nothing may differ.
    """
    for name, entry in expected.items():
        if len(entry) == 3:
            value, shape, dtype = entry
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shape) \
                    and value.dtype == dtype:
                continue
            traced = f"a tensor of shape {list(shape)} and dtype {dtype}"
            cast = (f", or cast it with .to({dtype})" if isinstance(value, torch.Tensor)
                    and value.dtype != dtype else "")
            fix = (f"Feed inputs of the traced shape and dtype (drop_last=True for a smaller "
                   f"last batch, or pad it{cast}), or parallelize again with dummy inputs like "
                   f"this one (instance_name='...' keeps both)")
        else:
            value, traced_value = entry
            if _same_constant(value, traced_value):
                continue
            traced = f"{traced_value!r}, which it holds as a constant"
            fix = (f"Pass {traced_value!r}, or parallelize again with the value you use in "
                   f"dummy_forward_args")
        from nnscaler.runtime.module import ParallelModuleError

        raise ParallelModuleError(
            f"the forward argument {name!r} is {_fmt(value)}, but the module was parallelized "
            f"with {traced}: the generated code is specialised to what it was traced with "
            f"(its splits, layouts and communication follow from the traced shapes and "
            f"dtypes; plans are not shape-generic), so no input may differ. {fix}."
        )


class Adapter:
    """One layout change in generated code: ``Adapter(src, dst, shape=..., dtype=...)``.

    ``src`` and ``dst`` are layouts in their ``str`` form over runtime ranks
    (``"R(1)V(1)D(2,1)@[0,1]"``). Calling it with this rank's piece of ``src`` (``None``
    on a rank that holds none) returns this rank's piece of ``dst`` (an empty tensor that
    carries the backward on a rank that only sends). Its backward is the exact adjoint.
    """

    def __init__(self, src: str, dst: str, *, shape: Sequence[int],
                 dtype: torch.dtype | None = None) -> None:
        self.src = Layout.parse(src, shape=tuple(shape))
        self.dst = Layout.parse(dst, shape=tuple(shape))
        self.dtype = dtype
        self._plan: Plan | None = None

    @property
    def plan(self) -> Plan:
        """The layout plan (made on first use; pure, so the same on every rank)."""
        if self._plan is None:
            self._plan = make_plan(self.src, self.dst)
        return self._plan

    def groups(self) -> list[tuple[int, ...]]:
        """The process groups running this adapter (forward and backward) needs."""
        return plan_groups(self.plan, grad="exact")

    @outside_compiled
    def __call__(self, x: torch.Tensor | None) -> torch.Tensor:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        device = x.device if x is not None else current_device()
        out = execute_plan(self.plan, x, rank=rank, grad="exact", dtype=self.dtype,
                           device=device)
        if out is None:
            raise CollectiveError(
                f"{self!r} was called on rank {rank}, which takes no part in it (its ranks "
                f"are {sorted(set(self.src.devices) | set(self.dst.devices))}); generated code "
                f"calls an adapter only on its ranks: load {gencode_name(rank)} on rank {rank}"
            )
        return out

    def __repr__(self) -> str:
        return f"Adapter({str(self.src)!r}, {str(self.dst)!r}, shape={self.src.shape})"
