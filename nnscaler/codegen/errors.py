"""The error code generation raises."""

from __future__ import annotations

from nnscaler.errors import NNScalerError


class CodegenError(NNScalerError, ValueError):
    """A planned graph that cannot be turned into per-rank programs; the message says
    which rule it breaks, what was seen, and how to fix the plan or the model."""
