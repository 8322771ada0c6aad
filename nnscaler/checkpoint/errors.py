"""Exceptions of `nnscaler.checkpoint`.

They are defined in [`nnscaler.errors`][nnscaler.errors] (the runtime's state-dict checks raise them
too, and the runtime sits below the checkpoint package) and re-exported here.
"""

from __future__ import annotations

from nnscaler.errors import CheckpointError, OptimizerStateError, StateDictMismatchError

__all__ = ["CheckpointError", "OptimizerStateError", "StateDictMismatchError"]
