"""ZeRO stage 3 under a pipeline (2 stages on 2 processes, 1F1B): what is gathered per
micro-batch, that each stage-3 unit's gradients are reduce-scattered once per step (in
the last micro-batch's backward), and `kept_gathered`, which gathers each unit once per
step instead. The 4-process parity run (pp x dp, 1F1B) is in test_pipeline_parity.py;
here pp x dp under GPipe, and pp x tp x dp under ``hybrid`` (8 processes:
NNSCALER_SLOW_TESTS=1)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from dist_utils import run_distributed
from pipeline_helpers import config, generate, micro_batches, plan, run_parity

from nnscaler.codegen import load_generated_class
from nnscaler.policies import hybrid, pp

NMICROS = 4


def _worker(rank: int, world: int, outdir: str, data: list) -> dict:
    from nnscaler.runtime import zero3
    from nnscaler.runtime.reducer import Reducer

    m = load_generated_class(outdir, rank)(init_params=True)
    launches: list[tuple[int, str]] = []
    gathers: list[str] = []
    most = [0]
    buckets = [b for r in m.reducers if r.stage == 3 for b in r.buckets]
    launch, gather = Reducer._launch_stage2, zero3.gather_unit

    def counting_launch(self, bucket, async_op):
        launches.append((self.stage, bucket.unit))
        launch(self, bucket, async_op)

    def counting_gather(reducer, bucket, async_op=False):
        if not bucket.gathered:
            gathers.append(bucket.unit)
        gather(reducer, bucket, async_op)
        most[0] = max(most[0], sum(b.gathered for b in buckets))

    Reducer._launch_stage2 = counting_launch
    zero3.gather_unit = counting_gather
    out = {"units": sorted(b.unit for b in buckets)}
    for mode in ("per_micro_batch", "kept"):
        launches.clear()
        gathers.clear()
        most[0] = 0
        if mode == "kept":
            with zero3.kept_gathered(m):
                m.train_step(data[0])
        else:
            m.train_step(data[0])
        m.sync_grad()
        assert not any(b.gathered for b in buckets)  # freed after the step
        out[mode] = {"launches": sorted(u for s, u in launches if s == 3),
                     "gathers": len(gathers), "most": most[0]}
    return out


def test_stage3_reduces_once_per_step_and_gathers_per_micro_batch(tmp_path):
    cfg = SimpleNamespace(plan_ngpus=2, runtime_ngpus=2, use_end2end=True, use_zero=True,
                          zero_stage=3, pas_config={"pipeline_nmicros": NMICROS,
                                                    "pipeline_scheduler": "1f1b"})
    outdir = generate(tmp_path, "gpt", plan("gpt", pp, cfg), cfg)
    head = (outdir / "gencode0.py").read_text().split('"""')[1]
    assert "ZeRO stage 3: this rank holds a shard of each parameter piece below" in head
    # the embedding tied to the last stage's head
    whole = head.split("Held whole, as in stage 2", 1)[1].split("\n\n", 1)[0]
    assert whole.split(":", 1)[1].split() == ["gpt_wte_weight", "(32,", "16)"]
    data = [micro_batches("gpt", 1, NMICROS)[0]]
    results = run_distributed(_worker, 2, str(outdir), data)
    for rank, res in enumerate(results):
        units = res["units"]
        blocks = [u for u in units if u]
        assert len(blocks) == 2, units  # each stage shards its own two blocks
        for mode in ("per_micro_batch", "kept"):
            assert res[mode]["launches"] == units, (rank, mode)  # once per step
        # every block: gathered in each forward and each backward of each micro-batch
        assert res["per_micro_batch"]["gathers"] == 2 * NMICROS * len(units)
        assert res["per_micro_batch"]["most"] <= 3
        assert res["kept"]["gathers"] == len(units)  # once per step
        assert res["kept"]["most"] == len(units)


def test_stage3_parity_interleaved_with_recompute(tmp_path):
    """1F1B interleaved (stages 0 and 2 on rank 0): each rank's units span two stages,
    and the tied embedding, held by both ranks, keeps stage 2's layout and is reduced
    once, after the schedule. Every block is recomputed too: its stage's backward
    gathers the unit again for the recomputation."""
    cfg = config(2, pipeline_nmicros=4, pipeline_scheduler="1f1b_interleaved")
    cfg.use_zero, cfg.zero_stage = True, 3
    graph = plan("gpt", pp, cfg)
    for i in range(4):
        graph.recompute(f"gpt.blocks.{i}")
    run_parity(tmp_path, "gpt", graph, cfg)
    src = (tmp_path / "gen" / "gencode0.py").read_text()
    assert src.count("torch.utils.checkpoint.checkpoint(") == 2  # blocks 0 and 2


def test_stage3_parity_under_gpipe_with_data_parallel(tmp_path):
    """GPipe (every forward, then every backward): pp 2 x dp 2 on 4 processes; each
    stage's units are sharded over its 2 replicas, freed between the forwards."""
    cfg = config(2, 4, pipeline_nmicros=4, pipeline_scheduler="gpipe")
    cfg.use_zero, cfg.zero_stage = True, 3
    run_parity(tmp_path, "gpt", plan("gpt", pp, cfg), cfg)


@pytest.mark.skipif(os.environ.get("NNSCALER_SLOW_TESTS") != "1",
                    reason="slow (8 processes): set NNSCALER_SLOW_TESTS=1")
def test_stage3_parity_under_hybrid_with_data_parallel(tmp_path):
    """hybrid: 2 stages x 2-way tensor parallel x 2 scale units (8 processes): each
    stage's pieces sharded over their 2 replicas; a piece both devices of a stage hold
    keeps stage 2's layout (docs/zero.md, With pipelines)."""
    cfg = config(4, 8, pipeline_nstages=2, pipeline_nmicros=4, pipeline_scheduler="1f1b")
    cfg.use_zero, cfg.zero_stage = True, 3
    results = run_parity(tmp_path, "gpt", plan("gpt", hybrid, cfg), cfg)
    assert any(meta.index != tuple((0, n) for n in meta.shape)
               for res in results for meta in res["fullmap"].values())  # tp pieces
