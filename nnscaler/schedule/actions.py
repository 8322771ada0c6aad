"""Pipeline actions: what one device does, one step at a time.

A schedule is one list of actions per device. There are two compute actions
(`Forward`, `Backward`) and four point-to-point messages between
neighbouring stages (`SendAct`, `RecvAct` in the forward direction, from
stage ``s`` to ``s + 1``; `SendGrad`, `RecvGrad` in the backward direction,
from ``s + 1`` to ``s``). Every action carries the micro-batch and the stage *on the
device that runs it*: a send names the sending stage, a receive the receiving stage.

Stage layout: with ``nstages`` devices and ``nvirtual`` stages per device there are
``nstages * nvirtual`` stages, numbered in model order; device ``d`` holds stages
``d, d + nstages, d + 2 * nstages, ...`` (Megatron's interleaved layout). With
``nvirtual = 1`` stage ``s`` is on device ``s``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from nnscaler.schedule.errors import ScheduleError


def _index(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ScheduleError(
            f"{type(instance).__name__}.{attribute.name} must be a non-negative int, got "
            f"{value!r}. Micro-batches and stages are numbered from 0."
        )


@attrs.frozen(kw_only=True)
class Action:
    """One step of a device: ``micro`` is the micro-batch, ``stage`` a stage of the device."""

    micro: int = attrs.field(validator=_index)
    stage: int = attrs.field(validator=_index)


@attrs.frozen(kw_only=True)
class Forward(Action):
    """Run the forward of ``stage`` on micro-batch ``micro``; keep its activations."""

    def __str__(self) -> str:
        return f"F{self.micro}@s{self.stage}"


@attrs.frozen(kw_only=True)
class Backward(Action):
    """Run the backward of ``stage`` on ``micro``; frees the activations of its forward."""

    def __str__(self) -> str:
        return f"B{self.micro}@s{self.stage}"


@attrs.frozen(kw_only=True)
class Comm(Action):
    """A point-to-point message between neighbouring stages ``src`` and ``dst``.

    Subclasses fix the direction: ``is_send`` (this device sends, ``stage == src``, or
    receives, ``stage == dst``) and ``is_grad`` (a gradient travelling from ``s + 1`` to
    ``s``, or an activation travelling from ``s`` to ``s + 1``).
    """

    is_send: ClassVar[bool]
    is_grad: ClassVar[bool]
    label: ClassVar[str]

    def __attrs_post_init__(self) -> None:
        if type(self) is Comm:
            raise TypeError(
                "Comm is the base of the messages; use SendAct, RecvAct, SendGrad or RecvGrad"
            )
        if min(self.src, self.dst) < 0:
            direction = "a gradient" if self.is_grad else "an activation"
            raise ScheduleError(
                f"{type(self).__name__}(micro={self.micro}, stage={self.stage}): stage 0 is "
                f"the first stage, so it cannot {'send' if self.is_send else 'receive'} "
                f"{direction} {'to' if self.is_send else 'from'} a previous stage. "
                f"Remove the action."
            )

    @property
    def src(self) -> int:
        """The stage that sends the message."""
        if self.is_send:
            return self.stage
        return self.stage + 1 if self.is_grad else self.stage - 1

    @property
    def dst(self) -> int:
        """The stage that receives the message."""
        if not self.is_send:
            return self.stage
        return self.stage - 1 if self.is_grad else self.stage + 1

    @property
    def peer_stage(self) -> int:
        """The stage at the other end of the message."""
        return self.dst if self.is_send else self.src

    def matching(self) -> Comm:
        """The action the peer device runs for the same message (a send's receive, ...)."""
        return _MATCH[type(self)](micro=self.micro, stage=self.peer_stage)

    def __str__(self) -> str:
        return f"{self.label} {self.micro} s{self.src}->s{self.dst}"


@attrs.frozen(kw_only=True)
class SendAct(Comm):
    """Send the output activation of ``stage`` for ``micro`` to stage ``stage + 1``."""

    is_send = True
    is_grad = False
    label = "SEND_ACT"


@attrs.frozen(kw_only=True)
class RecvAct(Comm):
    """Receive the input activation of ``stage`` for ``micro`` from stage ``stage - 1``."""

    is_send = False
    is_grad = False
    label = "RECV_ACT"


@attrs.frozen(kw_only=True)
class SendGrad(Comm):
    """Send the gradient of the input of ``stage`` for ``micro`` to stage ``stage - 1``."""

    is_send = True
    is_grad = True
    label = "SEND_GRAD"


@attrs.frozen(kw_only=True)
class RecvGrad(Comm):
    """Receive the gradient of the output of ``stage`` for ``micro`` from ``stage + 1``."""

    is_send = False
    is_grad = True
    label = "RECV_GRAD"


_MATCH: dict[type[Comm], type[Comm]] = {
    SendAct: RecvAct,
    RecvAct: SendAct,
    SendGrad: RecvGrad,
    RecvGrad: SendGrad,
}


def device_of_stage(stage: int, nstages: int) -> int:
    """The device that holds ``stage`` when there are ``nstages`` devices."""
    return stage % nstages


def stages_of_device(device: int, nstages: int, nvirtual: int = 1) -> tuple[int, ...]:
    """The stages device ``device`` holds, in model order: ``device + k * nstages``."""
    return tuple(device + k * nstages for k in range(nvirtual))


def inputs_of(action: Action, nstages: int, nvirtual: int = 1) -> list[Action]:
    """The forwards and backwards whose outputs a forward or backward needs.

    A forward of stage ``s > 0`` needs the forward of ``s - 1``; a backward needs its own
    forward, and (except on the last stage) the backward of ``s + 1``. A message needs
    nothing here (a send carries the output of the action that makes it).
    """
    m, s = action.micro, action.stage
    if isinstance(action, Forward):
        return [Forward(micro=m, stage=s - 1)] if s > 0 else []
    if not isinstance(action, Backward):
        return []
    needs: list[Action] = [Forward(micro=m, stage=s)]
    if s < nstages * nvirtual - 1:
        needs.append(Backward(micro=m, stage=s + 1))
    return needs
