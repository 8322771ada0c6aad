"""The error raised for a pipeline schedule that cannot run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nnscaler.errors import NNScalerError

if TYPE_CHECKING:
    from nnscaler.schedule.actions import Action


class ScheduleError(NNScalerError, ValueError):
    """A schedule (or a schedule's arguments) breaks a rule of the pipeline.

    ``device`` and ``action`` name where the problem was found, when it is one place.
    """

    def __init__(self, message: str, *, device: int | None = None, action: Action | None = None):
        super().__init__(message)
        self.device = device
        self.action = action
