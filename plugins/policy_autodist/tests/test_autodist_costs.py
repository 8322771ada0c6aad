"""The cost model's parts: communication figures measured on a process group, the
profile of an op too large to run, plans for a named device, plots."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from nnscaler_policy_autodist import DEVICE_SPECS, AutoDistError, measure_comm
from nnscaler_policy_autodist.comm import METHOD, CommModel, device_spec, monotone
from nnscaler_policy_autodist.profile import ComputeProfiler, analytic_time
from torch import nn

from nnscaler.graph import IRGraph
from nnscaler.testing import run_distributed
from nnscaler.trace import trace


def _measure(rank, world, profile_dir):
    return measure_comm(profile_dir)


def test_measured_comm_is_cached_and_used(tmp_path):
    figures = run_distributed(_measure, 2, str(tmp_path))
    assert figures[0]["bw"] > 0 and figures[0]["lat"] > 0
    assert figures[0]["method"] == METHOD
    times = [t for _, t in figures[0]["points"]]
    assert all(t > 0 for t in times) and times == sorted(times)  # larger never cheaper
    assert list(figures[0]["alltoall"]) == ["2"]  # and the token exchange's, per group
    spec = device_spec("cpu", tmp_path)
    assert spec.intra_bw == pytest.approx(figures[0]["bw"])
    assert [g for g, _ in spec.alltoall_curves] == [2]
    assert measure_comm(tmp_path) is None  # no process group here


def recording_run_job(job):
    """``run_job``, leaving a file per measurement that names the rank that made it."""
    import os

    import torch.distributed as dist
    from nnscaler_policy_autodist import profile

    out = os.environ["AUTODIST_TEST_JOBS"]
    with open(os.path.join(out, f"{dist.get_rank()}-{os.getpid()}-{len(os.listdir(out))}"),
              "w") as f:
        f.write(job.op)
    return profile.measure_job(job)


def _plan_in_parallelize(rank, world, profile_dir, gen):
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.models import MLP, MLPConfig

    model = MLP(MLPConfig(d_in=16, d_hidden=32, n_classes=4, n_layers=2))
    batch = {"x": torch.randn(8, 16), "y": torch.randint(4, (8,))}
    parallelize(model, {"batch": batch}, "autodist",
                ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_end2end=True,
                              pas_config={"profile_dir": profile_dir}),
                gen_savedir=gen, load_module=False)


def test_profiling_and_comm_are_measured_on_every_rank(tmp_path, monkeypatch):
    from nnscaler_policy_autodist import profile

    jobs = tmp_path / "jobs"
    jobs.mkdir()
    monkeypatch.setenv("AUTODIST_TEST_JOBS", str(jobs))
    monkeypatch.setattr(profile, "measure_job", profile.run_job, raising=False)
    monkeypatch.setattr(profile, "run_job", recording_run_job)
    prof = tmp_path / "profile"
    run_distributed(_plan_in_parallelize, 2, str(prof), str(tmp_path / "gen"))
    ranks = [name.name.split("-")[0] for name in jobs.iterdir()]
    assert ranks.count("0") > 0 and ranks.count("1") > 0, ranks  # both ranks measured
    assert abs(ranks.count("0") - ranks.count("1")) <= 1  # in equal shares
    assert (prof / "comm-cpu-g2.json").is_file()  # measured without being asked
    assert json.loads((prof / "comm-cpu-g2.json").read_text())["alltoall"] == {}  # no MoE op
    table = next(prof.glob("compute-*.json")).read_text()
    assert table.count("|") >= 2 * len(ranks)  # every measurement reached rank 0's cache


@given(st.lists(st.floats(0, 1e3, allow_nan=False), max_size=12))
def test_monotone_is_the_nearest_non_decreasing_sequence(values):
    out = monotone(values)
    assert len(out) == len(values)
    assert all(a <= b * (1 + 1e-12) + 1e-12 for a, b in zip(out, out[1:]))
    assert sum(out) == pytest.approx(sum(values))  # pooling keeps the mean of each run
    if values == sorted(values):
        assert out == pytest.approx(values)


def test_monotone_pools_a_noisy_point_with_its_neighbours():
    # a slow 64 KiB sample does not lift every larger size to its value
    assert monotone([1.0, 4.0, 2.0, 5.0]) == [1.0, 3.0, 3.0, 5.0]


def test_comm_figures_are_kept_per_group_size(tmp_path):
    for g, lat in ((2, 1e-4), (8, 9e-4)):
        (tmp_path / f"comm-cpu-g{g}.json").write_text(json.dumps({"lat": lat, "bw": 1e9,
                                                                   "group": g}))
    assert device_spec("cpu", tmp_path, 2).intra_lat == pytest.approx(1e-4)
    assert device_spec("cpu", tmp_path, 8).intra_lat == pytest.approx(9e-4)
    assert device_spec("cpu", tmp_path, 3).intra_lat == pytest.approx(1e-4)  # the nearest
    assert device_spec("cpu", tmp_path / "none", 4).intra_lat == DEVICE_SPECS["cpu"].intra_lat


def test_measured_points_are_interpolated():
    import attrs

    curve = ((4096.0, 1e-4), (2.0**20, 2e-3), (2.0**23, 8e-3))
    spec = attrs.evolve(DEVICE_SPECS["cpu"], allreduce_curve=curve, curve_group=2)
    comm = CommModel(spec)
    assert comm.measured(100, 2) == pytest.approx(1e-4)  # below the first point
    mid = (4096 + 2**20) / 2
    assert comm.measured(mid, 2) == pytest.approx((1e-4 + 2e-3) / 2)
    assert comm.measured(2.0**24, 2) == pytest.approx(8e-3 + 6e-3 / 7 * 8)  # last slope
    assert comm.measured(2.0**20, 4) == pytest.approx(3 * 2e-3)  # three hops, not one
    # on 2 devices a ring all-reduce of S bytes moves S through each: a step moving 2^20
    # bytes through each device is the 2^20-byte all-reduce
    assert comm.step_time([(0, 1)], 2**18, 4) == pytest.approx(2e-3)
    assert comm.allreduce_time(2**20, 2, bucketed=False) == pytest.approx(2e-3)


def test_comm_model_prefers_nvlink_inside_a_node():
    comm = CommModel(DEVICE_SPECS["H100"])
    inside = comm.step_time([(0, 1, 2, 3)], 1e6, 2)
    across = comm.step_time([(0, 8)], 1e6, 2)
    assert across > inside > 0


def _linear_graph(n: int) -> IRGraph:
    model = nn.Linear(n, n)
    return IRGraph.from_graph(trace(model, {"input": torch.randn(64, n)}))


def test_an_op_too_large_is_timed_on_a_part(tmp_path, monkeypatch):
    """A part 1/m of the op is run and its time multiplied by m. The clock is replaced
    by the linear's multiply-adds (1 ns each) so the check is exact on any machine."""
    from nnscaler_policy_autodist import profile

    ran = []

    def fake_run(job):
        x, w = job.args[0], job.args[1]
        ran.append((x.shape, w.shape))
        macs = math.prod(x.shape) * w.shape[0]
        return macs * 1e-9, 2 * macs * 1e-9

    monkeypatch.setattr(profile, "run_job", fake_run)
    op = _linear_graph(256).select(name="linear")[0]
    whole = ComputeProfiler(DEVICE_SPECS["cpu"], tmp_path).time(op, None, 1)
    assert ran == [((64, 256), (256, 256))]
    assert whole == pytest.approx((64 * 256 * 256e-9, 2 * 64 * 256 * 256e-9))

    # 64 + 256 + 64 KiB of tensors, 64 KiB allowed: split in 8 along a dim the output keeps
    shrunk = ComputeProfiler(DEVICE_SPECS["cpu"], tmp_path / "small", max_bytes=64 * 1024)
    scaled = shrunk.time(op, None, 1)
    (x, w), = ran[1:]
    assert math.prod(x) * w[0] == 64 * 256 * 256 // 8  # an eighth of the work ran
    assert scaled == pytest.approx(whole)  # and counts eight times
    assert shrunk.profiled == 1


def test_named_device_is_analytic():
    op = _linear_graph(64).select(name="linear")[0]
    fw, bw = analytic_time(op, DEVICE_SPECS["H100"])
    assert 0 < fw < 1e-3 and bw == pytest.approx(2 * fw)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from types import SimpleNamespace

    from nnscaler_policy_autodist import plan_graph

    g = _linear_graph(16)
    cfg = SimpleNamespace(plan_ngpus=2, runtime_ngpus=2, use_end2end=True, pas_config={
        "profile_dir": str(tmp_path), "plot_path": str(tmp_path / "plan.png")})
    plan_graph(g, cfg)
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    import builtins

    from nnscaler_policy_autodist import report

    real = builtins.__import__

    def no_mpl(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(AutoDistError, match=r"pip install 'nnscaler-policy-autodist\[plot\]'"):
        report.plot(None, tmp_path / "x.png")


def test_grouped_mm_is_profiled_with_balanced_groups():
    from nnscaler_policy_autodist.profile import VALUE_MAKERS, ProfileJob, TensorSpec, run_job

    make = VALUE_MAKERS["torch._grouped_mm"]
    a, b = torch.randn(96, 16), torch.randn(4, 16, 8)
    offs = torch.zeros(4, dtype=torch.int32)  # what the profiler makes up: every group empty
    _, kw = make([a, b], {"offs": offs})
    assert kw["offs"].tolist() == [24, 48, 72, 96] and kw["offs"].dtype == torch.int32
    args, _ = make([b.transpose(1, 2).reshape(32, 16)[:, :16].reshape(2, 16, 16),
                    torch.randn(16, 40), offs[:2]], {})
    assert args[2].tolist()[-1] == 40  # the columns of mat2 are grouped
    if hasattr(torch, "_grouped_mm"):
        job = ProfileJob(op="torch._grouped_mm",
                         args=[TensorSpec((96, 16), torch.float32),
                               TensorSpec((4, 16, 8), torch.float32)],
                         kwargs={"offs": TensorSpec((4,), torch.int32)}, grads=True)
        fw, bw = run_job(job)
        assert fw > 0 and bw > 0


def test_optimizer_time_is_measured_here_and_analytic_for_a_named_device(tmp_path):
    here = ComputeProfiler(device_spec("cpu", tmp_path), tmp_path, measure=True)
    small, large = here.optimizer_time(1024), here.optimizer_time(64 * 2**20)
    assert 0 < small < large
    assert here.optimizer_time(1024, opt_state=0) < small  # SGD's step moves fewer bytes
    h100 = ComputeProfiler(DEVICE_SPECS["H100"], tmp_path, measure=False)
    assert h100.optimizer_time(2**30) == pytest.approx(7 * 2**30 / DEVICE_SPECS["H100"].mem_bw)


def test_a_job_that_cannot_travel_is_measured_here(tmp_path, monkeypatch):
    import threading

    from nnscaler_policy_autodist import profile

    import nnscaler.extend

    sent = []

    def recording_map(fn, items):
        sent.extend(items)
        return [fn(x) for x in items]

    monkeypatch.setattr(nnscaler.extend, "map_over_ranks", recording_map)  # where plugins take it
    graph = _linear_graph(8)
    op = graph.nodes()[0]
    prof = ComputeProfiler(device_spec("cpu", tmp_path), tmp_path, measure=True)
    real_job = prof._job

    def job_with_a_lock(op, t, num):  # an argument pickle refuses (a lock)
        key, job, scale = real_job(op, t, num)
        return key, profile.ProfileJob(op=job.op, args=job.args,
                                       kwargs={**job.kwargs, "lock": threading.Lock()},
                                       grads=job.grads), scale

    monkeypatch.setattr(prof, "_job", job_with_a_lock)
    assert prof.prefetch([(op, None, 1)]) == 1
    assert sent == []  # not sent to the other ranks
    assert prof.time(op, None, 1)[0] > 0  # measured (here: estimated, linear refuses it)


def _mlp_graph() -> IRGraph:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    return IRGraph.from_graph(trace(model, {"input": torch.randn(32, 64)}))


def test_calibration_scales_op_and_optimizer_times_to_a_measured_step(tmp_path, monkeypatch):
    from nnscaler_policy_autodist import profile

    g = _mlp_graph()
    ops = g.nodes()
    prof = ComputeProfiler(device_spec("cpu", tmp_path), tmp_path)
    raw = [prof.time(op, None, 1) for op in ops]
    parts = sum(fw + bw for fw, bw in raw)
    opt_raw = sum(prof.optimizer_time(p.numel * 4) for p in g.parameters())
    monkeypatch.setattr(profile, "_run_model", lambda *a, **k: (3 * parts, 0.5 * opt_raw, []))
    assert prof.calibrate(ops, g.output_tensors()) == pytest.approx((3.0, 0.5))
    scaled = [x for op in ops for x in prof.time(op, None, 1)]
    assert scaled == pytest.approx([3 * x for pair in raw for x in pair])
    assert sum(prof.optimizer_time(p.numel * 4) for p in g.parameters()) == pytest.approx(
        0.5 * opt_raw)
    prof.save()
    # cached with the profile: a second compile of the same model runs nothing
    monkeypatch.setattr(profile, "_run_model", lambda *a, **k: pytest.fail("measured again"))
    again = ComputeProfiler(device_spec("cpu", tmp_path), tmp_path)
    assert again.calibrate(ops, g.output_tensors()) == pytest.approx((3.0, 0.5))


def test_calibration_runs_the_model_on_made_up_values(tmp_path):
    from nnscaler_policy_autodist.profile import _run_model

    g = _mlp_graph()
    step, opt, alone = _run_model(g.nodes(), g.output_tensors(), 1 << 30)
    assert step > 0 and opt > 0 and alone == []
    # a model that does not fit the allowance is not run, and keeps its parts' times
    why = _run_model(g.nodes(), g.output_tensors(), 1024)
    assert isinstance(why, str) and "MiB" in why
    prof = ComputeProfiler(device_spec("cpu", tmp_path), tmp_path)
    assert prof.calibrate(g.nodes(), g.output_tensors(), max_bytes=1024) == (1.0, 1.0)


def test_a_named_device_is_not_calibrated(tmp_path, monkeypatch):
    from nnscaler_policy_autodist import profile

    monkeypatch.setattr(profile, "_run_model", lambda *a, **k: pytest.fail("ran the model"))
    g = _mlp_graph()
    h100 = ComputeProfiler(DEVICE_SPECS["H100"], tmp_path, measure=False)
    assert h100.calibrate(g.nodes(), g.output_tensors()) == (1.0, 1.0)


@pytest.mark.parametrize("units", [1, 2])
def test_every_held_replica_pays_the_gradient_sum(tmp_path, units):
    """The runtime sums a weight piece's gradient over all its holders, a replicated op's
    included (its output's gradient may come in partial sums): one all-reduce over the
    replicas in the unit times the scale units."""
    from nnscaler_policy_autodist.model import CostModel

    graph = _linear_graph(64)
    op = graph.select(name="linear")[0]
    comm = CommModel(DEVICE_SPECS["cpu"])
    profiler = ComputeProfiler(DEVICE_SPECS["cpu"], tmp_path, measure=False)
    model = CostModel(profiler=profiler, comm=comm, units=units, zero=False)
    problem = model.build([op], 2, set())
    replicate = next(o for o in problem.options[0] if o.transform is None)
    weights = 4 * (64 * 64 + 64)  # weight and bias, fp32
    expected = sum(comm.allreduce_time(4 * n, 2 * units) for n in (64 * 64, 64))
    assert replicate.comm == pytest.approx(expected)
    assert replicate.comm > comm.allreduce_time(weights, units)  # not the units' sum alone


def test_a_split_whose_parts_talk_pays_their_collectives(tmp_path):
    """A cross-entropy split over its classes runs a collective part op: the statistics
    its parts exchange (an all_gather, and its reduce-scatter in backward) are charged."""
    from nnscaler_policy_autodist.model import CostModel

    from nnscaler.models import MLP, MLPConfig

    model = MLP(MLPConfig(d_in=16, d_hidden=32, n_classes=8, n_layers=2))
    batch = {"x": torch.randn(4, 16), "y": torch.randint(8, (4,))}
    graph = IRGraph.from_graph(trace(model, {"batch": batch}))
    op = next(o for o in graph.ops if "cross_entropy" in o.name)
    comm = CommModel(DEVICE_SPECS["cpu"])
    profiler = ComputeProfiler(DEVICE_SPECS["cpu"], tmp_path, measure=False)
    costs = CostModel(profiler=profiler, comm=comm, units=1, zero=False)
    talking = [t for t in costs.transforms(op, 2) if t is not None and t.part_op is not None]
    assert talking, "the cross-entropy has a class-parallel split"
    calls = profiler.collectives(op, talking[0], 2)
    assert [c.kind for c in calls] == ["all_gather"] and calls[0].backward
    expected = 2 * comm.allreduce_time(calls[0].nbytes * 2 / 2, 2, bucketed=False)
    assert costs.part_comm(op, talking[0], 2, True) == pytest.approx(expected)
    assert costs.part_comm(op, talking[0], 2, False) == pytest.approx(expected / 2)
    plain = [t for t in costs.transforms(op, 2) if t is not None and t.part_op is None]
    assert all(profiler.collectives(op, t, 2) == () for t in plain)


def test_the_expert_parallel_split_pays_its_token_exchanges(tmp_path):
    """An MoE layer split by its experts all-gathers its counts and exchanges its tokens
    both ways (all_to_all, forward and backward); autodist records them on meta tensors
    with an even routing and charges each exchange as an all-to-all of its bytes
    (`DeviceSpec.alltoall_time`), times ``expert_imbalance``."""
    from autodist_cases import TinyExperts
    from nnscaler_policy_autodist.model import CostModel

    from nnscaler.ops.builtin.moe import EXPERT_PARALLEL

    graph = IRGraph.from_graph(trace(TinyExperts(), {"x": torch.randn(8, 16)}))
    op = next(o for o in graph.ops if o.name.endswith("moe_experts"))
    comm = CommModel(DEVICE_SPECS["cpu"])
    profiler = ComputeProfiler(DEVICE_SPECS["cpu"], tmp_path, measure=False)
    costs = CostModel(profiler=profiler, comm=comm, units=1, zero=False)
    ep = next(t for t in costs.transforms(op, 2)
              if t is not None and t.part_op == EXPERT_PARALLEL)
    calls = profiler.collectives(op, ep, 2)
    assert [c.kind for c in calls] == ["all_gather", "all_to_all", "all_to_all"]
    tokens = 4 * 2 * 16 * 4  # 4 tokens of the part x top-2, 16 floats of 4 bytes
    assert [c.nbytes for c in calls[1:]] == [tokens, tokens] and calls[1].backward
    exchange = comm.spec.alltoall_time(tokens, 2)
    counts = comm.allreduce_time(calls[0].nbytes, 2, bucketed=False)
    assert costs.part_comm(op, ep, 2, True) == pytest.approx(counts + 4 * exchange)
    assert costs.part_comm(op, ep, 2, False) == pytest.approx(counts + 2 * exchange)
    skewed = CostModel(profiler=profiler, comm=comm, units=1, zero=False,
                       expert_imbalance=2.0)
    assert skewed.part_comm(op, ep, 2, True) == pytest.approx(
        counts + 4 * comm.spec.alltoall_time(2 * tokens, 2))


def test_the_optimizer_and_gradient_sum_run_once_a_step(tmp_path):
    """With micro-batches an op's forward and backward run for each, its weights' step and
    gradient all-reduce once: an option (per micro-batch) carries 1/m of them."""
    from nnscaler_policy_autodist.model import CostModel

    op = _linear_graph(64).select(name="linear")[0]
    comm = CommModel(DEVICE_SPECS["cpu"])
    profiler = ComputeProfiler(DEVICE_SPECS["cpu"], tmp_path, measure=False)
    one, four = (CostModel(profiler=profiler, comm=comm, units=2, zero=False,
                           micro_batches=m).build([op], 1, set()).options[0][0]
                 for m in (1, 4))
    fw, bw = profiler.time(op, None, 1)
    step = profiler.optimizer_time(4 * (64 * 64 + 64))
    sums = sum(comm.allreduce_time(4 * n, 2) for n in (64 * 64, 64))
    assert one.compute == pytest.approx(fw + bw + step, rel=1e-3)
    assert four.compute == pytest.approx(fw + bw + step / 4, rel=1e-3)
    assert one.comm == pytest.approx(sums) and four.comm == pytest.approx(sums / 4)
