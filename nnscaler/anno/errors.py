"""Errors of the annotation module: a malformed or mismatched annotation, a broken promise."""

from __future__ import annotations

from nnscaler.errors import NNScalerError


class AnnotationError(NNScalerError, ValueError):
    """An annotation that is malformed, or that disagrees with the shapes of a call.

    ``str(err)`` is the reason, the annotation quoted on its own line and, when the
    offending token is known, a caret under it.
    """

    def __init__(self, reason: str, *, annotation: str = "", position: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.annotation = annotation
        self.position = position

    def __str__(self) -> str:
        lines = [self.reason]
        if self.annotation:
            lines.append(f"    '{self.annotation}'")
            if self.position is not None:
                # 4 spaces of indent and 1 quote character come before the annotation
                lines.append(" " * (5 + self.position) + "^")
        return "\n".join(lines)


class PromiseBrokenError(NNScalerError, AssertionError):
    """Running an op on the parts of a split and recombining did not give the whole result."""
