"""``ComputeConfig(zero_stage='auto')``: autodist chooses the ZeRO stage.

On one process: every allowed stage is searched and the best estimate kept (a limit
that only the sharded stages meet picks one of them), the plan file records the stage
and replays it, and the choice combines with ``plan_ngpus='auto'``. On 2 processes: a
GPT whose weights and Adam's state dominate, under a limit that stage 1 cannot meet,
trains as one process does and its measured peak stays under the limit.
"""

from __future__ import annotations

import functools
import json
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from nnscaler_policy_autodist import plan_graph, report
from nnscaler_policy_autodist.memory import measure_peak
from nnscaler_policy_autodist.planfile import PlanFileError
from nnscaler_policy_autodist.spmd import NoPlanFits
from nnscaler_policy_autodist.zero import StageEstimate, rank_stages

from nnscaler.testing import run_distributed

MiB = 2**20
GB = 1024**3
#: weights (0.85 M parameters, 3.3 MiB, in pieces of at most 256 KiB) and Adam's state
#: dominate: activations are small
GPT = dict(vocab_size=512, n_layer=4, n_head=4, d_model=128, seq_len=8)
BATCH = 2
ADAM = {"lr": 1e-3, "eps": 1e-4}  # eps: see tests/parity_utils.py


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    """One profile cache for this module's plans (the same model every time)."""
    return str(tmp_path_factory.mktemp("zero") / "profile")


def _model() -> torch.nn.Module:
    from nnscaler.models import GPTConfig, GPTWithLoss

    torch.manual_seed(0)
    return GPTWithLoss(GPTConfig(**GPT))


def _batch(seed: int) -> dict[str, torch.Tensor]:
    from nnscaler.models import GPTConfig
    from nnscaler.models.gpt import make_batch

    return make_batch(GPTConfig(**GPT), BATCH, seed=seed)


def _plan(profile_dir: str, zero_stage: Any, plan_ngpus: Any = 1, runtime: int = 2, **pas):
    from nnscaler.graph import IRGraph
    from nnscaler.trace import trace

    traced = trace(_model(), {"batch": _batch(0)})
    cfg = SimpleNamespace(plan_ngpus=plan_ngpus, runtime_ngpus=runtime, use_end2end=True,
                          zero_stage=zero_stage, pas_config={"profile_dir": profile_dir, **pas})
    return plan_graph(IRGraph.from_graph(traced), cfg)


@functools.lru_cache
def _estimates(profile_dir: str) -> dict[int, float]:
    """autodist's memory estimate per device of pure data parallelism at each stage."""
    return {z: _plan(profile_dir, z)[1].solutions[0].mem for z in range(4)}


def test_rank_stages_by_time_then_memory_then_stage():
    a = StageEstimate(2, 1.0, 10.0)
    b = StageEstimate(3, 1.0, 8.0)
    c = StageEstimate(1, 1.0, 8.0)
    d = StageEstimate(0, None, 5.0)
    e = StageEstimate(3, 0.5, 20.0, replicas=1)
    assert rank_stages([a, b, c, d]) == [c, b, a, d]
    assert rank_stages([a, e, d])[0] == e


def test_auto_searches_every_stage_at_every_unit_size_and_keeps_the_best(profile_dir):
    """With ``plan_ngpus='auto'`` too: every unit size at every stage; the best stage's
    best mesh is the plan. (Costed for an H100, not profiled; no op split, which keeps
    the 8 searches fast: what is checked is how the two choices combine.)"""
    graph, result = _plan(profile_dir, "auto", plan_ngpus="auto", device_type="H100",
                          max_partition_degree=1)
    assert sorted(e.stage for e in result.zero_stages) == [0, 1, 2, 3]
    assert result.zero_stages[0].stage == result.zero_stage == graph.zero_stage
    assert result.zero_stages == tuple(rank_stages(result.zero_stages))
    best = result.zero_stages[0]
    assert best.unit == result.plan_ngpus and best.step_time == result.pipeline.step_time
    assert sorted(m.unit for m in result.meshes) == [1, 2]
    assert all(e.fits for e in result.zero_stages)


def test_a_limit_stage_1_cannot_meet_chooses_a_sharded_stage(profile_dir, tmp_path):
    est = _estimates(profile_dir)
    assert est[3] < est[2] < min(est[0], est[1])  # docs/zero.md's table, and transients
    limit = (est[2] + min(est[0], est[1])) / 2
    plan_file = tmp_path / "plan.json"
    graph, result = _plan(profile_dir, "auto", mem_constraint=limit / GB,
                          save_plan_path=str(plan_file))
    assert result.zero_stage in (2, 3) and graph.zero_stage == result.zero_stage
    assert result.solutions[0].mem <= limit
    assert {e.stage for e in result.zero_stages if not e.fits} == {0, 1}
    text = report.text(result)
    assert f"ZeRO stage {result.zero_stage} (counted in the memory and the step time, chosen " \
           f"by zero_stage='auto')" in text
    assert "ZeRO stage 1: no plan fits, needs" in text
    saved = json.loads(plan_file.read_text())
    assert saved["zero_stage"] == result.zero_stage
    assert [e["stage"] for e in saved["zero_stages_searched"]][0] == result.zero_stage
    # replayed under 'auto': the file's stage, without a search over the others
    _, again = _plan(profile_dir, "auto", load_plan_path=str(plan_file))
    assert again.zero_stage == result.zero_stage and again.zero_stages == ()
    with pytest.raises(NoPlanFits, match="no plan fits"):
        _plan(profile_dir, "auto", mem_constraint=0.5 * est[3] / GB)


def test_replaying_a_file_without_a_stage_under_auto_is_refused(profile_dir, tmp_path):
    plan_file = tmp_path / "plan.json"
    _plan(profile_dir, 0, save_plan_path=str(plan_file))
    data = json.loads(plan_file.read_text())
    del data["zero_stage"]
    plan_file.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="records no ZeRO stage"):
        _plan(profile_dir, "auto", load_plan_path=str(plan_file))


# -- on 2 processes ---------------------------------------------------------------------
def _train(rank: int, world: int, limit_gb: float, profile_dir: str, gen: str,
           steps: int = 3) -> dict[str, Any]:
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime.zero3 import gathered

    captured: dict[str, Any] = {}

    def policy(graph, cfg):  # noqa: ANN001, ANN202 - autodist, keeping what it chose
        g, result = plan_graph(graph, cfg)
        captured["result"] = result
        return g

    data = [[_batch(100 * s + u) for u in range(world)] for s in range(steps)]
    ref = _model()
    ref_opt = torch.optim.Adam(ref.parameters(), **ADAM)
    ref_losses = []
    for step in data:
        ref_opt.zero_grad()
        losses = []
        for b in step:
            loss = ref(b)
            loss.backward()
            losses.append(loss.item())
        ref_opt.step()
        ref_losses.append(losses)
    cfg = ComputeConfig(1, world, use_end2end=True, zero_stage="auto",
                        pas_config={"mem_constraint": limit_gb, "profile_dir": profile_dir})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(_model(), {"batch": data[0][0]}, policy, cfg, gen_savedir=gen)
    opt = build_optimizer(pm, torch.optim.Adam, cfg, **ADAM)
    peaks, losses = [], []
    for step in data:

        def one(b: dict[str, torch.Tensor] = step[rank]) -> torch.Tensor:
            loss = pm.train_step([b])[0]
            opt.step()
            return loss

        loss, m = measure_peak(one, pm, opt, step[rank])
        losses.append(float(loss))
        peaks.append(m)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([s[rank] for s in ref_losses]),
                               rtol=1e-5, atol=1e-6)
    state = {n: p.detach() for n, p in ref.named_parameters()}
    checked = 0
    with gathered(pm):
        for attr, meta in pm.fullmap.items():
            if meta.kind == "parameter":
                torch.testing.assert_close(getattr(pm, attr).detach(),
                                           meta.take(state[meta.orig_name]), rtol=1e-5,
                                           atol=1e-6, msg=lambda m, n=meta.orig_name: f"{n}: {m}")
                checked += 1
    out = {"checked": checked, "peaks": peaks, "stage": pm.reducers[0].stage}
    if "result" in captured:
        r = captured["result"]
        out.update(chosen=r.zero_stage, estimate=r.solutions[0].mem,
                   searched=[(e.stage, e.fits) for e in r.zero_stages])
    return out


def test_limit_stage_1_cannot_meet_trains_exactly_under_it_2_procs(profile_dir, tmp_path):
    """Halfway between the estimates of stages 3 and 2 (bench/README.md: on a larger GPT,
    stage 1's measured peak is over such a limit too)."""
    est = _estimates(profile_dir)
    limit = (est[3] + est[2]) / 2
    assert min(est[0], est[1], est[2]) > limit
    results = run_distributed(_train, 2, limit / GB, profile_dir, str(tmp_path / "gen"))
    chosen = results[0]["chosen"]
    assert chosen in (2, 3) and all(r["stage"] == chosen for r in results)
    assert results[0]["estimate"] <= limit
    report = "; ".join(
        f"rank {r}: stage {chosen}, peak {max(m.high for m in res['peaks']) / MiB:.2f} MiB "
        f"(low {max(m.low for m in res['peaks']) / MiB:.2f}), estimate "
        f"{results[0]['estimate'] / MiB:.2f} MiB, limit {limit / MiB:.2f} MiB"
        for r, res in enumerate(results))
    for res in results:
        assert res["checked"] > 0
        assert all(m.high <= limit for m in res["peaks"]), report
    print(report)
