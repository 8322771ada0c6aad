"""The memory limit holds: autodist's plan under a limit that pure data parallelism
exceeds fits, by its estimate and by the peak memory measured on every rank; and the
measurement itself (`nnscaler_policy_autodist.memory`) is right on steps whose peak
is computed by hand."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from nnscaler_policy_autodist.memory import MeasureError, measure_peak, tensor_bytes
from nnscaler_policy_autodist.spmd import NoPlanFits

from nnscaler.testing import run_distributed

MiB = 2**20
GB = 1024**3


# -- the measurement, on one process ----------------------------------------------------
def test_measure_synthetic_allocations():
    """Known allocations and frees: the peak is the resident bytes plus the largest
    running sum; a free of a resident tensor lowers what is held."""
    held = [torch.empty(MiB, dtype=torch.uint8)]

    def step():
        a = torch.empty(2 * MiB, dtype=torch.uint8)
        b = torch.empty(3 * MiB, dtype=torch.uint8)
        del a
        c = torch.empty(MiB, dtype=torch.uint8)
        return b, c

    out, m = measure_peak(step, held)
    assert (m.resident, m.peak, m.end, m.after) == (MiB, 6 * MiB, 5 * MiB, 5 * MiB)
    assert m.low == m.peak == m.high
    del out

    def swap():  # frees a resident MiB before allocating one: the peak stays at 2 MiB
        held.pop()
        held.append(torch.empty(MiB, dtype=torch.uint8))
        return torch.empty(MiB, dtype=torch.uint8)

    held[:] = measure_peak(lambda: [torch.empty(MiB, dtype=torch.uint8)])[0]
    _, m = measure_peak(swap, held)  # the resident MiB was made under a profile: its free
    assert (m.resident, m.peak, m.end, m.unaccounted) == (MiB, 2 * MiB, 2 * MiB, 0)

    def elsewhere():  # a thread without the profiler's thread-local state is not seen
        t = threading.Thread(target=lambda: torch.empty(MiB, dtype=torch.uint8))
        t.start()
        t.join()

    _, m = measure_peak(elsewhere, held)
    assert m.peak == m.resident


def test_measure_other_devices_refused():
    with pytest.raises(MeasureError, match="device=meta"):
        measure_peak(lambda: None, device="meta")


def test_tensor_bytes_counts_each_storage_once():
    flat = torch.zeros(1000)
    p = torch.nn.Parameter(torch.zeros(10, 10))
    p.grad = flat[:100].view(10, 10)  # a view of a flat buffer counts the buffer
    q = torch.nn.Parameter(torch.zeros(5))
    q.grad = flat[100:105]
    opt = torch.optim.SGD([p, q], lr=0.1, momentum=0.9)
    for t in (p, q):
        opt.state[t]["momentum_buffer"] = torch.zeros_like(t)
    assert tensor_bytes(p, q) == 4 * (100 + 5 + 1000)
    assert tensor_bytes(opt, p, [p, {"again": q}]) == 4 * (100 + 5 + 1000 + 100 + 5)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_measure_training_step_by_hand(optimizer):
    """A 512x512 weight (P = 1 MiB) trained on a batch of 4: the peaks computed by hand.

    - SGD, first step: the weight, the batch and the new gradient: 2P;
    - SGD, later steps: the kept gradient plus the one backward makes before adding it
      in: 3P;
    - Adam (single-tensor, CPU's default): weight, gradient and the two states (4P) plus
      two temporaries of its step, ``sqrt(v)`` and ``sqrt(v) / bias_correction``: 6P, the
      first step too (its states are made before the temporaries).

    Activations (a few 8 KiB tensors) and scalars are the slack allowed."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 512, bias=False)
    opt = (torch.optim.SGD(lin.parameters(), lr=0.1) if optimizer == "sgd"
           else torch.optim.Adam(lin.parameters(), foreach=False))
    x = torch.randn(4, 512)
    P, X, act = MiB, x.nbytes, x.nbytes

    def step():
        opt.zero_grad(set_to_none=False)
        loss = lin(x).square().sum()
        loss.backward()
        opt.step()
        return loss.detach()

    want = [(P + X, 2 * P + X), (2 * P + X, 3 * P + X)] if optimizer == "sgd" else \
        [(P + X, 6 * P + X), (4 * P + X, 6 * P + X)]
    for s, (resident, peak) in enumerate(want + want[1:]):
        _, m = measure_peak(step, lin, opt, x)
        assert m.resident == resident + (4 if s and optimizer == "adam" else 0), (s, m)
        assert peak <= m.peak <= peak + 4 * act + 64, (s, m, (m.peak - peak) / act)
        assert m.unaccounted == 0, m


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_cuda_step_by_hand():
    lin = torch.nn.Linear(512, 512, bias=False).cuda()
    opt = torch.optim.Adam(lin.parameters(), foreach=False)
    x = torch.randn(4, 512, device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        lin(x).square().sum().backward()
        opt.step()

    step()
    _, m = measure_peak(step, lin, opt, x)
    assert m.device.startswith("cuda") and m.resident >= 4 * MiB
    assert 6 * MiB <= m.peak <= 6 * MiB + 2 * MiB  # the allocator rounds up to 512 B blocks


def _all_gather(rank: int, world: int) -> tuple[int, int]:
    import torch.distributed as dist

    x = torch.ones(1000)
    outs = [torch.empty(1000) for _ in range(world)]
    _, m = measure_peak(lambda: dist.all_gather(outs, x), x, outs)
    return m.peak - m.resident, m.unaccounted


def test_measure_sees_gloo_worker_allocations_2_procs():
    """gloo stages a list all-gather in one flat buffer (world x input) that its worker
    thread allocates and frees: the measurement sees it."""
    assert run_distributed(_all_gather, 2) == [(2 * 1000 * 4, 0)] * 2


# -- the limit, on 2 processes ----------------------------------------------------------
CONFIG = dict(d_in=256, d_hidden=1024, n_classes=256, n_layers=4)  # 10 MiB of weights
BATCH = 8


def _model() -> torch.nn.Module:
    from nnscaler.models import MLP, MLPConfig

    torch.manual_seed(0)
    return MLP(MLPConfig(**CONFIG))


def _batch(seed: int) -> dict[str, torch.Tensor]:
    from nnscaler.models import MLPConfig
    from nnscaler.models.mlp import make_batch

    return make_batch(MLPConfig(**CONFIG), BATCH, seed=seed)


def _train(rank: int, world: int, limit_gb: float, profile_dir: str, gen: str,
           plan_ngpus: int = 2, zero: bool = False) -> dict[str, Any]:
    from nnscaler_policy_autodist import plan_graph

    from nnscaler import ComputeConfig, build_optimizer, parallelize

    captured: dict[str, Any] = {}

    def policy(graph, cfg):  # noqa: ANN001, ANN202 - autodist, keeping what it chose
        g, result = plan_graph(graph, cfg)
        captured["result"] = result
        return g

    cfg = ComputeConfig(plan_ngpus=plan_ngpus, runtime_ngpus=world, use_end2end=True,
                        use_zero=zero,
                        pas_config={"mem_constraint": limit_gb, "profile_dir": profile_dir})
    batches = [_batch(seed) for seed in range(3)]
    try:
        pm = parallelize(_model(), {"batch": batches[0]}, policy, cfg, gen_savedir=gen)
    except NoPlanFits as e:  # on every rank: rank 0's planning error is shared
        return {"refused": str(e), "need": e.need}
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-3)
    steps = []
    for b in batches:  # the first step also makes Adam's state

        def step(b: dict[str, torch.Tensor] = b) -> torch.Tensor:
            loss = pm.train_step([b])[0]
            opt.step()
            return loss

        _, m = measure_peak(step, pm, opt, b)
        steps.append(m)
    out: dict[str, Any] = {"steps": steps,
                           "params": sum(p.numel() * p.element_size() for p in pm.parameters())}
    if "result" in captured:
        r = captured["result"]
        out["estimate"] = [s.mem for s in r.solutions]
        out["split"] = sum(p.options[i][c].transform is not None
                           for p, sol in zip(r.problems, r.solutions)
                           for i, c in enumerate(sol.choice))
    return out


def _dp_estimate(profile_dir: str, zero: bool = False) -> float:
    """autodist's own estimate for pure data parallelism on 2 ranks (plan_ngpus=1)."""
    from nnscaler_policy_autodist import plan_graph

    from nnscaler.graph import IRGraph
    from nnscaler.trace import trace

    traced = trace(_model(), {"batch": _batch(0)})
    cfg = SimpleNamespace(plan_ngpus=1, runtime_ngpus=2, use_end2end=True, use_zero=zero,
                          pas_config={"profile_dir": profile_dir})
    return plan_graph(IRGraph.from_graph(traced), cfg)[1].solutions[0].mem


def test_limit_excluding_dp_holds_measured_2_procs(profile_dir, tmp_path):
    weights = sum(p.numel() * p.element_size() for p in _model().parameters())
    dp = _dp_estimate(profile_dir)
    assert dp >= 4 * weights  # weights, gradients, Adam's two states on every rank
    limit = 0.8 * dp
    results = run_distributed(_train, 2, limit / GB, profile_dir, str(tmp_path / "gen"))
    est = results[0]["estimate"][0]
    report = _report(results, est, limit)
    assert est <= limit, report
    assert results[0]["split"] > 0, report  # autodist split ops: not replication
    for res in results:
        # not pure data parallelism: the plan splits weights, each rank holds part of them
        assert res["params"] < 0.75 * weights, report
        for m in res["steps"]:
            assert m.high <= limit, report
            assert abs(m.unaccounted) <= 0.01 * m.resident, (m, report)
        # what stays between steps (weights, gradients, Adam's state) is in the estimate;
        # the rest of the peak is the step's transients (see docs: "Memory: estimate and
        # measurement")
        assert res["steps"][-1].resident <= est, report
    print(report)


def _report(results: list[dict[str, Any]], est: float, limit: float) -> str:
    return "; ".join(
        f"rank {r}: measured peak {max(m.peak for m in res['steps']) / MiB:.2f} MiB "
        f"(resident {res['steps'][-1].resident / MiB:.2f} MiB) vs estimate {est / MiB:.2f} "
        f"MiB = {max(m.peak for m in res['steps']) / est:.3f}x, limit {limit / MiB:.2f} MiB"
        for r, res in enumerate(results))


@pytest.mark.parametrize("case", ["tight", "zero"])
def test_tighter_limits_are_met_or_refused_2_procs(case, profile_dir, tmp_path):
    """Limits near what a plan holds at rest: the step's transients (Adam's temporaries,
    up to 3 buffers the size of the largest weight piece on a CPU; under ZeRO on gloo the
    reduce-scatter's copy of the gradient) decide. autodist either plans something whose
    measured peak is under the limit or says no plan fits (and how much one needs)."""
    if case == "tight":  # the MLP on 2 devices; without the transients: measured 1.08x
        limit, plan_ngpus, zero = 0.6 * _dp_estimate(profile_dir), 2, False
    else:  # pure data parallelism with ZeRO; without the transients: measured 1.19x
        limit, plan_ngpus, zero = 1.05 * _dp_estimate(profile_dir, zero=True), 1, True
    results = run_distributed(_train, 2, limit / GB, profile_dir, str(tmp_path / "gen"),
                              plan_ngpus, zero)
    if "refused" in results[0]:
        assert all("no plan fits" in r["refused"] for r in results)
        assert results[0]["need"] > limit
        return
    est = results[0]["estimate"][0]
    report = _report(results, est, limit)
    assert est <= limit, report
    assert all(m.low <= limit for res in results for m in res["steps"]), report
