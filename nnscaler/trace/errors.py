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


class DataDependentError(TraceError):
    """The model reads Python values or sizes from tensor data (``x.item()``, ``if x.any():``,
    ``torch.nonzero(x)``): with the ``meta`` strategy, which has no data, while tracing; at
    ``parallelize``, because the traced graph would keep the values seen on the dummy
    inputs for every batch."""


class MetaDataDependentError(DataDependentError, MetaTraceError):
    """A value read from tensor data while tracing with the ``meta`` strategy."""


class OpaqueOpWarning(UserWarning):
    """A torch function with no dim annotation was recorded as an opaque op (replicated only)."""
