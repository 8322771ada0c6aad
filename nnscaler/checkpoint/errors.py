"""Exceptions of :mod:`nnscaler.checkpoint`."""

from __future__ import annotations

from nnscaler.errors import NNScalerError

__all__ = ["CheckpointError", "OptimizerStateError", "StateDictMismatchError"]


class CheckpointError(NNScalerError, ValueError):
    """A checkpoint that cannot be saved, merged or loaded as asked."""


class StateDictMismatchError(CheckpointError):
    """A state dict that belongs to another model, plan or rank (the message names the
    first mismatching key and both shapes)."""


class OptimizerStateError(CheckpointError):
    """Optimizer state that cannot be merged or split (e.g. state that is not elementwise,
    as LBFGS or Adafactor keep)."""
