"""The tracer: an ``nn.Module`` and dummy forward arguments in, a `Graph`
out. See ``docs/tracing.md``."""

from nnscaler.trace.errors import (
    DataDependentError,
    ForwardSignatureError,
    MetaTraceError,
    OpaqueOpWarning,
    TraceError,
)
from nnscaler.trace.forward_args import check_forward_args
from nnscaler.trace.tracer import STRATEGIES, trace

__all__ = [
    "STRATEGIES",
    "DataDependentError",
    "ForwardSignatureError",
    "MetaTraceError",
    "OpaqueOpWarning",
    "TraceError",
    "check_forward_args",
    "trace",
]
