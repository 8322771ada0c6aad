"""autodist's memory limit against the measured peak memory per rank.

On ``--world`` CPU processes (gloo), an MLP whose parameters dominate its memory (wide
linears, a small batch) is planned by ``autodist`` several times, in the same processes:

- ``dp``: ``plan_ngpus=1`` (pure data parallelism: every rank holds every weight, its
  gradient and Adam's two states), no limit: the reference the limits are taken from;
- ``none``: ``plan_ngpus=world``, no limit (autodist's fastest plan);
- ``excl-dp``: ``plan_ngpus=world`` with ``mem_constraint`` at ``--excl`` (default 0.8) of
  the ``dp`` estimate: pure data parallelism does not fit;
- ``tight``: the same at ``--tight`` (default 0.6) of it.

Each plan trains ``--steps`` steps of Adam (``build_optimizer``, ``train_step`` then
``optimizer.step()``) and every step's peak is measured with
:func:`nnscaler_policy_autodist.memory.measure_peak` (on CPU: the bytes of the tensors
held when the step starts plus the largest running sum of the profiler's allocation events
during it; see that module for what it sees). Printed per plan and rank: the limit,
autodist's estimate (bytes per device), the measured peak (the largest over the steps:
the first step also allocates Adam's state), the bytes of this rank's parameters, and
measured / estimate. Then one JSON line.

Usage::

    python bench/autodist/bench_memory.py [--world 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from _launch import launch  # noqa: E402
from nnscaler_policy_autodist.memory import measure_peak  # noqa: E402

MiB = 2**20
GB = 1024**3


def make_model() -> torch.nn.Module:
    """An MLP of 3.4 M parameters (13 MiB in float32): 256 -> 1024 -> 1024 -> 1024 -> 256."""
    from nnscaler.models import MLP, MLPConfig

    torch.manual_seed(0)
    return MLP(MLPConfig(d_in=256, d_hidden=1024, n_classes=256, n_layers=4))


def make_batch(n: int, seed: int) -> dict[str, torch.Tensor]:
    from nnscaler.models import MLPConfig
    from nnscaler.models.mlp import make_batch as mlp_batch

    return mlp_batch(MLPConfig(d_in=256, d_hidden=1024, n_classes=256, n_layers=4), n,
                     seed=seed)


def run_plan(rank: int, world: int, plan_ngpus: int, limit_gb: float | None, batch_size: int,
             steps: int, gen: str, profile_dir: str, name: str) -> dict[str, Any]:
    """Compile ``make_model()`` with autodist, train ``steps`` steps and measure each."""
    from nnscaler_policy_autodist import plan_graph

    from nnscaler import ComputeConfig, build_optimizer, parallelize

    captured: dict[str, Any] = {}

    def policy(graph, cfg):  # noqa: ANN001, ANN202 - autodist, keeping what it chose
        g, result = plan_graph(graph, cfg)
        captured["result"] = result
        return g

    pas: dict[str, Any] = {"profile_dir": profile_dir}
    if limit_gb is not None:
        pas["mem_constraint"] = limit_gb
    units = world // plan_ngpus
    batches = [make_batch(batch_size // units, seed=100 * s + rank // plan_ngpus)
               for s in range(steps)]
    cfg = ComputeConfig(plan_ngpus=plan_ngpus, runtime_ngpus=world, use_end2end=True,
                        pas_config=pas)
    pm = parallelize(make_model(), {"batch": batches[0]}, policy, cfg, gen_savedir=gen,
                     instance_name=name)
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-3)
    peaks = []
    for b in batches:

        def step(b: dict[str, torch.Tensor] = b) -> torch.Tensor:
            loss = pm.train_step([b])[0]
            opt.step()
            return loss

        _, m = measure_peak(step, pm, opt, b)
        peaks.append(attrs_dict(m))
    info: dict[str, Any] = {"peaks": peaks, "param_bytes": sum(
        p.numel() * p.element_size() for p in pm.parameters())}
    if "result" in captured:
        r = captured["result"]
        info["estimate"] = [s.mem for s in r.solutions]
        info["choices"] = sorted({p.options[i][c].describe()
                                  for p, sol in zip(r.problems, r.solutions)
                                  for i, c in enumerate(sol.choice)})
    return info


def attrs_dict(m: Any) -> dict[str, int]:
    return {"resident": m.resident, "peak": m.peak, "end": m.end, "after": m.after}


def _run(rank: int, world: int, plans: list[tuple[str, int, float | None]], batch_size: int,
         steps: int, gen: str, profile_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    out = {}
    for name, plan_ngpus, limit in plans:
        out[name] = run_plan(rank, world, plan_ngpus, limit, batch_size, steps, gen,
                             profile_dir, name)
        dist.barrier()
    return out


def dp_estimate(world: int, batch_size: int, profile_dir: str) -> tuple[float, int]:
    """autodist's estimate for pure data parallelism (``plan_ngpus=1``), in bytes per
    device, and the model's parameter bytes; planned in this process (no ranks needed)."""
    from types import SimpleNamespace

    from nnscaler_policy_autodist import plan_graph

    from nnscaler.graph import IRGraph
    from nnscaler.trace import trace

    model = make_model()
    traced = trace(model, {"batch": make_batch(batch_size // world, seed=0)})
    cfg = SimpleNamespace(plan_ngpus=1, runtime_ngpus=world, use_end2end=True,
                          pas_config={"profile_dir": profile_dir})
    _, result = plan_graph(IRGraph.from_graph(traced), cfg)
    return result.solutions[0].mem, sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="global batch per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--excl", type=float, default=0.8,
                    help="the limit excluding dp, as a fraction of dp's estimate")
    ap.add_argument("--tight", type=float, default=0.6,
                    help="a tighter limit, as a fraction of dp's estimate")
    ap.add_argument("--profile-dir", default=os.path.join(tempfile.gettempdir(),
                                                          "nnscaler-autodist-bench"))
    args = ap.parse_args()
    dp_mem, pbytes = dp_estimate(args.world, args.batch, args.profile_dir)
    plans = [("dp", 1, None), ("none", args.world, None),
             ("excl-dp", args.world, args.excl * dp_mem / GB),
             ("tight", args.world, args.tight * dp_mem / GB)]
    with tempfile.TemporaryDirectory() as gen:
        results = launch(_run, args.world, plans, args.batch, args.steps, gen, args.profile_dir)
    print(f"MLP 256-1024-1024-1024-256 ({pbytes / MiB:.2f} MiB of float32 parameters), Adam, "
          f"global batch {args.batch}, {args.world} CPU processes (gloo); autodist's estimate "
          f"for pure data parallelism: {dp_mem / MiB:.2f} MiB per rank (parameters x 4 = "
          f"{4 * pbytes / MiB:.2f} MiB)")
    print(f"{'plan':8} {'limit MiB':>10} {'estimate':>9} {'rank':>4} {'params':>8} "
          f"{'resident':>9} {'peak':>8} {'peak/est':>8} {'peak/limit':>10}  splits")
    rows = []
    for name, plan_ngpus, limit in plans:
        est = results[0][name]["estimate"][0]
        for rank, res in enumerate(results):
            r = res[name]
            peak = max(p["peak"] for p in r["peaks"])
            resident = max(p["resident"] for p in r["peaks"])
            lim = None if limit is None else limit * GB
            row = {"plan": name, "plan_ngpus": plan_ngpus, "rank": rank,
                   "limit_mib": None if lim is None else round(lim / MiB, 3),
                   "estimate_mib": round(est / MiB, 3), "peak_mib": round(peak / MiB, 3),
                   "resident_mib": round(resident / MiB, 3),
                   "param_mib": round(r["param_bytes"] / MiB, 3),
                   "peak_over_estimate": round(peak / est, 3),
                   "peak_over_limit": None if lim is None else round(peak / lim, 3),
                   "unaccounted": max(abs(p["end"] - p["after"]) for p in r["peaks"])}
            rows.append(row)
            print(f"{name:8} {'-' if lim is None else f'{lim / MiB:.2f}':>10} "
                  f"{est / MiB:9.2f} {rank:4} {r['param_bytes'] / MiB:8.2f} "
                  f"{resident / MiB:9.2f} {peak / MiB:8.2f} {peak / est:8.3f} "
                  f"{'-' if lim is None else f'{peak / lim:.3f}':>10}  "
                  f"{'; '.join(results[0][name]['choices'])}")
    print(json.dumps({"bench": "autodist_memory", "world": args.world, "batch": args.batch,
                      "dp_estimate_mib": round(dp_mem / MiB, 3),
                      "param_mib": round(pbytes / MiB, 3), "rows": rows}))


if __name__ == "__main__":
    main()
