"""``torch.compile`` of generated code, with communication left outside the compiled regions.

A generated ``_forward_impl`` is straight-line PyTorch between calls into the runtime that
communicate: the adapters (`nnscaler.runtime.Adapter`), the module's inputs and outputs
(`nnscaler.runtime.boundary`) and the collective part ops' groups
(`nnscaler.runtime.ProcessPartGroup`). Those entry points are marked with
`outside_compiled`: under ``torch.compile`` each one is a graph break, so Dynamo compiles
the computation between two communications as one region (its backward with it, through
AOTAutograd) and the collectives run eagerly between regions, in program order, on every
rank alike. The backend never sees a process group, so any backend works, gloo and NCCL
alike; the bucketed reducer's hooks fire after each region's backward as in eager mode.

Nothing here imports ``torch._dynamo`` until a module asks to be compiled (importing it
costs seconds): until then a marked function costs one extra Python call; afterwards
every call of it switches Dynamo off around it (a few microseconds).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from nnscaler.errors import CompileError

__all__ = ["CompileError", "compile_forward", "outside_compiled"]

F = TypeVar("F", bound=Callable[..., Any])

# per mark: the wrapper, the function, a one-slot list for its torch._dynamo.disable'd twin
_MARKED: list[tuple[Callable[..., Any], Callable[..., Any], list[Callable[..., Any] | None]]] = []


def outside_compiled(fn: F) -> F:
    """Mark ``fn`` as communication: inside a ``torch.compile``'d region a call to it ends
    the region, runs eagerly (with everything it calls) and a new region starts after it."""
    eager: list[Callable[..., Any] | None] = [None]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return (eager[0] or fn)(*args, **kwargs)

    _MARKED.append((run, fn, eager))
    return run  # type: ignore[return-value]


def _prepare() -> None:
    """Once a module compiles: Dynamo breaks the graph at every call of a marked
    function (``skip``: its frame is not compiled either), and the function itself runs
    with Dynamo off (``disable``), so nothing it calls is compiled or traced."""
    import torch._dynamo
    import torch._dynamo.decorators

    for run, fn, eager in _MARKED:
        if eager[0] is None:
            eager[0] = torch._dynamo.disable(fn, recursive=True)
            torch._dynamo.decorators.skip(run)


def _check_backend(backend: str, owner: str) -> None:
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise CompileError(
            f"{owner} was generated with ComputeConfig(compile=...), but torch.compile is not "
            f"supported on this platform (torch {torch.__version__}, see "
            f"torch._dynamo.is_dynamo_supported()). Generate without compile (the default) "
            f"or run on a platform torch.compile supports"
        )
    known = sorted(set(torch._dynamo.list_backends(exclude_tags=())))
    if backend not in known:
        raise CompileError(
            f"{owner}: ComputeConfig(compile={{'backend': {backend!r}}}) names a backend "
            f"torch.compile does not know; registered backends: {known}"
        )


def compile_forward(fn: Callable[..., Any], options: Mapping[str, Any], *,
                    owner: str) -> Callable[..., Any]:
    """``torch.compile(fn, **options)`` with the runtime's communication marked as graph
    breaks; ``options`` are ``torch.compile``'s keywords (``backend``, ``mode``,
    ``dynamic``, ``options``), as ``ComputeConfig.compiler.as_options()`` writes them."""
    opts = dict(options)
    _check_backend(str(opts.get("backend", "inductor")), owner)
    _prepare()
    return torch.compile(fn, **opts)
