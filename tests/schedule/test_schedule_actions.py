"""Action values, the stage layout, and where the messages of a schedule go."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nnscaler.schedule import (
    Backward,
    Comm,
    Forward,
    RecvAct,
    RecvGrad,
    ScheduleError,
    SendAct,
    SendGrad,
    device_of_stage,
    recv_for,
    send_for,
    stages_of_device,
)


def test_short_strings():
    assert str(Forward(micro=3, stage=1)) == "F3@s1"
    assert str(Backward(micro=3, stage=1)) == "B3@s1"
    assert str(SendAct(micro=3, stage=1)) == "SEND_ACT 3 s1->s2"
    assert str(RecvAct(micro=3, stage=2)) == "RECV_ACT 3 s1->s2"
    assert str(SendGrad(micro=3, stage=2)) == "SEND_GRAD 3 s2->s1"
    assert str(RecvGrad(micro=3, stage=1)) == "RECV_GRAD 3 s2->s1"
    assert repr(Forward(micro=3, stage=1)) == "Forward(micro=3, stage=1)"


@given(st.integers(0, 100), st.integers(1, 100))
def test_messages_match_their_peer(micro, stage):
    for message in (
        SendAct(micro=micro, stage=stage),
        RecvAct(micro=micro, stage=stage),
        SendGrad(micro=micro, stage=stage),
        RecvGrad(micro=micro, stage=stage),
    ):
        other = message.matching()
        assert other.matching() == message
        assert (other.src, other.dst, other.micro) == (message.src, message.dst, message.micro)
        assert other.is_send != message.is_send and other.is_grad == message.is_grad
        assert abs(message.src - message.dst) == 1
        assert str(other).split()[1:] == str(message).split()[1:]


def test_actions_are_frozen_hashable_and_keyword_only():
    a = Forward(micro=1, stage=2)
    assert a == Forward(micro=1, stage=2) and a != Backward(micro=1, stage=2)
    assert len({a, Forward(micro=1, stage=2), Backward(micro=1, stage=2)}) == 2
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.micro = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        Forward(1, 2)  # type: ignore[misc]


@pytest.mark.parametrize("value", [-1, 1.0, True, "0"])
def test_indices_must_be_non_negative_ints(value):
    with pytest.raises(ScheduleError, match=r"Forward.micro must be a non-negative int"):
        Forward(micro=value, stage=0)


def test_first_stage_has_no_previous_stage():
    with pytest.raises(ScheduleError, match="stage 0 is the first stage, so it cannot receive"):
        RecvAct(micro=0, stage=0)
    with pytest.raises(ScheduleError, match="stage 0 is the first stage, so it cannot send"):
        SendGrad(micro=0, stage=0)
    with pytest.raises(TypeError, match="use SendAct, RecvAct"):
        Comm(micro=0, stage=1)


@given(st.integers(1, 8), st.integers(1, 4))
def test_interleaved_layout(nstages, nvirtual):
    held = [stages_of_device(d, nstages, nvirtual) for d in range(nstages)]
    assert sorted(s for stages in held for s in stages) == list(range(nstages * nvirtual))
    for d, stages in enumerate(held):
        assert stages == tuple(range(d, nstages * nvirtual, nstages))
        assert all(device_of_stage(s, nstages) == d for s in stages)


def test_recv_for_and_send_for():
    # 2 devices x 2 virtual stages: stages 0..3, device 0 holds 0 and 2
    assert recv_for(Forward(micro=1, stage=0), 2, 2) is None
    assert recv_for(Forward(micro=1, stage=2), 2, 2) == RecvAct(micro=1, stage=2)
    assert recv_for(Backward(micro=1, stage=3), 2, 2) is None
    assert recv_for(Backward(micro=1, stage=2), 2, 2) == RecvGrad(micro=1, stage=2)
    assert send_for(Forward(micro=1, stage=3), 2, 2) is None
    assert send_for(Forward(micro=1, stage=2), 2, 2) == SendAct(micro=1, stage=2)
    assert send_for(Backward(micro=1, stage=0), 2, 2) is None
    assert send_for(Backward(micro=1, stage=2), 2, 2) == SendGrad(micro=1, stage=2)
    # one device: every tensor stays on it
    assert recv_for(Forward(micro=0, stage=1), 1, 2) is None
    assert send_for(Forward(micro=0, stage=0), 1, 2) is None
