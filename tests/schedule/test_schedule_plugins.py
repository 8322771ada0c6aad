"""Schedules from plugins: registered through the hook, found by name, checked by simulate."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from schedule_strategies import micros, stages

import nnscaler
from nnscaler.plugins import NNScalerPluginManager
from nnscaler.schedule import (
    Action,
    Backward,
    Forward,
    ScheduleError,
    add_communication,
    builtin,
    get_schedule,
    simulate,
)


def one_at_a_time(nstages: int, nmicros: int, nvirtual: int = 1) -> list[list[Action]]:
    """Each micro-batch goes through the whole pipeline and back before the next starts."""
    compute: list[list[Action]] = [[] for _ in range(nstages)]
    for m in range(nmicros):
        for s in range(nstages * nvirtual):
            compute[s % nstages].append(Forward(micro=m, stage=s))
        for s in reversed(range(nstages * nvirtual)):
            compute[s % nstages].append(Backward(micro=m, stage=s))
    return add_communication(compute, nstages, nvirtual)


def forgets_a_backward(nstages: int, nmicros: int, nvirtual: int = 1) -> list[list[Action]]:
    lists = builtin.gpipe(nstages, nmicros, nvirtual)
    lists[-1].remove(Backward(micro=nmicros - 1, stage=nstages * nvirtual - 1))
    return lists


class ThirdPartySchedules:
    @nnscaler.hookimpl
    def nnscaler_register_schedules(self, registry):
        registry.register("one_at_a_time", one_at_a_time)
        registry.register("forgets_a_backward", forgets_a_backward)


@pytest.fixture(scope="module")
def pm():
    return NNScalerPluginManager(autoload=False, plugins=[builtin, ThirdPartySchedules()])


@settings(max_examples=25, deadline=None)
@given(stages, micros)
def test_third_party_schedule_is_found_and_validated(pm, p, m):
    schedule = get_schedule("one_at_a_time", plugin_manager=pm)
    assert schedule is one_at_a_time
    result = simulate(schedule(p, m), p, m)
    assert result.bubble_fraction == (p - 1) / p
    assert result.peak_alive == (1,) * p


def test_third_party_registrations_are_attributed(pm):
    assert pm.schedules.registrant("one_at_a_time") == "ThirdPartySchedules"
    assert pm.schedules.registrant("1f1b") == "nnscaler.schedule.builtin"
    assert pm.contributions("ThirdPartySchedules")["schedules"] == [
        "one_at_a_time",
        "forgets_a_backward",
    ]


def test_broken_third_party_schedule_is_rejected(pm):
    schedule = get_schedule("forgets_a_backward", plugin_manager=pm)
    with pytest.raises(ScheduleError, match=r"^B3@s1 is missing: device 1 must run the backward"):
        simulate(schedule(2, 4), 2, 4)


def test_get_schedule_uses_the_process_wide_manager(fresh_plugins, monkeypatch):
    if "nnscaler.schedule.builtin" not in fresh_plugins.BUILTIN_PLUGINS:  # not yet wired in
        monkeypatch.setattr(
            fresh_plugins,
            "BUILTIN_PLUGINS",
            (*fresh_plugins.BUILTIN_PLUGINS, "nnscaler.schedule.builtin"),
        )
    assert get_schedule("1f1b") is builtin.one_f_one_b
    with pytest.raises(nnscaler.UnknownNameError, match="Registered schedules: 1f1b, "):
        get_schedule("zero_bubble")
