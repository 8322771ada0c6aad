"""Check an op's annotation against the op itself (the annotation's *promise*).

`verify_op` runs the op on whole inputs, then on the pieces of every entry of its
transform space, recombines the pieces as the layouts say and compares. Users can call
it on their own ``register_op`` ops; the test suite calls it on every built-in op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nnscaler.anno import Transform, check_promise
from nnscaler.ops.registry import OpDef, OpRegistry
from nnscaler.registry import active_registry


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def verify_op(
    opdef: OpDef,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    registry: OpRegistry | None = None,
) -> list[Transform]:
    """Check ``opdef`` on the call ``fn(*args, **kwargs)``; returns the checked transforms.

    ``registry`` resolves the part ops that transform rules name (default: the process-wide
    op registry). Raises `nnscaler.anno.PromiseBrokenError` naming the transform and
    output that disagree.
    """
    call = opdef.bind(tuple(args), dict(kwargs or {}))

    def run(*inputs: Any, **kw: Any) -> Any:
        # in-place ops mutate their inputs: every run gets its own copies
        return opdef.call(
            [_clone(x) for x in inputs],
            {k: _clone(v) for k, v in kw.items()},
            keywords=call.keywords,
        )

    def part_op(name: str) -> tuple[Callable[..., Any], bool]:
        part = (registry if registry is not None else active_registry("ops")).get(name)

        def run_part(*inputs: Any, **kw: Any) -> Any:
            return part.call([_clone(x) for x in inputs],
                             {k: _clone(v) for k, v in kw.items()}, keywords=call.keywords)

        return run_part, part.collective

    return check_promise(
        run,
        call.anno,
        call.inputs,
        call.kwargs,
        rules=opdef.rules_for(call.anno.bind(call.shapes(), call.kwargs)),
        rtol=rtol,
        atol=atol,
        part_kwargs=opdef.part_kwargs,
        part_op=part_op,
    )
