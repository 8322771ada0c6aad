"""autodist's all-to-all (the token exchange of expert parallelism): measured per group
size by `measure_comm`, read back by `device_spec`, priced by
`DeviceSpec.alltoall_time`; and the expert split's work profiled at the shapes one device
runs (`experts.expert_part`, with an even routing)."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from autodist_cases import TinyExperts
from hypothesis import given
from hypothesis import strategies as st
from nnscaler_policy_autodist import DEVICE_SPECS
from nnscaler_policy_autodist.comm import (
    A2A_SIZES,
    METHOD,
    alltoall_groups,
    comm_measured,
    device_spec,
    even_splits,
    interpolate,
)
from nnscaler_policy_autodist.experts import MOE_EXPERTS, expert_part, expert_split
from nnscaler_policy_autodist.profile import VALUE_MAKERS, ComputeProfiler

from nnscaler.graph import IRGraph
from nnscaler.ops.builtin.moe import EXPERT_PARALLEL, FFN_PARALLEL
from nnscaler.trace import trace

SPECS = [DEVICE_SPECS[name] for name in ("H100", "A100", "cpu")]


def test_the_group_sizes_measured_divide_the_world():
    assert alltoall_groups(1) == []
    assert alltoall_groups(2) == [2]
    assert alltoall_groups(4) == [2, 4]
    assert alltoall_groups(6) == [2, 6]
    assert alltoall_groups(8) == [2, 4, 8]


@given(st.integers(0, 10_000), st.integers(1, 16))
def test_even_splits_deal_every_row(rows, g):
    out = even_splits(rows, g)
    assert len(out) == g and sum(out) == rows and max(out) - min(out) <= 1


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@given(nbytes=st.floats(1.0, 1e10), g=st.integers(2, 64), more=st.floats(1.0, 8.0))
def test_an_alltoall_costs_more_for_more_bytes_and_nothing_alone(spec, nbytes, g, more):
    assert spec.alltoall_time(nbytes, 1) == 0.0 and spec.alltoall_time(0.0, g) == 0.0
    cross = g > spec.per_node
    local = min(g, spec.per_node)
    once = spec.alltoall_time(nbytes, g, cross=cross, local=local)
    assert 0 < once <= spec.alltoall_time(nbytes * more, g, cross=cross, local=local)


def test_named_devices_move_the_bytes_that_leave_each_device_at_the_bus_bandwidth():
    h100 = DEVICE_SPECS["H100"]
    s = 2.0**30
    # 7/8 of a rank's gigabyte leaves it, at the NVLink bus bandwidth
    assert h100.alltoall_time(s, 8) == pytest.approx(7 * 1.5e-6 + s * 7 / 8 / 460e9)
    # across 2 nodes of 8: half of it goes through the network card, the rest inside at
    # the same time; the card is the slower
    assert h100.alltoall_time(s, 16, cross=True, local=8) == pytest.approx(
        15 * 5e-6 + s * 8 / 16 / 45e9)
    assert h100.alltoall_time(s, 16, cross=True, local=8) > h100.alltoall_time(s, 8)


def test_a_measured_curve_is_read_for_its_group_size_and_scaled_for_another():
    curve2 = ((4096.0, 1e-4), (2.0**20, 1e-3))
    curve4 = ((4096.0, 3e-4), (2.0**20, 4e-3))
    spec = attrs.evolve(DEVICE_SPECS["cpu"], alltoall_curves=((2, curve2), (4, curve4)))
    assert spec.alltoall_time(2.0**20, 2) == pytest.approx(1e-3)
    assert spec.alltoall_time(2.0**20, 4) == pytest.approx(4e-3)
    assert spec.alltoall_time(100, 4) == pytest.approx(3e-4)  # below the first point
    assert spec.alltoall_time(2.0**19 + 2048, 2) == pytest.approx(interpolate(curve2, 2**19 + 2048))
    assert spec.alltoall_time(2.0**20, 8) == pytest.approx(4e-3 * 7 / 3)  # hops from 4
    assert spec.alltoall_time(2.0**20, 3) == pytest.approx(4e-3 * 2 / 3)  # nearest, larger
    # across nodes the measured curves (one node's) do not apply
    assert spec.alltoall_time(2.0**20, 4, cross=True, local=2) != pytest.approx(4e-3)


def test_a_cache_measured_before_the_alltoall_is_measured_again_and_read_meanwhile(tmp_path):
    old = {"lat": 1e-4, "bw": 1e9, "group": 2, "points": [[4096, 1e-4], [2**20, 1e-3]],
           "method": METHOD - 1}
    (tmp_path / "comm-cpu-g2.json").write_text(json.dumps(old))
    assert not comm_measured(tmp_path, 2)  # autodist measures it again
    spec = device_spec("cpu", tmp_path, 2)
    assert spec.alltoall_curves == () and spec.allreduce_curve  # the formula meanwhile
    plain = {**old, "method": METHOD, "alltoall": {}}  # measured for a model without MoE
    (tmp_path / "comm-cpu-g2.json").write_text(json.dumps(plain))
    assert comm_measured(tmp_path, 2) and not comm_measured(tmp_path, 2, alltoall=True)
    new = {**old, "method": METHOD, "alltoall": {"2": [[4096, 2e-4], [2**20, 3e-3]]}}
    (tmp_path / "comm-cpu-g2.json").write_text(json.dumps(new))
    assert comm_measured(tmp_path, 2, alltoall=True)
    spec = device_spec("cpu", tmp_path, 2)
    assert spec.alltoall_curves == ((2, ((4096.0, 2e-4), (2.0**20, 3e-3))),)
    assert spec.alltoall_time(2.0**20, 2) == pytest.approx(3e-3)


def _measure(rank, world, profile_dir):
    from nnscaler_policy_autodist import measure_comm

    return measure_comm(profile_dir, sizes=(1 << 12, 1 << 16), a2a_sizes=(1 << 12, 1 << 18),
                        repeat=2, syncs=2, segment=2)


def test_the_alltoall_is_measured_through_the_runtime_and_cached(tmp_path):
    from nnscaler.testing import run_distributed

    figures = run_distributed(_measure, 2, str(tmp_path))[0]
    times = [t for _, t in figures["alltoall"]["2"]]
    assert [b for b, _ in figures["alltoall"]["2"]] == [1 << 12, 1 << 18]
    assert all(t > 0 for t in times) and times == sorted(times)
    spec = device_spec("cpu", tmp_path, 2)
    assert [g for g, _ in spec.alltoall_curves] == [2]
    assert spec.alltoall_time(1 << 18, 2) == pytest.approx(times[-1])
    assert len(A2A_SIZES) >= 4  # the default measures a range of sizes


def _moe_op():
    graph = IRGraph.from_graph(trace(TinyExperts(), {"x": torch.randn(8, 16)}))
    return next(o for o in graph.ops if o.name.endswith("moe_experts"))


def test_an_expert_part_is_profiled_as_its_own_experts_on_its_own_tokens(tmp_path, monkeypatch):
    """The expert split's parts talk, so they cannot run alone; the op itself on one
    part's tokens and experts, routed evenly, runs what a device runs (not the whole op's
    time over the parts, which divides its fixed costs too)."""
    from nnscaler_policy_autodist import profile
    from nnscaler_policy_autodist.model import CostModel

    op = _moe_op()
    profiler = ComputeProfiler(DEVICE_SPECS["cpu"], tmp_path, measure=True)
    costs = CostModel(profiler=profiler, comm=None, units=1, zero=False)
    options = [t for t in costs.transforms(op, 2) if t is not None]
    ep = next(t for t in options if t.part_op == EXPERT_PARALLEL)
    inputs, kwargs = expert_part(op, ep, 2)
    assert [tuple(b - a for a, b in x.indmap) for x in inputs] == [
        (4, 16), (4, 2), (4, 2), (2, 2, 24, 16), (2, 16, 24)]  # gate_up as its view
    assert "expert_counts" not in kwargs and "group" not in kwargs
    assert all(expert_part(op, t, 2) is None for t in options if not expert_split(t))
    jobs = []
    monkeypatch.setattr(profile, "run_job", lambda job: jobs.append(job) or (1e-3, 2e-3))
    assert profiler.time(op, ep, 2) == pytest.approx((1e-3, 2e-3))
    assert [j.op for j in jobs] == [MOE_EXPERTS]
    assert [a.shape for a in jobs[0].args[:5]] == [(4, 16), (4, 2), (4, 2), (2, 2, 24, 16),
                                                    (2, 16, 24)]


def test_moe_ops_are_profiled_with_an_even_routing():
    make = VALUE_MAKERS[MOE_EXPERTS]
    assert VALUE_MAKERS[FFN_PARALLEL] is make
    hidden, index = torch.randn(6, 16), torch.zeros(6, 2, dtype=torch.long)
    args, _ = make([hidden, index, torch.rand(6, 2), torch.randn(4, 48, 16),
                    torch.randn(4, 16, 24)], {})
    assert args[1].dtype == torch.long and args[1].shape == (6, 2)
    assert torch.bincount(args[1].reshape(-1), minlength=4).tolist() == [3, 3, 3, 3]
    # the ffn split's part takes gate_up as [E, 2, F/n, H]: its experts are still dim 0
    args, _ = make([hidden, index, torch.rand(6, 2), torch.randn(3, 2, 12, 16),
                    torch.randn(3, 16, 12)], {})
    assert torch.bincount(args[1].reshape(-1), minlength=3).tolist() == [4, 4, 4]
