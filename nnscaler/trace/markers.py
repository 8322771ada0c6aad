"""Markers that nnScaler users put in ``forward``: ``nnscaler.anchor(name)`` and the
constant-folding controls ``with nnscaler.constant_folding():``,
``nnscaler.fold_constant(x)`` and ``nnscaler.no_constant_folding()``.

`anchor` names a point of the forward for nnScaler's policies to find; the policies
here address ops by their module path (``docs/policies.md``), so it records nothing and
returns None, as nnScaler's does when the model runs on one device.

This tracer always folds Python values (shapes, sizes, flags computed in ``forward``) into
the graph as constants, which is what ``constant_folding(True)`` asks for: that block and
`fold_constant` are honoured as they are (no effect). Turning folding *off*
(``constant_folding(False)`` / `no_constant_folding`) asks the tracer to keep such values
symbolic, which it cannot: inside a trace it raises `ConstantFoldingError`, naming
the fix. Outside a trace (the model run on one device) every form is a no-op, as in
nnScaler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

import torch

from nnscaler.errors import ConstantFoldingError
from nnscaler.trace.tracer import _Mode

__all__ = ["ConstantFoldingError", "anchor", "constant_folding", "fold_constant",
           "no_constant_folding"]

T = TypeVar("T")


def _tracing() -> bool:
    stack = torch.overrides._get_current_function_mode_stack()
    return any(isinstance(mode, _Mode) for mode in stack)


@contextlib.contextmanager
def constant_folding(constant_folding: bool = True) -> Iterator[None]:
    """nnScaler's block that turns constant folding on (True) or off (False) while tracing.

    On is what this tracer always does. Off cannot be honoured here: during a trace it
    raises `ConstantFoldingError`; outside one it does nothing.
    """
    if not constant_folding and _tracing():
        raise ConstantFoldingError(
            "constant_folding(False) / no_constant_folding(): nnScaler keeps the Python "
            "values computed inside such a block symbolic; this tracer always folds them into "
            "constants (the graph is traced once, on the dummy inputs). Fix: remove the "
            "block, and make a value that must change per batch a tensor (a tensor's values "
            "are never folded)"
        )
    yield


def no_constant_folding() -> contextlib.AbstractContextManager[None]:
    """``constant_folding(False)`` (see `constant_folding`)."""
    return constant_folding(False)


def fold_constant(a: T) -> T:
    """``a`` itself: values are always folded here, so there is nothing to unwrap."""
    return a


def anchor(name: str) -> None:
    """nnScaler's graph anchor: a named point in ``forward``; None, and nothing is traced
    (see the module doc)."""
    return None
