"""Placing the sends and receives of a schedule around its forwards and backwards.

A schedule writer decides the order of forwards and backwards on each device;
`add_communication` adds the messages so that they cannot deadlock under the
communication model of `nnscaler.schedule.simulate` (a device waits in each group of
consecutive messages until the peers have posted the matching ones).

How: the forwards and backwards are first timed as if messages were free (each action
starts when its device is free and its inputs exist). Each message then gets an instant
``t`` of that timeline, between the end of the action that makes it and the start of the
action that uses it: the last one where neither device is in the middle of a compute
action, if there is one (then the message costs no waiting), else the end of the action
that makes it. The message goes into the group at the point each of the two devices has
reached at ``t``. Both devices thus issue their messages in the same order (by ``t``),
and a device that waits at instant ``t`` waits for a device that is stuck at an instant
before ``t``, so no cycle of waits can form. For 1F1B this gives Megatron's placement.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

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
)
from nnscaler.schedule.errors import ScheduleError


def recv_for(action: Action, nstages: int, nvirtual: int = 1) -> Comm | None:
    """The receive that a forward or backward needs before it runs, or None.

    None when there is no neighbour to receive from (the first stage's forward, the last
    stage's backward) or when it is on the same device (only with ``nstages == 1``:
    neighbouring stages are otherwise always on different devices).
    """
    s = action.stage
    if nstages == 1:
        return None
    if isinstance(action, Forward) and s > 0:
        return RecvAct(micro=action.micro, stage=s)
    if isinstance(action, Backward) and s < nstages * nvirtual - 1:
        return RecvGrad(micro=action.micro, stage=s)
    return None


def send_for(action: Action, nstages: int, nvirtual: int = 1) -> Comm | None:
    """The send of what a forward or backward makes for its neighbour stage, or None.

    None when there is no neighbour to send to (the last stage's forward, the first
    stage's backward) or when it is on the same device (only with ``nstages == 1``).
    """
    s = action.stage
    if nstages == 1:
        return None
    if isinstance(action, Forward) and s < nstages * nvirtual - 1:
        return SendAct(micro=action.micro, stage=s)
    if isinstance(action, Backward) and s > 0:
        return SendGrad(micro=action.micro, stage=s)
    return None


def _check_compute(compute: Sequence[Sequence[Action]], nstages: int, fwd_time: float,
                   bwd_time: float) -> None:
    """The arguments of `add_communication`: positive times, one list per device,
    each of forwards and backwards of the stages the device holds."""
    for name, value in (("fwd_time", fwd_time), ("bwd_time", bwd_time)):
        if not value > 0:
            raise ValueError(f"{name} must be a positive time, got {value!r}")
    if len(compute) != nstages:
        raise ScheduleError(
            f"add_communication takes one list of forwards and backwards per device: "
            f"expected {nstages} lists (nstages={nstages}), got {len(compute)}"
        )
    for device, actions in enumerate(compute):
        for action in actions:
            if not isinstance(action, (Forward, Backward)):
                raise ScheduleError(
                    f"add_communication takes forwards and backwards only and places the "
                    f"messages itself; device {device}'s list holds {action!s}. Remove it.",
                    device=device,
                    action=action if isinstance(action, Action) else None,
                )
            if device_of_stage(action.stage, nstages) != device:
                raise ScheduleError(
                    f"device {device}'s list holds {action}, but stage {action.stage} lives "
                    f"on device {device_of_stage(action.stage, nstages)} (device d holds "
                    f"stages d, d + {nstages}, ...). Move the action.",
                    device=device,
                    action=action,
                )


def add_communication(
    compute: Sequence[Sequence[Action]],
    nstages: int,
    nvirtual: int = 1,
    *,
    fwd_time: float = 1.0,
    bwd_time: float = 2.0,
) -> list[list[Action]]:
    """Add the sends and receives to per-device lists of forwards and backwards.

    ``fwd_time`` and ``bwd_time`` (positive) time the reference timeline that decides
    where each message goes; any values give a schedule without deadlock, the right
    ones give the least waiting. Raises `ScheduleError` when a list holds a
    message or an action of a stage the device does not hold, or when the order of the
    forwards and backwards cannot run (an action waits for one that no device runs, or
    the devices wait for each other in a cycle).
    """
    _check_compute(compute, nstages, fwd_time, bwd_time)
    starts, ends = _reference_times(compute, nstages, nvirtual, fwd_time, bwd_time)
    start_of = {
        a: t
        for actions, ts in zip(compute, starts, strict=True)
        for a, t in zip(actions, ts, strict=True)
    }
    instant: dict[Comm, float] = {}
    groups: list[dict[int, list[Comm]]] = [{} for _ in range(nstages)]  # device -> gap -> messages
    for device, actions in enumerate(compute):
        for index, action in enumerate(actions):
            send = send_for(action, nstages, nvirtual)
            if send is None:
                continue
            consumer = (Backward if send.is_grad else Forward)(micro=send.micro, stage=send.dst)
            peer = device_of_stage(send.dst, nstages)
            if consumer not in start_of:
                raise ScheduleError(
                    f"device {device}'s {action} makes the input of {consumer}, which no "
                    f"device runs. Add {consumer} to device {peer}'s list.",
                    device=device,
                    action=action,
                )
            at = _meeting_time(
                ends[device][index],
                start_of[consumer],
                (starts[device], ends[device]),
                (starts[peer], ends[peer]),
            )
            for d, message in ((device, send), (peer, send.matching())):
                instant[message] = at
                groups[d].setdefault(bisect.bisect_left(starts[d], at), []).append(message)

    def order(message: Comm) -> tuple[bool, float, int, int, int]:
        # sends, then receives; between two devices, the same order on both sides
        return (not message.is_send, instant[message], message.src, message.dst, message.micro)

    out: list[list[Action]] = []
    for device, actions in enumerate(compute):
        steps: list[Action] = []
        for gap in range(len(actions) + 1):
            steps += sorted(groups[device].get(gap, []), key=order)
            if gap < len(actions):
                steps.append(actions[gap])
        out.append(steps)
    return out


def _reference_times(
    compute: Sequence[Sequence[Action]],
    nstages: int,
    nvirtual: int,
    fwd_time: float,
    bwd_time: float,
) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end of every compute action when messages are free and immediate."""
    end: dict[Action, float] = {}
    starts: list[list[float]] = [[] for _ in compute]
    ends: list[list[float]] = [[] for _ in compute]
    progress = True
    while progress:
        progress = False
        for device, actions in enumerate(compute):
            while len(starts[device]) < len(actions):
                action = actions[len(starts[device])]
                needs = inputs_of(action, nstages, nvirtual)
                if any(n not in end for n in needs):
                    break
                t = max([ends[device][-1] if ends[device] else 0.0] + [end[n] for n in needs])
                took = fwd_time if isinstance(action, Forward) else bwd_time
                starts[device].append(t)
                ends[device].append(t + took)
                end[action] = t + took
                progress = True
    stuck = [d for d, actions in enumerate(compute) if len(starts[d]) < len(actions)]
    if stuck:
        where = {a: (d, i) for d, actions in enumerate(compute) for i, a in enumerate(actions)}
        parts = []
        for d in stuck:
            index = len(starts[d])
            action = compute[d][index]
            for need in inputs_of(action, nstages, nvirtual):
                if need in end:
                    continue
                if need not in where:
                    parts.append(
                        f"device {d} waits at {action} (action {index}) for {need}, which no device runs"
                    )
                else:
                    nd, ni = where[need]
                    parts.append(
                        f"device {d} waits at {action} (action {index}) for {need} (device {nd}, action {ni})"
                    )
                break
        raise ScheduleError(
            "the forwards and backwards cannot all run in this order: "
            + "; ".join(parts)
            + ". Every action needs its inputs (the forward of the previous stage; for a "
            "backward, its own forward and the backward of the next stage) from an action "
            "that runs before it. Add the missing actions or reorder the lists.",
            device=stuck[0],
            action=compute[stuck[0]][len(starts[stuck[0]])],
        )
    return starts, ends


def _at_gap(timeline: tuple[list[float], list[float]], t: float) -> bool:
    """Whether a device is between compute actions (or idle) at instant ``t``."""
    starts, ends = timeline
    running = bisect.bisect_left(starts, t)  # actions started before t
    return running == 0 or ends[running - 1] <= t


def _meeting_time(
    made: float,
    used: float,
    sender: tuple[list[float], list[float]],
    receiver: tuple[list[float], list[float]],
) -> float:
    """The last instant in ``[made, used]`` where both devices are between actions.

    The last one, so that the receiver holds the tensor for the shortest time. Without
    one, ``made``: the sender then waits for the receiver's current action.
    """
    candidates = {made, used}
    for _, ends in (sender, receiver):
        candidates.update(ends[bisect.bisect_left(ends, made) : bisect.bisect_right(ends, used)])
    for t in sorted(candidates, reverse=True):
        if _at_gap(sender, t) and _at_gap(receiver, t):
            return t
    return made
