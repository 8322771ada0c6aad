"""Pipeline schedules: per-device action lists, and a simulator that checks any of them.

A schedule is a callable ``(nstages, nmicros, nvirtual=1) -> list[list[Action]]``: one
list of actions per device, ``nstages`` devices, ``nvirtual`` stages per device. The
built-ins (``gpipe``, ``1f1b``, ``1f1b_interleaved``) and third-party schedules are
registered through the ``nnscaler_register_schedules`` hook and found with
`get_schedule`. `simulate` runs any schedule and raises
`ScheduleError` when it is invalid. See ``docs/schedules.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from nnscaler.registry import active_registry
from nnscaler.schedule.actions import (
    Action,
    Backward,
    Comm,
    Forward,
    RecvAct,
    RecvGrad,
    SendAct,
    SendGrad,
    device_of_stage,
    inputs_of,
    stages_of_device,
)
from nnscaler.schedule.errors import ScheduleError
from nnscaler.schedule.placement import add_communication, recv_for, send_for
from nnscaler.schedule.simulate import SimResult, TimedAction, check_sizes, simulate

if TYPE_CHECKING:
    from nnscaler.plugins import NNScalerPluginManager

#: The type of a schedule: ``(nstages, nmicros, nvirtual) -> one action list per device``.
Schedule = Callable[..., list[list[Action]]]


def get_schedule(name: str, *, plugin_manager: NNScalerPluginManager | None = None) -> Schedule:
    """The schedule registered as ``name`` (by default in the process-wide plugin manager).

    Raises [`nnscaler.UnknownNameError`][nnscaler.errors.UnknownNameError] listing the registered
    schedules.
    """
    if plugin_manager is None:
        return active_registry("schedules").get(name)
    return plugin_manager.schedules.get(name)


__all__ = [
    "Action",
    "Backward",
    "Comm",
    "Forward",
    "RecvAct",
    "RecvGrad",
    "Schedule",
    "ScheduleError",
    "SendAct",
    "SendGrad",
    "SimResult",
    "TimedAction",
    "add_communication",
    "check_sizes",
    "device_of_stage",
    "get_schedule",
    "inputs_of",
    "recv_for",
    "send_for",
    "simulate",
    "stages_of_device",
]
