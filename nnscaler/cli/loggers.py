"""Metric loggers for the Trainer, and the built-in plugin that registers them.

A logger receives the metrics of the training steps and of the validations on rank 0.
Loggers are plugins: a package registers its own through the
``nnscaler_register_loggers`` hook (see `nnscaler.hookspecs`), and
``LogConfig(type='name')`` picks one by name. This module registers ``tensorboard``,
which needs the optional extra ``pip install nnscaler[tensorboard]``.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from nnscaler.errors import LoggerError
from nnscaler.hookspecs import hookimpl

__all__ = ["LoggerBase", "LoggerError", "TensorBoardLogger"]


class LoggerBase:
    """The interface of a Trainer logger (all methods run on rank 0 only)."""

    def setup(self, config: dict[str, Any]) -> None:
        """Called once before training with the run's configuration (plain data)."""

    def log_metrics(self, metrics: dict[str, float], step: int, *, tag: str = "train") -> None:
        """Record ``metrics`` (name -> number) of global step ``step`` under ``tag``
        (``'train'`` or ``'val'``)."""
        raise NotImplementedError

    def finalize(self) -> None:
        """Called once when training ends (flush and close)."""


class TensorBoardLogger(LoggerBase):
    """Writes scalars to TensorBoard event files under ``root_dir/name``.

    Needs the ``tensorboard`` package: ``pip install nnscaler[tensorboard]``.
    """

    def __init__(self, root_dir: str = "./tensorboard", name: str | None = None) -> None:
        try:
            writer_mod = importlib.import_module("torch.utils.tensorboard")
        except ImportError as e:
            raise LoggerError(
                f"the 'tensorboard' logger needs the tensorboard package, which is not "
                f"installed ({e}). Fix: pip install 'nnscaler[tensorboard]', or remove the "
                f"tensorboard entry from TrainerArgs.log."
            ) from e
        self.log_dir = os.path.join(root_dir, name) if name else root_dir
        self._writer_cls = writer_mod.SummaryWriter
        self._writer: Any = None

    def setup(self, config: dict[str, Any]) -> None:
        self._writer = self._writer_cls(log_dir=self.log_dir)
        self._writer.add_text("config", f"```\n{config}\n```", 0)

    def log_metrics(self, metrics: dict[str, float], step: int, *, tag: str = "train") -> None:
        if self._writer is None:
            self.setup({})
        for name, value in metrics.items():
            self._writer.add_scalar(f"{tag}/{name}", value, step)

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


@hookimpl
def nnscaler_register_loggers(registry: Any) -> None:
    registry.register("tensorboard", TensorBoardLogger)
