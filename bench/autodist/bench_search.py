"""Search time of ``autodist``: a GPT (d_model 256, 8 heads, seq 128, vocab 1024, batch 8)
on 8 devices, ``pipeline_nstages='auto'`` with 4 micro-batches, for 8, 16, 32 and 64
layers; the policy alone (``plan_graph`` on the traced graph), after one run that fills
the profile cache (so the timed runs profile nothing), solver ``auto`` and ``ilp``.
Goal: 32 layers under 30 s; growth about linear in the layers.

Usage::

    python bench/autodist/bench_search.py [--layers 8 16 32 64] [--ngpus 8]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from nnscaler_policy_autodist import plan_graph  # noqa: E402

from nnscaler.graph import IRGraph  # noqa: E402
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch  # noqa: E402
from nnscaler.trace import trace  # noqa: E402

TARGET_S = 30.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--ngpus", type=int, default=8)
    ap.add_argument("--solvers", nargs="+", default=["auto", "ilp"])
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as profile_dir:
        for layers in args.layers:
            cfg = GPTConfig(vocab_size=1024, n_layer=layers, n_head=8, d_model=256,
                            seq_len=128)
            with torch.device("meta"):
                model = GPTWithLoss(cfg)
            traced = trace(model, {"batch": make_batch(cfg, 8)}, strategy="meta")
            for solver in args.solvers:
                conf = SimpleNamespace(
                    plan_ngpus=args.ngpus, runtime_ngpus=args.ngpus, use_end2end=True,
                    pas_config={"profile_dir": profile_dir, "pipeline_nstages": "auto",
                                "pipeline_nmicros": 4, "solver": solver})
                plan_graph(IRGraph.from_graph(traced), conf)  # fills the profile cache
                t0 = time.perf_counter()
                _, result = plan_graph(IRGraph.from_graph(traced), conf)
                seconds = time.perf_counter() - t0
                rows.append({"layers": layers, "ops": len(traced.ops), "solver": solver,
                             "search_s": round(seconds, 2), "profiled": result.profiled,
                             "stages": result.pipeline.nstages, "k": result.pipeline.k,
                             "estimate_ms": round(result.pipeline.step_time * 1e3, 2)})
                print(f"{layers:3d} layers ({len(traced.ops)} ops), solver {solver}: "
                      f"{seconds:6.2f} s ({seconds / layers * 1e3:.0f} ms/layer), "
                      f"{result.profiled} profiled; plan {result.pipeline.nstages} stage(s) x "
                      f"{result.pipeline.k}, estimate {result.pipeline.step_time * 1e3:.1f} ms")
    at32 = [r["search_s"] for r in rows if r["layers"] == 32]
    if at32:
        print(f"32 layers on {args.ngpus} devices: {max(at32):.2f} s (goal < {TARGET_S} s): "
              f"{'ok' if max(at32) < TARGET_S else 'MISSED'}")
    print(json.dumps({"bench": "autodist_search", "ngpus": args.ngpus, "rows": rows}))


if __name__ == "__main__":
    main()
