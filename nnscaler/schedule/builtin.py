"""The built-in pipeline schedules, registered like any third-party schedule plugin.

Each schedule decides the order of forwards and backwards on every device. ``gpipe`` and
``1f1b`` let `add_communication` place the sends and receives (which gives
Megatron's placement for 1F1B); ``1f1b_interleaved`` places them in Megatron's rounds.
"""

from __future__ import annotations

from nnscaler.hookspecs import hookimpl
from nnscaler.registry import Registry
from nnscaler.schedule.actions import Action, Backward, Forward, stages_of_device
from nnscaler.schedule.errors import ScheduleError
from nnscaler.schedule.placement import add_communication, recv_for, send_for
from nnscaler.schedule.simulate import check_sizes


def gpipe(nstages: int, nmicros: int, nvirtual: int = 1) -> list[list[Action]]:
    """GPipe: every forward, then every backward.

    A device runs its stages in model order, each over all micro-batches, then the
    backwards in reverse stage order. Every micro-batch stays alive until the backwards.
    """
    check_sizes(nstages, nmicros, nvirtual)
    compute: list[list[Action]] = []
    for device in range(nstages):
        stages = stages_of_device(device, nstages, nvirtual)
        order: list[Action] = [Forward(micro=m, stage=s) for s in stages for m in range(nmicros)]
        order += [Backward(micro=m, stage=s) for s in reversed(stages) for m in range(nmicros)]
        compute.append(order)
    return add_communication(compute, nstages, nvirtual)


def one_f_one_b(nstages: int, nmicros: int, nvirtual: int = 1) -> list[list[Action]]:
    """1F1B: ``nstages - rank - 1`` warm-up forwards, then one forward, one backward.

    Device ``rank`` holds at most ``nstages - rank`` micro-batches (fewer when there are
    fewer micro-batches), instead of all of them as in GPipe, for the same bubble.
    """
    check_sizes(nstages, nmicros, nvirtual)
    if nvirtual != 1:
        raise ScheduleError(
            f"1f1b runs one stage per device (nvirtual=1), got nvirtual={nvirtual}. Use "
            f"'1f1b_interleaved' for virtual stages."
        )
    compute: list[list[Action]] = []
    for rank in range(nstages):
        warmup = min(nstages - rank - 1, nmicros)
        order: list[Action] = [Forward(micro=m, stage=rank) for m in range(warmup)]
        for m in range(nmicros - warmup):
            order += [Forward(micro=warmup + m, stage=rank), Backward(micro=m, stage=rank)]
        order += [Backward(micro=m, stage=rank) for m in range(nmicros - warmup, nmicros)]
        compute.append(order)
    return add_communication(compute, nstages, nvirtual)


def one_f_one_b_interleaved(nstages: int, nmicros: int, nvirtual: int = 1) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: ``nvirtual`` stages per device.

    Rule: with ``nvirtual > 1``, ``nmicros`` must be a multiple of ``nstages``. With
    ``nvirtual == 1`` this is `one_f_one_b`.

    Micro-batches go through a device in groups of ``nstages``: the group's forwards on
    the device's first stage, then on its second stage, and so on; backwards mirror this
    from the last stage. Device ``rank`` warms up with
    ``2 * (nstages - rank - 1) + (nvirtual - 1) * nstages`` forwards (at most all of
    them), then alternates one forward and one backward.

    Messages go in *rounds*, as in Megatron: after each warm-up forward, after each
    forward-backward pair and after each cool-down backward, one group sends what the
    round made and receives the inputs of the next forward and the next backward
    (tensors may arrive a round before they are used). Adjacent devices thus exchange
    their messages in matching groups and stay in step. `add_communication` would
    also give a schedule without deadlock, but with more waiting; the rounds reach a
    bubble of ``(p - 1) / (nvirtual * m + p - 1)`` when a backward takes twice as long
    as a forward and messages are free (``p = nstages``, ``m = nmicros``).
    """
    check_sizes(nstages, nmicros, nvirtual)
    if nvirtual == 1:
        return one_f_one_b(nstages, nmicros)
    if nmicros % nstages:
        lower = nmicros - nmicros % nstages
        raise ScheduleError(
            f"1f1b_interleaved sends micro-batches through the pipeline in groups of "
            f"nstages, so with nvirtual > 1 nmicros must be a multiple of nstages; got "
            f"nmicros={nmicros}, nstages={nstages}. Use nmicros="
            f"{' or '.join(str(n) for n in (lower, lower + nstages) if n > 0)}, or the "
            f"'1f1b' schedule."
        )
    total = nmicros * nvirtual
    group = nstages * nvirtual

    def micro(k: int) -> int:
        return (k // group) * nstages + k % nstages

    def sends(*made: Action) -> list[Action]:
        out = [send_for(a, nstages, nvirtual) for a in made]
        return [m for m in out if m is not None]

    def recv(actions: list[Action], k: int) -> list[Action]:
        message = recv_for(actions[k], nstages, nvirtual) if k < total else None
        return [] if message is None else [message]

    lists: list[list[Action]] = []
    for rank in range(nstages):
        stages = stages_of_device(rank, nstages, nvirtual)
        fwd = [Forward(micro=micro(k), stage=stages[k % group // nstages]) for k in range(total)]
        bwd = [
            Backward(micro=micro(k), stage=stages[nvirtual - 1 - k % group // nstages])
            for k in range(total)
        ]
        warmup = min(2 * (nstages - rank - 1) + (nvirtual - 1) * nstages, total)

        order: list[Action] = recv(fwd, 0)
        for k in range(warmup):  # warm-up rounds: one forward
            order += [fwd[k], *sends(fwd[k]), *recv(fwd, k + 1)]
            if k == warmup - 1:
                order += recv(bwd, 0)
        for k in range(warmup, total):  # steady rounds: one forward, one backward
            b = k - warmup
            order += [fwd[k], bwd[b], *sends(fwd[k], bwd[b]), *recv(fwd, k + 1), *recv(bwd, b + 1)]
        for b in range(total - warmup, total):  # cool-down rounds: one backward
            order += [bwd[b], *sends(bwd[b]), *recv(bwd, b + 1)]
        lists.append(order)
    return lists


@hookimpl
def nnscaler_register_schedules(registry: Registry) -> None:
    registry.register("gpipe", gpipe)
    registry.register("1f1b", one_f_one_b)
    registry.register("1f1b_interleaved", one_f_one_b_interleaved)
