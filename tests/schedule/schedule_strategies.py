"""Hypothesis strategies for pipeline schedules: sizes, and random valid compute orders."""

from __future__ import annotations

from hypothesis import strategies as st

from nnscaler.schedule import Action, Backward, Forward, device_of_stage, inputs_of

stages = st.integers(1, 8)
micros = st.integers(1, 32)


@st.composite
def interleaved_sizes(draw: st.DrawFn) -> tuple[int, int, int]:
    """(nstages, nmicros, nvirtual) that 1f1b_interleaved accepts: with nvirtual > 1,
    nmicros is a multiple of nstages."""
    p = draw(stages)
    v = draw(st.integers(1, 4))
    m = draw(micros) if v == 1 else p * draw(st.integers(1, 32 // p))
    return p, m, v


@st.composite
def compute_orders(draw: st.DrawFn) -> tuple[int, int, int, list[list[Action]]]:
    """A random order of every forward and backward that respects their dependencies,
    split into per-device lists: (nstages, nmicros, nvirtual, lists)."""
    p = draw(st.integers(1, 4))
    m = draw(st.integers(1, 6))
    v = draw(st.integers(1, 3))
    rnd = draw(st.randoms(use_true_random=False))
    pending: list[Action] = [
        kind(micro=micro, stage=stage)
        for stage in range(p * v)
        for micro in range(m)
        for kind in (Forward, Backward)
    ]
    done: set[Action] = set()
    lists: list[list[Action]] = [[] for _ in range(p)]
    while pending:
        ready = [a for a in pending if all(n in done for n in inputs_of(a, p, v))]
        action = rnd.choice(ready)
        pending.remove(action)
        done.add(action)
        lists[device_of_stage(action.stage, p)].append(action)
    return p, m, v, lists
