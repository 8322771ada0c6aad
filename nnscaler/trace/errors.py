"""Errors and warnings of the tracer."""

from __future__ import annotations

from nnscaler.errors import NNScalerError


class TraceError(NNScalerError, RuntimeError):
    """The model could not be traced; the message names the op and the model's line."""


class ForwardSignatureError(TraceError, TypeError):
    """``dummy_forward_args`` do not fit ``forward``'s signature, or the signature has a form
    that cannot be called by name (positional-only arguments, ``*args``)."""


class MetaTraceError(TraceError):
    """A call failed on the ``meta`` device, where no values are computed."""


class DataDependentError(MetaTraceError):
    """The model read a Python value from tensor data (``x.item()``, ``if x.any():``) while
    tracing with the ``meta`` strategy, which has no data."""


class OpaqueOpWarning(UserWarning):
    """A torch function with no dim annotation was recorded as an opaque op (replicated only)."""
