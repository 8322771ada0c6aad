"""The built-in schedules: valid in the simulator, with the bubbles and memory they promise."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schedule_strategies import compute_orders, interleaved_sizes, micros, stages

from nnscaler.errors import UnknownNameError
from nnscaler.plugins import NNScalerPluginManager
from nnscaler.schedule import (
    Backward,
    Forward,
    ScheduleError,
    add_communication,
    builtin,
    get_schedule,
    recv_for,
    send_for,
    simulate,
)

FAST = settings(max_examples=40, deadline=None)


@pytest.fixture(scope="module")
def pm():
    # until the lead lists nnscaler.schedule.builtin in BUILTIN_PLUGINS; harmless after
    return NNScalerPluginManager(autoload=False, plugins=[builtin])


def test_builtins_are_registered(pm):
    assert get_schedule("gpipe", plugin_manager=pm) is builtin.gpipe
    assert get_schedule("1f1b", plugin_manager=pm) is builtin.one_f_one_b
    assert get_schedule("1f1b_interleaved", plugin_manager=pm) is builtin.one_f_one_b_interleaved
    assert pm.contributions("nnscaler.schedule.builtin")["schedules"] == [
        "gpipe",
        "1f1b",
        "1f1b_interleaved",
    ]


def test_unknown_schedule_lists_the_registered_ones(pm):
    with pytest.raises(UnknownNameError, match=r"no schedule named '1f1b_interleave'") as e:
        get_schedule("1f1b_interleave", plugin_manager=pm)
    assert "Did you mean '1f1b_interleaved'" in str(e.value)
    assert "Registered schedules: 1f1b, 1f1b_interleaved, gpipe" in str(e.value)


@FAST
@given(stages, micros, st.integers(1, 4))
def test_gpipe_is_valid(p, m, v):
    result = simulate(builtin.gpipe(p, m, v), p, m, v)
    assert result.peak_alive == (m * v,) * p
    assert result.busy == (m * v * 3.0,) * p


@FAST
@given(stages, micros)
def test_gpipe_and_1f1b_bubble_is_exact(p, m):
    for schedule in (builtin.gpipe, builtin.one_f_one_b):
        result = simulate(schedule(p, m), p, m, fwd_time=1.0, bwd_time=2.0, comm_time=0.0)
        assert result.bubble_fraction == (p - 1) / (m + p - 1)
        assert result.makespan == 3 * (m + p - 1)


@FAST
@given(stages, micros)
def test_1f1b_keeps_at_most_stages_minus_rank_micro_batches(p, m):
    result = simulate(builtin.one_f_one_b(p, m), p, m)
    for rank, alive in enumerate(result.peak_alive):
        assert alive <= p - rank
        assert alive == min(p - rank, m)


@FAST
@given(stages, micros)
def test_1f1b_places_messages_like_megatron(p, m):
    """Receive right before the action that needs the tensor, send right after."""
    lists = builtin.one_f_one_b(p, m)
    for actions in lists:
        compute = [a for a in actions if isinstance(a, Forward | Backward)]
        expected = [
            x for a in compute for x in (recv_for(a, p), a, send_for(a, p)) if x is not None
        ]
        assert actions == expected


@FAST
@given(interleaved_sizes())
def test_interleaved_is_valid_and_beats_1f1b(sizes):
    p, m, v = sizes
    result = simulate(builtin.one_f_one_b_interleaved(p, m, v), p, m, v)
    assert result.bubble_fraction == (p - 1) / (v * m + p - 1)
    one_f_one_b = simulate(builtin.one_f_one_b(p, m), p, m)
    if v > 1 and p > 1:
        assert result.bubble_fraction < one_f_one_b.bubble_fraction
    else:
        assert result.bubble_fraction == one_f_one_b.bubble_fraction


def test_interleaved_with_one_virtual_stage_is_1f1b():
    assert builtin.one_f_one_b_interleaved(4, 6, 1) == builtin.one_f_one_b(4, 6)


@pytest.mark.parametrize(
    ("p", "m", "hint"), [(4, 6, "Use nmicros=4 or 8"), (4, 3, "Use nmicros=4, or the '1f1b'")]
)
def test_interleaved_needs_a_multiple_of_nstages(p, m, hint):
    with pytest.raises(ScheduleError, match="nmicros must be a multiple of nstages") as e:
        builtin.one_f_one_b_interleaved(p, m, 2)
    assert f"got nmicros={m}, nstages={p}" in str(e.value) and hint in str(e.value)


def test_1f1b_has_no_virtual_stages():
    with pytest.raises(ScheduleError, match="Use '1f1b_interleaved' for virtual stages"):
        builtin.one_f_one_b(2, 4, 2)


@pytest.mark.parametrize("schedule", [builtin.gpipe, builtin.one_f_one_b])
@pytest.mark.parametrize("sizes", [(0, 4, 1), (2, 0, 1), (2, 4, 0), (2.0, 4, 1), (True, 4, 1)])
def test_sizes_must_be_positive_ints(schedule, sizes):
    with pytest.raises(ScheduleError, match="must be a positive int"):
        schedule(*sizes)


@settings(max_examples=150, deadline=None)
@given(compute_orders())
def test_add_communication_never_deadlocks(case):
    """Any order of forwards and backwards that respects their dependencies gets messages
    that the simulator accepts, whatever times the placement assumed."""
    p, m, v, compute = case
    simulate(add_communication(compute, p, v), p, m, v)
    simulate(add_communication(compute, p, v, fwd_time=3.0, bwd_time=1.0), p, m, v)


def test_add_communication_rejects_orders_that_cannot_run():
    with pytest.raises(ScheduleError, match="takes forwards and backwards only"):
        add_communication([[builtin.one_f_one_b(2, 1)[0][1]], []], 2)
    with pytest.raises(ScheduleError, match=r"holds F0@s1, but stage 1 lives on device 1"):
        add_communication([[Forward(micro=0, stage=1)], []], 2)
    with pytest.raises(
        ScheduleError, match=r"B0@s1 makes the input of B0@s0, which no device runs"
    ):
        add_communication(
            [[Forward(micro=0, stage=0)], [Forward(micro=0, stage=1), Backward(micro=0, stage=1)]],
            2,
        )
    with pytest.raises(
        ScheduleError,
        match=r"device 0 waits at B0@s0 \(action 0\) for F0@s0 \(device 0, action 1\)",
    ):
        add_communication(
            [
                [Backward(micro=0, stage=0), Forward(micro=0, stage=0)],
                [Forward(micro=0, stage=1), Backward(micro=0, stage=1)],
            ],
            2,
        )
