"""The Trainer's errors: a configuration it cannot use, and a job it cannot go on with."""

from __future__ import annotations

from nnscaler.errors import NNScalerError

__all__ = ["ConfigError", "TrainerError"]


class ConfigError(NNScalerError, ValueError):
    """A Trainer configuration that cannot be used; ``key`` is the dotted key at fault."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class TrainerError(NNScalerError, RuntimeError):
    """The Trainer cannot go on (a setting that does not fit the job, a failed save)."""
