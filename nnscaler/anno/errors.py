"""Errors of the annotation module: a malformed or mismatched annotation, a broken promise.

The classes live in `nnscaler.errors`, the one home of every error class; this module
keeps the import path ``nnscaler.anno.errors`` that the room's modules and users take.
"""

from __future__ import annotations

from nnscaler.errors import AnnotationError, PromiseBrokenError

__all__ = ["AnnotationError", "PromiseBrokenError"]
