"""The Trainer's errors: a configuration it cannot use, and a job it cannot go on with.

The classes live in `nnscaler.errors`, the one home of every error class; this module
keeps the import path ``nnscaler.trainer.errors`` that the room's modules and users take.
"""

from __future__ import annotations

from nnscaler.errors import ConfigError, TrainerError

__all__ = ["ConfigError", "TrainerError"]
