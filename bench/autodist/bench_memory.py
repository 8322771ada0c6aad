"""autodist's memory limit against the measured peak memory per rank.

On ``--world`` CPU processes (gloo), a model whose parameters dominate its memory (an
MLP of wide linears, a 2-layer GPT with a large vocabulary; small batches) is planned by
``autodist`` several times, in the same processes:

- ``dp``: ``plan_ngpus=1`` (pure data parallelism: every rank holds every weight, its
  gradient and Adam's two states), no limit: the reference the limits are taken from;
- ``dp-zero``: the same with ``use_zero=True`` (Adam's state divided over the ranks);
- ``none``: ``plan_ngpus=world``, no limit (autodist's fastest plan);
- ``excl-dp``: ``plan_ngpus=world`` with ``mem_constraint`` at ``--excl`` (default 0.8) of
  the ``dp`` estimate: pure data parallelism does not fit;
- ``tight``: the same at ``--tight`` (default 0.6) of it;
- ``zero-auto``: ``plan_ngpus=1`` with ``zero_stage='auto'`` and a limit halfway between
  autodist's estimate at stage 2 and the smaller of stages 0 and 1 (stage 1 cannot meet
  it): autodist chooses the stage;
- ``zero-auto3``: the same, halfway between stage 3's estimate and stage 2's.

Each plan trains ``--steps`` steps of Adam (``build_optimizer``, ``train_step`` then
``optimizer.step()``) and every step's peak is measured with
:func:`nnscaler_policy_autodist.memory.measure_peak` (on CPU: the bytes of the tensors
held when the step starts plus the largest running sum of the profiler's allocation events
during it; see that module for what it sees). Printed per plan and rank: the limit,
autodist's estimate (bytes per device), the bytes of this rank's parameters, the bytes
resident between steps (after a step: weights, gradients, Adam's state), the measured peak
(the largest over the steps), measured / estimate, measured / limit and how many ops the
plan splits. Then one JSON line. A limit no plan fits is reported and not run.

The plans depend on the measured compute profile (``--profile-dir``): on a loaded machine
two runs may choose differently where options cost about the same. Memory figures do not
depend on load: the bytes a plan allocates are the same every run.

Usage::

    python bench/autodist/bench_memory.py [--world 2] [--models mlp gpt] [--steps 3]
        [--plans dp zero-auto ...]
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

import attrs  # noqa: E402
import torch  # noqa: E402
from _launch import launch  # noqa: E402
from nnscaler_policy_autodist.memory import measure_peak  # noqa: E402

MiB = 2**20
GB = 1024**3


@attrs.frozen
class Plan:
    """One compile: its name, ``plan_ngpus``, limit in bytes (None: none), ZeRO (``zero``:
    stage 1; ``zero_stage``, when given, a stage or ``'auto'``)."""

    name: str
    plan_ngpus: int
    limit: float | None = None
    zero: bool = False
    zero_stage: int | str | None = None

    def config_fields(self) -> dict[str, Any]:
        if self.zero_stage is None:
            return {"use_zero": self.zero}
        return {"zero_stage": self.zero_stage}


MODELS = {
    # name: (what, config); both are about 10 MiB of float32 parameters
    "mlp": ("MLP 256-1024-1024-1024-256", {"d_in": 256, "d_hidden": 1024, "n_classes": 256,
                                           "n_layers": 4}),
    "gpt": ("GPT 2 layers, d_model 256, vocab 4096, seq 32 (tied embedding)",
            {"vocab_size": 4096, "n_layer": 2, "n_head": 4, "d_model": 256, "seq_len": 32}),
    # 13 MiB of parameters in pieces of at most 1 MiB: the ZeRO stages' memory differs most
    "gpt4": ("GPT 4 layers, d_model 256, vocab 1024, seq 32 (tied embedding)",
             {"vocab_size": 1024, "n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 32}),
}


PLANS = ("dp", "dp-zero", "none", "excl-dp", "tight", "zero-auto", "zero-auto3")


def make_model(kind: str) -> torch.nn.Module:
    """The model of ``MODELS[kind]``, seeded."""
    from nnscaler.models import MLP, GPTConfig, GPTWithLoss, MLPConfig

    torch.manual_seed(0)
    if kind == "mlp":
        return MLP(MLPConfig(**MODELS[kind][1]))
    return GPTWithLoss(GPTConfig(**MODELS[kind][1]))  # gpt, gpt4


def make_batch(kind: str, n: int, seed: int) -> dict[str, torch.Tensor]:
    from nnscaler.models import GPTConfig, MLPConfig
    from nnscaler.models.gpt import make_batch as gpt_batch
    from nnscaler.models.mlp import make_batch as mlp_batch

    if kind == "mlp":
        return mlp_batch(MLPConfig(**MODELS[kind][1]), n, seed=seed)
    return gpt_batch(GPTConfig(**MODELS[kind][1]), n, seed=seed)


def run_plan(rank: int, world: int, kind: str, plan: Plan, batch_size: int, steps: int,
             gen: str, profile_dir: str) -> dict[str, Any]:
    """Compile ``make_model(kind)`` with autodist as ``plan`` says, train ``steps`` steps
    and measure each."""
    from nnscaler_policy_autodist import plan_graph

    from nnscaler import ComputeConfig, build_optimizer, parallelize

    captured: dict[str, Any] = {}

    def policy(graph, cfg):  # noqa: ANN001, ANN202 - autodist, keeping what it chose
        g, result = plan_graph(graph, cfg)
        captured["result"] = result
        return g

    pas: dict[str, Any] = {"profile_dir": profile_dir}
    if plan.limit is not None:
        pas["mem_constraint"] = plan.limit / GB
    units = world // plan.plan_ngpus
    batches = [make_batch(kind, batch_size // units, seed=100 * s + rank // plan.plan_ngpus)
               for s in range(steps)]
    cfg = ComputeConfig(plan_ngpus=plan.plan_ngpus, runtime_ngpus=world, use_end2end=True,
                        pas_config=pas, **plan.config_fields())
    pm = parallelize(make_model(kind), {"batch": batches[0]}, policy, cfg, gen_savedir=gen,
                     instance_name=f"{kind}_{plan.name.replace('-', '_')}")
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
        chosen = [p.options[i][c] for p, sol in zip(r.problems, r.solutions)
                  for i, c in enumerate(sol.choice)]
        info["split"] = f"{sum(o.transform is not None for o in chosen)}/{len(chosen)}"
        info["zero_stage"] = r.zero_stage
    return info


def attrs_dict(m: Any) -> dict[str, int]:
    return {"resident": m.resident, "peak": m.peak, "end": m.end, "after": m.after,
            "low": m.low}


def _run(rank: int, world: int, kind: str, plans: list[Plan], batch_size: int, steps: int,
         gen: str, profile_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    out = {}
    for plan in plans:
        out[plan.name] = run_plan(rank, world, kind, plan, batch_size, steps, gen, profile_dir)
        dist.barrier()
    return out


def estimate(kind: str, world: int, plan: Plan, batch_size: int, profile_dir: str) -> float:
    """autodist's estimate (bytes per device) for ``plan``, planned in this process (no
    ranks needed; the profile is shared with the ranks'). Raises ``NoPlanFits``."""
    from types import SimpleNamespace

    from nnscaler_policy_autodist import plan_graph

    from nnscaler.graph import IRGraph
    from nnscaler.trace import trace

    units = world // plan.plan_ngpus
    traced = trace(make_model(kind), {"batch": make_batch(kind, batch_size // units, seed=0)})
    pas: dict[str, Any] = {"profile_dir": profile_dir}
    if plan.limit is not None:
        pas["mem_constraint"] = plan.limit / GB
    cfg = SimpleNamespace(plan_ngpus=plan.plan_ngpus, runtime_ngpus=world, use_end2end=True,
                          pas_config=pas, **plan.config_fields())
    _, result = plan_graph(IRGraph.from_graph(traced), cfg)
    return result.solutions[0].mem


def _plans(kind: str, dp_mem: float, args: argparse.Namespace) -> list[Plan]:
    """The plans of ``--plans``; the zero-auto limits from autodist's estimate of pure data
    parallelism at each ZeRO stage."""
    plans = [Plan("dp", 1), Plan("dp-zero", 1, zero=True), Plan("none", args.world),
             Plan("excl-dp", args.world, args.excl * dp_mem),
             Plan("tight", args.world, args.tight * dp_mem)]
    if {"zero-auto", "zero-auto3"} & set(args.plans):
        est = [estimate(kind, args.world, Plan(f"s{z}", 1, zero_stage=z), args.batch,
                        args.profile_dir) for z in range(4)]
        plans += [Plan("zero-auto", 1, (est[2] + min(est[0], est[1])) / 2, zero_stage="auto"),
                  Plan("zero-auto3", 1, (est[3] + est[2]) / 2, zero_stage="auto")]
    return [p for p in plans if p.name in args.plans]


def bench_model(kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from nnscaler_policy_autodist import NoPlanFits

    pbytes = sum(p.numel() * p.element_size() for p in make_model(kind).parameters())
    dp_mem = estimate(kind, args.world, Plan("dp", 1), args.batch, args.profile_dir)
    plans = []
    for plan in _plans(kind, dp_mem, args):
        try:
            estimate(kind, args.world, plan, args.batch, args.profile_dir)
            plans.append(plan)
        except NoPlanFits as e:
            print(f"{kind} {plan.name}: no plan fits {plan.limit / MiB:.2f} MiB (autodist: "
                  f"at least {e.need / MiB:.2f} MiB needed): not run")
    with tempfile.TemporaryDirectory() as gen:
        results = launch(_run, args.world, kind, plans, args.batch, args.steps, gen,
                         args.profile_dir)
    print(f"{MODELS[kind][0]}: {pbytes / MiB:.2f} MiB of float32 parameters, Adam, global "
          f"batch {args.batch}, {args.world} CPU processes (gloo); autodist's estimate for "
          f"pure data parallelism {dp_mem / MiB:.2f} MiB per rank (parameters x 4 = "
          f"{4 * pbytes / MiB:.2f} MiB)")
    print(f"{'plan':8} {'limit MiB':>10} {'estimate':>9} {'rank':>4} {'params':>7} "
          f"{'resident':>9} {'peak':>7} {'peak/est':>8} {'peak/limit':>10} {'ops split':>9} "
          f"{'ZeRO':>4}")
    rows = []
    for plan in plans:
        est = results[0][plan.name]["estimate"][0]
        for rank, res in enumerate(results):
            r = res[plan.name]
            peak = max(p["peak"] for p in r["peaks"])
            low = max(p["low"] for p in r["peaks"])  # the true peak is in [low, peak]
            resident = r["peaks"][-1]["resident"]  # after a step: Adam's state exists
            lim = plan.limit
            row = {"model": kind, "plan": plan.name, "plan_ngpus": plan.plan_ngpus,
                   "zero": plan.zero, "rank": rank,
                   "limit_mib": None if lim is None else round(lim / MiB, 3),
                   "estimate_mib": round(est / MiB, 3), "peak_mib": round(peak / MiB, 3),
                   "peak_low_mib": round(low / MiB, 3),
                   "resident_mib": round(resident / MiB, 3),
                   "param_mib": round(r["param_bytes"] / MiB, 3),
                   "peak_over_estimate": round(peak / est, 3),
                   "peak_over_limit": None if lim is None else round(peak / lim, 3),
                   "unaccounted": max(abs(p["end"] - p["after"]) for p in r["peaks"]),
                   "ops_split": results[0][plan.name]["split"],
                   "zero_stage": results[0][plan.name]["zero_stage"]}
            rows.append(row)
            print(f"{plan.name:8} {'-' if lim is None else f'{lim / MiB:.2f}':>10} "
                  f"{est / MiB:9.2f} {rank:4} {r['param_bytes'] / MiB:7.2f} "
                  f"{resident / MiB:9.2f} {peak / MiB:7.2f} {peak / est:8.3f} "
                  f"{'-' if lim is None else f'{peak / lim:.3f}':>10} "
                  f"{results[0][plan.name]['split']:>9} {row['zero_stage']:>4}"
                  + (f"  (true peak >= {low / MiB:.2f}: a free out of the profiler's "
                     f"sight)" if low < peak - 64 * 1024 else ""))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=8, help="global batch per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    ap.add_argument("--excl", type=float, default=0.8,
                    help="the limit excluding dp, as a fraction of dp's estimate")
    ap.add_argument("--tight", type=float, default=0.6,
                    help="a tighter limit, as a fraction of dp's estimate")
    ap.add_argument("--profile-dir", default=os.path.join(tempfile.gettempdir(),
                                                          "nnscaler-autodist-bench"))
    args = ap.parse_args()
    rows = []
    for kind in args.models:
        rows += bench_model(kind, args)
    print(json.dumps({"bench": "autodist_memory", "world": args.world, "batch": args.batch,
                      "rows": rows}))


if __name__ == "__main__":
    main()
