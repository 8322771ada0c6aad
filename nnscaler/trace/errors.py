"""Errors and warnings of the tracer.

The classes live in `nnscaler.errors`, the one home of every error class; this module
keeps the import path ``nnscaler.trace.errors`` that the room's modules and users take.
"""

from __future__ import annotations

from nnscaler.errors import (
    DataDependentError,
    ForwardSignatureError,
    MetaDataDependentError,
    MetaTraceError,
    OpaqueOpWarning,
    TraceError,
)

__all__ = ["DataDependentError", "ForwardSignatureError", "MetaDataDependentError", "MetaTraceError", "OpaqueOpWarning", "TraceError"]
