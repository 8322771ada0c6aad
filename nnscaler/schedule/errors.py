"""The error raised for a pipeline schedule that cannot run.

The classes live in `nnscaler.errors`, the one home of every error class; this module
keeps the import path ``nnscaler.schedule.errors`` that the room's modules and users take.
"""

from __future__ import annotations

from nnscaler.errors import ScheduleError

__all__ = ["ScheduleError"]
