"""How the profiler measures an op: untimed first calls, a statistic that drops slow
calls, subnormal floats flushed while measuring, made-up weights at their fan-in's
scale."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from nnscaler_policy_autodist import profile
from nnscaler_policy_autodist.profile import (
    ProfileJob,
    TensorSpec,
    flushes_denormals,
    flushing_denormals,
    run_job,
    typical,
)

import nnscaler.extend


def spin(seconds: float) -> None:
    """Keep this thread's core busy for ``seconds`` of its CPU time (a sleep would not
    count on the CPU clock ops are timed with)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class SlowCalls:
    """An op whose calls numbered in ``slow`` (from 0) compute ``pause`` seconds first; the
    others double their input. Notes whether subnormals were flushed in each call."""

    name = "test.slow_calls"

    def __init__(self, slow: set[int], pause: float = 0.1) -> None:
        self.slow = slow
        self.pause = pause
        self.calls = 0
        self.flushed: list[bool] = []

    def call(self, args, kwargs):
        if self.calls in self.slow:
            spin(self.pause)
        self.calls += 1
        self.flushed.append(flushes_denormals())
        return args[0] * 2


@pytest.fixture
def slow_op(monkeypatch):
    def install(slow: set[int]) -> SlowCalls:
        op = SlowCalls(slow)
        ops = SimpleNamespace(get=lambda name: op)
        monkeypatch.setattr(nnscaler.extend, "get_plugin_manager",
                            lambda: SimpleNamespace(ops=ops))
        return op

    return install


def _job() -> ProfileJob:
    return ProfileJob(op=SlowCalls.name, args=[TensorSpec((4, 4), torch.float32)], kwargs={},
                      grads=True)


def test_a_slow_first_call_is_not_timed(slow_op):
    op = slow_op({0, 1, 2})  # lazy set-up over the first three calls
    fw, bw = run_job(_job())
    assert op.calls >= 2 + profile.MIN_SAMPLES
    assert fw + bw < 0.01  # not the 0.1 s of the first calls


def test_a_slow_call_among_the_samples_is_dropped(slow_op):
    op = slow_op({0, profile.WARMUP_CALLS + 2})  # the first call, and a page fault later
    fw, bw = run_job(_job())
    assert op.calls > profile.WARMUP_CALLS + 2
    assert fw + bw < 0.01


def test_typical_is_the_mean_without_the_slowest_quarter():
    assert typical([(1.0, 2.0)] * 6 + [(50.0, 0.0)]) == (1.0, 2.0)
    many = [(1.0, 1.0)] * 15 + [(9.0, 9.0)] * 5  # a fifth of the calls slowed
    assert typical(many) == (1.0, 1.0)
    assert typical([(1.0, 0.0), (3.0, 0.0)]) == (1.0, 0.0)
    assert typical([(2.0, 1.0)]) == (2.0, 1.0)
    # the mean of what is kept: a core shared with another rank shows in it
    assert typical([(1.0, 0.0), (2.0, 0.0), (3.0, 0.0), (10.0, 0.0)]) == (2.0, 0.0)


def test_ops_are_timed_with_subnormals_flushed_and_the_setting_restored(slow_op):
    op = slow_op(set())
    before = flushes_denormals()
    run_job(_job())
    assert op.flushed and all(op.flushed)
    assert flushes_denormals() == before


def test_flushing_restores_a_flush_the_caller_had_set():
    torch.set_flush_denormal(True)
    try:
        with flushing_denormals():
            assert flushes_denormals()
        assert flushes_denormals()
    finally:
        torch.set_flush_denormal(False)
    with flushing_denormals():
        assert flushes_denormals()
    assert not flushes_denormals()


def test_the_calibration_run_flushes_subnormals(monkeypatch):
    from torch import nn

    from nnscaler.graph import IRGraph
    from nnscaler.trace import trace

    seen: list[bool] = []
    real = nnscaler.extend.run_ops

    def recording(*args, **kwargs):
        seen.append(flushes_denormals())
        return real(*args, **kwargs)

    monkeypatch.setattr(nnscaler.extend, "run_ops", recording)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    g = IRGraph.from_graph(trace(model, {"input": torch.randn(4, 8)}))
    jobs = [ProfileJob(op="torch.nn.functional.gelu", args=[TensorSpec((4, 16), torch.float32)],
                       kwargs={}, grads=True),
            ProfileJob(op="torch.nn.functional.gelu", args=["not a tensor"], kwargs={},
                       grads=True)]
    step, opt, alone = profile._run_model(g.nodes(), g.output_tensors(), 1 << 30, repeat=2,
                                          alone=jobs)
    assert step > 0 and opt > 0
    assert seen and all(seen)
    assert not flushes_denormals()
    # the ops timed alone between the runs: their medians, or why one cannot run
    assert isinstance(alone[0], tuple) and alone[0][0] > 0 and alone[0][1] > 0
    assert isinstance(alone[1], str)


def _mlp_graph():
    from torch import nn

    from nnscaler.graph import IRGraph
    from nnscaler.trace import trace

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    return IRGraph.from_graph(trace(model, {"input": torch.randn(32, 64)}))


def test_the_factor_divides_by_the_ops_timed_in_the_same_window(tmp_path, monkeypatch):
    """A machine twice as loaded while calibrating as while profiling: the model's step
    and its ops timed alone meanwhile both double, and the factor stays."""
    from nnscaler_policy_autodist.comm import device_spec
    from nnscaler_policy_autodist.profile import ComputeProfiler, _grads

    g = _mlp_graph()
    ops = g.nodes()
    prof = ComputeProfiler(device_spec("cpu", tmp_path), tmp_path)
    raw = {id(op): prof.time(op, None, 1) for op in ops}
    parts = sum(fw + (bw if _grads(op) else 0.0) for op in ops for fw, bw in [raw[id(op)]])
    by_key = {}
    for op in ops:
        found = prof._job(op, None, 1)
        if found is not None:
            by_key[found[0]] = (found[1], prof._table[found[0]])

    def loaded_twice(ops, outputs, max_bytes, repeat, alone):
        assert list(alone) == [job for job, _ in by_key.values()]  # each distinct op once
        return 2 * 1.25 * parts, 1e-3, [(2 * fw, 2 * bw) for _, (fw, bw) in by_key.values()]

    monkeypatch.setattr(profile, "_run_model", loaded_twice)
    assert prof.calibrate(ops, g.output_tensors())[0] == pytest.approx(1.25)


def test_made_up_weights_have_their_fan_in_scale():
    torch.manual_seed(0)
    w = profile._make(TensorSpec((256, 1024), torch.float32), torch.device("cpu"), True,
                      weight=True)
    assert w.requires_grad
    assert w.std().item() == pytest.approx(1024 ** -0.5, rel=0.05)
    x = profile._make(TensorSpec((256, 1024), torch.float32), torch.device("cpu"), False)
    assert x.std().item() == pytest.approx(1.0, rel=0.05)  # an input keeps unit scale
    norm = profile._make(TensorSpec((1024,), torch.float32), torch.device("cpu"), True,
                         weight=True)
    assert norm.std().item() == pytest.approx(1.0, rel=0.1)  # a vector is not a fan-in


class Descheduled(SlowCalls):
    """An op each of whose calls waits ``pause`` seconds without computing, as when
    another process takes its core."""

    def call(self, args, kwargs):
        time.sleep(self.pause)
        return super().call(args, kwargs)


def test_time_another_process_takes_is_not_the_ops(monkeypatch):
    assert torch.get_num_threads() == 1  # the suite runs one thread per process
    op = Descheduled(set(), pause=0.01)
    monkeypatch.setattr(nnscaler.extend, "get_plugin_manager",
                        lambda: SimpleNamespace(ops=SimpleNamespace(get=lambda name: op)))
    fw, bw = run_job(_job())
    assert fw < 0.005  # the 10 ms waits are not counted


def test_cpu_times_count_the_ranks_sharing_a_core(tmp_path, monkeypatch):
    from nnscaler_policy_autodist.comm import device_spec
    from nnscaler_policy_autodist.profile import ComputeProfiler

    g = _mlp_graph()
    op = g.nodes()[0]
    alone = ComputeProfiler(device_spec("cpu", tmp_path), tmp_path)
    assert alone.clock_share == 1.0
    fw, bw = alone.time(op, None, 1)
    adam = alone.optimizer_time(4096)
    alone.save()
    monkeypatch.setattr(profile, "core_share", lambda: 2.0)  # four ranks on two cores
    shared = ComputeProfiler(device_spec("cpu", tmp_path), tmp_path)
    assert shared.profiled == 0 and shared.clock_share == 2.0
    assert shared.time(op, None, 1) == pytest.approx((2 * fw, 2 * bw))
    assert shared.optimizer_time(4096) == pytest.approx(2 * adam)


def test_adam_step_includes_the_gradient_buffers_work(monkeypatch):
    """Each timed step zeroes every gradient (the reducer's buffer, as ``zero_grad``
    does) and adds the step's new gradient to it, as backward does, inside the clock:
    after the steps a gradient is the new one once, not a sum of them."""
    params = [torch.zeros(64, requires_grad=True), torch.zeros(8, 4, requires_grad=True)]
    ticks: list[str] = []
    real_zero = torch.Tensor.zero_

    def zero(self):
        ticks.append("zero")
        return real_zero(self)

    monkeypatch.setattr(profile, "op_clock", lambda device: lambda: ticks.append("clock") or 0.0)
    monkeypatch.setattr(torch.Tensor, "zero_", zero)
    torch.manual_seed(0)
    profile._adam_seconds(params, steps=2)
    torch.manual_seed(0)
    fresh = [torch.randn_like(p) for p in params]
    for p, g in zip(params, fresh):
        assert torch.equal(p.grad, g)
    # per step: the clock, a zeroing per gradient, the clock
    assert ticks == ["clock", "zero", "zero", "clock"] * 2
