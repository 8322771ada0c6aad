"""nnScaler's import path of the Trainer: ``from nnscaler.cli.trainer import Trainer``.
The Trainer lives in `nnscaler.trainer.trainer`, its parts beside it."""

from __future__ import annotations

from nnscaler.trainer.errors import TrainerError
from nnscaler.trainer.hooks import TrainHook
from nnscaler.trainer.trainer import Trainer

__all__ = ["TrainHook", "Trainer", "TrainerError"]
