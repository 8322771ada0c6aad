"""The simulator: timings, and the message of every rule a broken schedule can break."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from schedule_strategies import interleaved_sizes

from nnscaler.schedule import (
    Backward,
    Forward,
    RecvAct,
    RecvGrad,
    ScheduleError,
    SendAct,
    SendGrad,
    builtin,
    recv_for,
    send_for,
    simulate,
)

F, B = Forward, Backward


def two_stage(m: int = 1) -> list[list]:
    """1F1B on 2 devices: the schedule the broken ones below start from."""
    return builtin.one_f_one_b(2, m)


def test_two_stage_schedule_is_what_the_tests_expect():
    assert [[str(a) for a in actions] for actions in two_stage()] == [
        ["F0@s0", "SEND_ACT 0 s0->s1", "RECV_GRAD 0 s1->s0", "B0@s0"],
        ["RECV_ACT 0 s0->s1", "F0@s1", "B0@s1", "SEND_GRAD 0 s1->s0"],
    ]


def test_timeline_and_comm_time():
    result = simulate(two_stage(), 2, 1, fwd_time=1.0, bwd_time=2.0, comm_time=0.5)
    # F0@s0 [0, 1], message [1, 1.5], F0@s1 [1.5, 2.5], B0@s1 [2.5, 4.5], message,
    # B0@s0 [5, 7]
    assert result.makespan == 7.0
    assert result.busy == (3.0, 3.0)
    assert result.idle == (4.0, 4.0)
    assert result.bubble_fraction == 8.0 / 14.0
    starts = {str(t.action): (t.device, t.start, t.end) for ts in result.timeline for t in ts}
    assert starts["F0@s1"] == (1, 1.5, 2.5)
    assert starts["RECV_GRAD 0 s1->s0"] == (0, 1.0, 5.0)  # posted at 1, completes at 5
    assert starts["B0@s0"] == (0, 5.0, 7.0)


@settings(max_examples=30, deadline=None)
@given(interleaved_sizes())
def test_timeline_respects_dependencies(sizes):
    p, m, v = sizes
    result = simulate(builtin.one_f_one_b_interleaved(p, m, v), p, m, v, comm_time=0.25)
    end = {t.action: t.end for ts in result.timeline for t in ts}
    start = {t.action: t.start for ts in result.timeline for t in ts}
    for s in range(p * v):
        for micro in range(m):
            if s > 0:
                assert start[F(micro=micro, stage=s)] >= end[F(micro=micro, stage=s - 1)] + (
                    0.25 if p > 1 else 0.0
                )
            assert start[B(micro=micro, stage=s)] >= end[F(micro=micro, stage=s)]
            if s < p * v - 1:
                assert start[B(micro=micro, stage=s)] >= end[B(micro=micro, stage=s + 1)]
    for ts in result.timeline:  # a device runs one thing at a time (a group is one thing)
        steps = sorted({(t.start, t.end) for t in ts})
        assert all(a[1] <= b[0] for a, b in zip(steps, steps[1:], strict=False))


def test_one_device_with_virtual_stages_needs_no_messages():
    lists = builtin.gpipe(1, 2, 3)
    assert [str(a) for a in lists[0]][:3] == ["F0@s0", "F1@s0", "F0@s1"]
    result = simulate(lists, 1, 2, 3)
    assert result.bubble_fraction == 0.0 and result.peak_alive == (6,)


# -- broken schedules ------------------------------------------------------------------


def test_missing_backward():
    lists = builtin.one_f_one_b(2, 4)
    lists[1].remove(B(micro=2, stage=1))
    with pytest.raises(ScheduleError) as e:
        simulate(lists, 2, 4)
    assert str(e.value) == (
        "B2@s1 is missing: device 1 must run the backward of stage 1 once for each "
        "micro-batch 0..3, and has no backward of micro-batch 2. Add B2@s1 to device 1's list."
    )
    assert (e.value.device, e.value.action) == (1, B(micro=2, stage=1))


def test_forward_before_its_receive():
    lists = two_stage()
    lists[1][0], lists[1][1] = lists[1][1], lists[1][0]
    with pytest.raises(ScheduleError) as e:
        simulate(lists, 2, 1)
    assert str(e.value) == (
        "device 1, action 0 (F0@s1): the forward of stage 1 needs the activation of "
        "micro-batch 0 from stage 0, but RECV_ACT 0 s0->s1 comes later, at action 1. "
        "Move RECV_ACT 0 s0->s1 before F0@s1."
    )


def test_backward_before_its_gradient():
    lists = two_stage()
    lists[0] = [
        F(micro=0, stage=0),
        SendAct(micro=0, stage=0),
        B(micro=0, stage=0),
        RecvGrad(micro=0, stage=0),
    ]
    with pytest.raises(
        ScheduleError,
        match=r"device 0, action 2 \(B0@s0\): the backward of stage 0 needs the gradient of micro-batch 0 from stage 1, but RECV_GRAD 0 s1->s0 comes later",
    ):
        simulate(lists, 2, 1)


def test_send_before_the_action_that_makes_it():
    lists = two_stage()
    lists[0][0], lists[0][1] = lists[0][1], lists[0][0]
    with pytest.raises(
        ScheduleError,
        match=r"SEND_ACT 0 s0->s1\): the message carries the output of F0@s0, but F0@s0 comes later",
    ):
        simulate(lists, 2, 1)


def test_send_with_no_receive():
    lists = two_stage()
    lists[1].remove(RecvAct(micro=0, stage=1))
    with pytest.raises(ScheduleError) as e:
        simulate(lists, 2, 1)
    assert str(e.value) == (
        "device 0, action 1 (SEND_ACT 0 s0->s1) has no matching RECV_ACT 0 s0->s1 on device 1: "
        "every message needs one send and one receive, and this send would wait forever. "
        "Add RECV_ACT 0 s0->s1 to device 1's list, or remove SEND_ACT 0 s0->s1."
    )


def test_receive_with_no_send():
    lists = two_stage()
    lists[1].remove(SendGrad(micro=0, stage=1))
    with pytest.raises(
        ScheduleError,
        match=r"device 0, action 2 \(RECV_GRAD 0 s1->s0\) has no matching SEND_GRAD 0 s1->s0 on device 1",
    ):
        simulate(lists, 2, 1)


def test_two_devices_each_waiting_to_receive_first():
    lists = [
        [
            F(micro=0, stage=0),
            RecvGrad(micro=0, stage=0),
            B(micro=0, stage=0),
            SendAct(micro=0, stage=0),
        ],
        [
            RecvAct(micro=0, stage=1),
            F(micro=0, stage=1),
            B(micro=0, stage=1),
            SendGrad(micro=0, stage=1),
        ],
    ]
    # B0@s0 before SEND_ACT is itself fine for the order check (the send needs F0@s0 only)
    with pytest.raises(ScheduleError) as e:
        simulate(lists, 2, 1)
    assert str(e.value).startswith(
        "deadlock: device 0 blocks at RECV_GRAD 0 s1->s0 (action 1) until device 1 posts "
        "SEND_GRAD 0 s1->s0; device 1 blocks at RECV_ACT 0 s0->s1 (action 0) until device 0 "
        "posts SEND_ACT 0 s0->s1, so none of them can go on."
    )
    assert (e.value.device, e.value.action) == (0, RecvGrad(micro=0, stage=0))


def test_deadlock_of_sends_that_wait_for_each_other():
    """Sends are not buffered. GPipe with virtual stages and every message right next to
    its action: device 1 sends to device 0, which is still sending its own forwards to
    device 1 (add_communication places these messages so that this cannot happen)."""
    compute = [
        [a for a in actions if isinstance(a, Forward | Backward)]
        for actions in builtin.gpipe(2, 4, 2)
    ]
    lists = [
        [x for a in actions for x in (recv_for(a, 2, 2), a, send_for(a, 2, 2)) if x is not None]
        for actions in compute
    ]
    with pytest.raises(ScheduleError) as e:
        simulate(lists, 2, 4, 2)
    assert str(e.value).startswith(
        "deadlock: device 0 blocks at SEND_ACT 2 s0->s1 (action 5) until device 1 posts "
        "RECV_ACT 2 s0->s1; device 1 blocks at SEND_ACT 0 s1->s2 (action 2) until device 0 "
        "posts RECV_ACT 0 s1->s2, so none of them can go on."
    )


def test_messages_received_out_of_order():
    lists = builtin.one_f_one_b(2, 2)
    i, j = lists[1].index(RecvAct(micro=0, stage=1)), lists[1].index(RecvAct(micro=1, stage=1))
    lists[1][i], lists[1][j] = lists[1][j], lists[1][i]
    with pytest.raises(ScheduleError, match=r"RECV_ACT 0 s0->s1 comes later"):
        simulate(lists, 2, 2)  # the forward now precedes its receive; put them in order:
    f0 = lists[1].index(F(micro=0, stage=1))
    lists[1].insert(f0, lists[1].pop(lists[1].index(RecvAct(micro=0, stage=1))))
    with pytest.raises(ScheduleError) as e:
        simulate(lists, 2, 2)
    assert str(e.value).startswith(
        "messages from device 0 to device 1 are received out of order: the send number 0 of "
        "device 0 is SEND_ACT 0 s0->s1 (action 1), but the receive number 0 of device 1 is "
        "RECV_ACT 1 s0->s1 (action 0)."
    )


@pytest.mark.parametrize(
    ("lists", "match"),
    [
        ([[F(micro=0, stage=0), B(micro=0, stage=0)]], r"expected 2 lists \(nstages=2\), got 1"),
        ([["F0"], []], r"device 0, action 0 \(F0\): expected a Forward, Backward"),
        (
            [[F(micro=5, stage=0)], []],
            r"micro-batch 5 is out of range; nmicros=1 numbers them 0..0",
        ),
        (
            [[F(micro=0, stage=4)], []],
            r"stage 4 is out of range; nstages=2 and nvirtual=1 number the stages 0..1",
        ),
        (
            [[F(micro=0, stage=1)], []],
            r"stage 1 lives on device 1, not device 0 .* Move the action to device 1's list",
        ),
        ([[], [SendAct(micro=0, stage=1)]], r"stage 1 is the last stage, there is no stage 2"),
        (
            [[F(micro=0, stage=0), F(micro=0, stage=0)], []],
            r"device 0 runs F0@s0 twice \(actions 0 and 1\)",
        ),
    ],
)
def test_malformed_schedules(lists, match):
    with pytest.raises(ScheduleError, match=match):
        simulate(lists, 2, 1)


def test_message_between_stages_on_one_device():
    lists = builtin.gpipe(1, 1, 2)
    lists[0].insert(1, SendAct(micro=0, stage=0))
    with pytest.raises(
        ScheduleError,
        match=r"stages 0 and 1 both live on device 0, so the tensor stays on the device",
    ):
        simulate(lists, 1, 1, 2)


def test_bad_times():
    with pytest.raises(ValueError, match="comm_time must be a non-negative"):
        simulate(two_stage(), 2, 1, comm_time=-1.0)
