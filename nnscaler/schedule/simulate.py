"""Execute the action lists of any schedule on simulated devices, and check them.

The checks, in order (the first broken rule raises `ScheduleError`):

1. one action list per device; every action names a micro-batch and a stage in range,
   and a stage that the device holds; messages only between stages on different devices;
2. every (stage, micro-batch) has exactly one forward and one backward;
3. every message is sent once and received once;
4. on each device, every action comes after what it needs: a forward of stage ``s > 0``
   after the activation of ``s - 1`` (received, or computed on the same device), a
   backward after its forward and after the gradient of ``s + 1`` (the last stage's
   backward needs only its forward), a send after the action that makes its tensor;
5. between two devices, messages are received in the order they are sent;
6. the devices run to the end under the communication model below: no deadlock.

Communication model (what a runtime with ``torch.distributed.batch_isend_irecv`` on NCCL
or gloo does): a maximal run of consecutive messages in a device's list is one *group*.
The device posts all of it at once and waits until every message in it has completed
before its next forward or backward. A message completes when both ends have posted it
(a send is never buffered: it waits for its receive), ``comm_time`` after the later of
the two posts. Messages between a pair of devices are matched in the order each side
issues them (NCCL ignores tags), which is why rule 5 exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from nnscaler.schedule.actions import (
    Action,
    Backward,
    Comm,
    Forward,
    device_of_stage,
    inputs_of,
)
from nnscaler.schedule.errors import ScheduleError
from nnscaler.schedule.placement import recv_for


@attrs.frozen(kw_only=True)
class TimedAction:
    """An action as the simulator ran it. A message spans its group: post to completion."""

    device: int
    index: int  # position in the device's action list
    action: Action
    start: float
    end: float


@attrs.frozen(kw_only=True)
class SimResult:
    """What a simulated run of a schedule took.

    ``busy[d]`` is the compute time of device ``d`` (forwards and backwards; time spent
    in messages counts as idle). ``bubble_fraction`` is the idle share of all device
    time: ``(p * makespan - sum(busy)) / (p * makespan)`` for ``p`` devices.
    ``peak_alive[d]`` is the largest number of (stage, micro-batch) activation sets held
    on device ``d`` at once, each alive from the start of its forward until its backward
    ends; with one stage per device that is a number of micro-batches.
    """

    busy: tuple[float, ...]
    makespan: float
    bubble_fraction: float
    peak_alive: tuple[int, ...]
    timeline: tuple[tuple[TimedAction, ...], ...]

    @property
    def idle(self) -> tuple[float, ...]:
        """Per device, the time within the makespan that is not compute."""
        return tuple(self.makespan - b for b in self.busy)


def simulate(
    actions_per_device: Sequence[Sequence[Action]],
    nstages: int,
    nmicros: int,
    nvirtual: int = 1,
    *,
    fwd_time: float = 1.0,
    bwd_time: float = 2.0,
    comm_time: float = 0.0,
) -> SimResult:
    """Check a schedule and run it on ``nstages`` simulated devices.

    ``fwd_time`` and ``bwd_time`` are the times of one stage's forward and backward on
    one micro-batch; ``comm_time`` that of one message. Raises `ScheduleError`
    naming the device, the action and the broken rule.
    """
    check_sizes(nstages, nmicros, nvirtual)
    for name, value in (("fwd_time", fwd_time), ("bwd_time", bwd_time), ("comm_time", comm_time)):
        if not value >= 0:
            raise ValueError(f"{name} must be a non-negative number of time units, got {value!r}")
    lists = _check_actions(actions_per_device, nstages, nmicros, nvirtual)
    _check_complete(lists, nstages, nmicros, nvirtual)
    _check_order(lists, nstages, nvirtual)
    _check_pairing(lists, nstages)
    return _run(lists, nstages, fwd_time=fwd_time, bwd_time=bwd_time, comm_time=comm_time)


def check_sizes(nstages: int, nmicros: int, nvirtual: int) -> None:
    """Raise `ScheduleError` unless the three sizes are positive ints."""
    for name, value in (("nstages", nstages), ("nmicros", nmicros), ("nvirtual", nvirtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive int, got {value!r}")


def _where(device: int, index: int, action: object) -> str:
    return f"device {device}, action {index} ({action})"


# -- static checks ------------------------------------------------------------------------


def _check_actions(
    actions_per_device: Sequence[Sequence[Action]], nstages: int, nmicros: int, nvirtual: int
) -> list[list[Action]]:
    if isinstance(actions_per_device, (str, bytes)) or not isinstance(actions_per_device, Sequence):
        raise ScheduleError(
            f"a schedule returns one list of actions per device, got "
            f"{type(actions_per_device).__name__}"
        )
    if len(actions_per_device) != nstages:
        raise ScheduleError(
            f"a schedule returns one list of actions per device: expected {nstages} lists "
            f"(nstages={nstages}), got {len(actions_per_device)}"
        )
    last = nstages * nvirtual - 1
    lists = []
    for device, actions in enumerate(actions_per_device):
        if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence):
            raise ScheduleError(
                f"device {device}: a schedule returns one list of actions per device, got "
                f"{type(actions).__name__}",
                device=device,
            )
        actions = list(actions)
        for index, action in enumerate(actions):
            where = _where(device, index, action)
            if not isinstance(action, (Forward, Backward, Comm)):
                raise ScheduleError(
                    f"{where}: expected a Forward, Backward, SendAct, RecvAct, SendGrad or "
                    f"RecvGrad, got {type(action).__name__}",
                    device=device,
                )
            if action.micro >= nmicros:
                raise ScheduleError(
                    f"{where}: micro-batch {action.micro} is out of range; nmicros={nmicros} "
                    f"numbers them 0..{nmicros - 1}",
                    device=device,
                    action=action,
                )
            if action.stage > last:
                raise ScheduleError(
                    f"{where}: stage {action.stage} is out of range; nstages={nstages} and "
                    f"nvirtual={nvirtual} number the stages 0..{last}",
                    device=device,
                    action=action,
                )
            owner = device_of_stage(action.stage, nstages)
            if owner != device:
                raise ScheduleError(
                    f"{where}: stage {action.stage} lives on device {owner}, not device "
                    f"{device} (device d holds stages d, d + {nstages}, ...). Move the "
                    f"action to device {owner}'s list.",
                    device=device,
                    action=action,
                )
            if isinstance(action, Comm):
                peer = action.peer_stage
                if peer > last:
                    raise ScheduleError(
                        f"{where}: stage {action.stage} is the last stage, there is no stage "
                        f"{peer} to exchange with. Remove the action.",
                        device=device,
                        action=action,
                    )
                if device_of_stage(peer, nstages) == device:
                    raise ScheduleError(
                        f"{where}: stages {action.src} and {action.dst} both live on device "
                        f"{device}, so the tensor stays on the device and needs no message. "
                        f"Remove the action.",
                        device=device,
                        action=action,
                    )
        lists.append(actions)
    return lists


def _check_complete(lists: list[list[Action]], nstages: int, nmicros: int, nvirtual: int) -> None:
    """Exactly one forward and one backward per (stage, micro); each message once each way."""
    seen: dict[Action, tuple[int, int]] = {}
    for device, actions in enumerate(lists):
        for index, action in enumerate(actions):
            if action in seen:
                first = seen[action][1]
                what = (
                    "each (stage, micro-batch) has exactly one forward and one backward"
                    if not isinstance(action, Comm)
                    else "each message is sent once and received once"
                )
                raise ScheduleError(
                    f"device {device} runs {action} twice (actions {first} and {index}): "
                    f"{what}. Remove one.",
                    device=device,
                    action=action,
                )
            seen[action] = (device, index)
    for stage in range(nstages * nvirtual):
        device = device_of_stage(stage, nstages)
        for micro in range(nmicros):
            for kind in (Forward, Backward):
                action = kind(micro=micro, stage=stage)
                if action not in seen:
                    name = "forward" if kind is Forward else "backward"
                    raise ScheduleError(
                        f"{action} is missing: device {device} must run the {name} of "
                        f"stage {stage} once for each micro-batch 0..{nmicros - 1}, and has "
                        f"no {name} of micro-batch {micro}. Add {action} to device "
                        f"{device}'s list.",
                        device=device,
                        action=action,
                    )
    for action, (device, index) in seen.items():
        if isinstance(action, Comm) and action.matching() not in seen:
            peer = device_of_stage(action.peer_stage, nstages)
            other = action.matching()
            role = "send" if action.is_send else "receive"
            raise ScheduleError(
                f"{_where(device, index, action)} has no matching {other} on device {peer}: "
                f"every message needs one send and one receive, and this {role} would wait "
                f"forever. Add {other} to device {peer}'s list, or remove {action}.",
                device=device,
                action=action,
            )


def _needs(action: Action, nstages: int, nvirtual: int) -> list[tuple[Action, str]]:
    """What ``action`` needs done earlier on its own device, each with the reason."""
    if isinstance(action, Comm):
        if not action.is_send:
            return []
        maker = (Backward if action.is_grad else Forward)(micro=action.micro, stage=action.stage)
        return [(maker, f"the message carries the output of {maker}")]
    needs: list[tuple[Action, str]] = []
    for need in inputs_of(action, nstages, nvirtual):
        if need.stage == action.stage:
            needs.append((need, "a backward needs the activations of its own forward"))
            continue
        what = "activation" if isinstance(action, Forward) else "gradient"
        why = (
            f"the {'forward' if isinstance(action, Forward) else 'backward'} of stage "
            f"{action.stage} needs the {what} of micro-batch {action.micro} from stage "
            f"{need.stage}"
        )
        if device_of_stage(need.stage, nstages) != device_of_stage(action.stage, nstages):
            received = recv_for(action, nstages, nvirtual)
            if received is not None:
                need = received
        needs.append((need, why))
    return needs


def _check_order(lists: list[list[Action]], nstages: int, nvirtual: int) -> None:
    for device, actions in enumerate(lists):
        position = {action: index for index, action in enumerate(actions)}
        for index, action in enumerate(actions):
            for need, why in _needs(action, nstages, nvirtual):
                at = position[need]  # present: _check_complete ran first
                if at > index:
                    raise ScheduleError(
                        f"{_where(device, index, action)}: {why}, but {need} comes later, "
                        f"at action {at}. Move {need} before {action}.",
                        device=device,
                        action=action,
                    )


def _check_pairing(lists: list[list[Action]], nstages: int) -> None:
    """The k-th message from device a to device b is the k-th that b receives from a."""
    sent: dict[tuple[int, int], list[tuple[int, Comm]]] = {}
    received: dict[tuple[int, int], list[tuple[int, Comm]]] = {}
    for device, actions in enumerate(lists):
        for index, action in enumerate(actions):
            if isinstance(action, Comm):
                peer = device_of_stage(action.peer_stage, nstages)
                if action.is_send:
                    sent.setdefault((device, peer), []).append((index, action))
                else:
                    received.setdefault((peer, device), []).append((index, action))
    for (src, dst), sends in sent.items():
        recvs = received[(src, dst)]  # same count: each send has its receive
        for k, ((i, send), (j, recv)) in enumerate(zip(sends, recvs, strict=True)):
            if send.matching() != recv:
                raise ScheduleError(
                    f"messages from device {src} to device {dst} are received out of order: "
                    f"the send number {k} of device {src} is {send} (action {i}), but the "
                    f"receive number {k} of device {dst} is {recv} (action {j}). Point-to-"
                    f"point messages between two devices are matched in the order each "
                    f"side issues them (NCCL ignores tags); issue them in the same order on "
                    f"both devices.",
                    device=dst,
                    action=recv,
                )


# -- the timed run ------------------------------------------------------------------------


def _steps(actions: list[Action]) -> list[list[tuple[int, Action]]]:
    """Split a device's list into steps: one compute action, or a group of messages."""
    steps: list[list[tuple[int, Action]]] = []
    for index, action in enumerate(actions):
        if isinstance(action, Comm) and steps and isinstance(steps[-1][-1][1], Comm):
            steps[-1].append((index, action))
        else:
            steps.append([(index, action)])
    return steps


def _run(
    lists: list[list[Action]],
    nstages: int,
    *,
    fwd_time: float,
    bwd_time: float,
    comm_time: float,
) -> SimResult:
    steps = [_steps(actions) for actions in lists]
    pos = [0] * nstages
    clock = [0.0] * nstages
    busy = [0.0] * nstages
    posted: dict[Action, float] = {}
    timeline: list[list[TimedAction]] = [[] for _ in range(nstages)]
    progress = True
    while progress:
        progress = False
        for d in range(nstages):
            while pos[d] < len(steps[d]):
                step = steps[d][pos[d]]
                index, action = step[0]
                if not isinstance(action, Comm):
                    took = fwd_time if isinstance(action, Forward) else bwd_time
                    timeline[d].append(
                        TimedAction(
                            device=d,
                            index=index,
                            action=action,
                            start=clock[d],
                            end=clock[d] + took,
                        )
                    )
                    clock[d] += took
                    busy[d] += took
                else:
                    for _, message in step:
                        if message not in posted:
                            posted[message] = clock[d]
                            progress = True
                    if any(message.matching() not in posted for _, message in step):
                        break
                    end = max(
                        [clock[d]]
                        + [
                            max(posted[message], posted[message.matching()]) + comm_time
                            for _, message in step
                        ]
                    )
                    timeline[d].extend(
                        TimedAction(device=d, index=i, action=message, start=clock[d], end=end)
                        for i, message in step
                    )
                    clock[d] = end
                pos[d] += 1
                progress = True
    if any(pos[d] < len(steps[d]) for d in range(nstages)):
        _raise_deadlock(steps, pos, posted, nstages)
    makespan = max(clock)
    total = nstages * makespan
    return SimResult(
        busy=tuple(busy),
        makespan=makespan,
        bubble_fraction=(total - sum(busy)) / total if total > 0 else 0.0,
        peak_alive=tuple(_peak_alive(actions) for actions in lists),
        timeline=tuple(tuple(t) for t in timeline),
    )


def _peak_alive(actions: list[Action]) -> int:
    alive = peak = 0
    for action in actions:
        if isinstance(action, Forward):
            alive += 1
            peak = max(peak, alive)
        elif isinstance(action, Backward):
            alive -= 1
    return peak


def _raise_deadlock(
    steps: list[list[list[tuple[int, Action]]]],
    pos: list[int],
    posted: dict[Action, float],
    nstages: int,
) -> None:
    """Every stuck device waits in a group for a peer that is stuck too: report a cycle."""
    waits: dict[int, tuple[int, Comm, int]] = {}  # device -> (index, message, peer)
    for d in range(nstages):
        if pos[d] < len(steps[d]):
            for index, message in steps[d][pos[d]]:
                if isinstance(message, Comm) and message.matching() not in posted:
                    waits[d] = (index, message, device_of_stage(message.peer_stage, nstages))
                    break
    chain: list[int] = []
    d = min(waits)
    while d not in chain:
        chain.append(d)
        d = waits[d][2]
    cycle = chain[chain.index(d) :]
    parts = []
    for d in cycle:
        index, message, peer = waits[d]
        parts.append(
            f"device {d} blocks at {message} (action {index}) until device {peer} posts "
            f"{message.matching()}"
        )
    first = cycle[0]
    raise ScheduleError(
        "deadlock: "
        + "; ".join(parts)
        + ", so none of them can go on. A device waits in each group of consecutive "
        "sends and receives until the peers have posted the matching ones (sends are not "
        "buffered). Move the messages so that the two sides of each message sit in groups "
        "that both devices reach (for example, receive in the group in which the peer "
        "sends), or let add_communication() place them.",
        device=first,
        action=waits[first][1],
    )
