"""autodist's sequence axis on CPU processes (gloo): what it chooses for a short and a long
sequence, its estimated step against the measured one, and its step against the
``sequence`` policy and ``dp`` timed in the same processes.

The model is the project's GPT (``--layers``, ``--d-model``, ``--heads``, vocabulary
256) on one sequence per scale unit, the long-context setting: ``autodist`` and
``sequence`` plan a unit of every process (``plan_ngpus = world``) and step one
sequence; ``dp`` runs ``world`` units of one process, each stepping a sequence of its
own, so it does ``world`` times the work per step: the table gives both its step and
its step per sequence (``dp / world``). Every mode trains with Adam through
``train_step``. autodist measures its own communication figures on the bench's process
group and its compute profile (``--profile-dir``); with ``--mem-frac f`` its memory
limit is ``f`` times what it estimates for the plan it makes without one (the limit
that makes a long sequence's activations bind).

Timing: the modes run step by step in the same processes (``time_modes``: alternating
order, behind a barrier); a mode's figure is the median over the timed steps of the
slowest rank's step. ``estimate / measured`` is autodist's estimated step over its
median; ``autodist / sequence`` and ``autodist / dp`` are medians of the per-iteration
ratios (the two ran back to back under the same load).

Usage::

    python bench/autodist/bench_sequence.py [--world 2] [--seqs 256 4096] [--mem-frac 0.8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from _launch import launch, slowest_steps, time_modes  # noqa: E402

SDPA = "torch.nn.functional.scaled_dot_product_attention"
CE = "torch.nn.functional.cross_entropy"


def _gpt(args: argparse.Namespace, seq: int) -> Any:
    from nnscaler.models import GPTConfig

    return GPTConfig(vocab_size=256, n_layer=args.layers, n_head=args.heads,
                     d_model=args.d_model, seq_len=seq)


def _chosen(result: Any) -> dict[str, Any]:
    """What autodist chose: attention's and the loss's options, and how many ops split
    the sequence (a strategy whose parts talk, or dim 1 of a (B, L, ...) tensor)."""
    attn, loss, along = [], [], 0
    total = 0
    for problem, sol in zip(result.problems, result.solutions):
        for i, op in enumerate(problem.ops):
            o = problem.options[i][sol.choice[i]]
            total += 1
            if op.name == SDPA:
                attn.append(o.describe())
            elif op.name == CE:
                loss.append(o.describe())
            if o.strategy is not None or (o.transform is not None and o.transform.dim == 1
                                          and o.transform.idx == 0 and op.name != SDPA):
                along += 1
    return {"attention": sorted(set(attn)), "loss": loss, "ops_split_along_seq": along,
            "ops": total}


def _mode(name: str, rank: int, world: int, seq: int, args: argparse.Namespace, gen: str,
          mem_limit: float | None) -> tuple[Any, dict[str, Any]]:
    from nnscaler_policy_autodist import plan_graph

    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.models import GPTWithLoss
    from nnscaler.models.gpt import make_batch

    cfg = _gpt(args, seq)
    plan = 1 if name == "dp" else world
    unit = rank // plan
    batch = make_batch(cfg, 1, seed=unit)
    pas: dict[str, Any] = {}
    policy: Any = name
    captured: dict[str, Any] = {}
    if name == "sequence":
        pas = {"attention": args.attention}
    elif name == "autodist":
        pas = {"profile_dir": args.profile_dir}
        if mem_limit is not None:
            pas["mem_constraint"] = mem_limit / 2**30

        def policy(graph: Any, config: Any) -> Any:  # autodist, keeping its result
            g, result = plan_graph(graph, config)
            captured["result"] = result
            return g

    torch.manual_seed(0)
    pm = parallelize(GPTWithLoss(cfg), {"batch": batch}, policy,
                     ComputeConfig(plan_ngpus=plan, runtime_ngpus=world, use_end2end=True,
                                   pas_config=pas),
                     gen_savedir=gen, instance_name=f"seq{seq}_{name}_{mem_limit}")
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-3)
    info: dict[str, Any] = {}
    if "result" in captured:
        r = captured["result"]
        info = {"estimate_ms": r.pipeline.step_time * 1e3,
                "estimate_mem_mib": max(s.mem for s in r.solutions) / 2**20,
                "search_s": r.search_seconds, **_chosen(r)}

    def step() -> torch.Tensor:
        loss = pm.train_step([batch])[0]
        opt.step()
        return loss

    return step, info


def _run(rank: int, world: int, seq: int, args: argparse.Namespace, gen: str,
         mem_limit: float | None) -> dict[str, Any]:
    from nnscaler_policy_autodist import measure_comm

    measure_comm(args.profile_dir)
    fns, infos = {}, {}
    for name in ("autodist", "sequence", "dp"):
        fns[name], infos[name] = _mode(name, rank, world, seq, args, gen, mem_limit)
    out = time_modes(fns, args.steps, args.warmup, args.seconds)
    out["infos"] = infos
    return out


def _estimate_only(world: int, seq: int, args: argparse.Namespace) -> float:
    """autodist's memory estimate per device for ``seq`` without a limit (planned on one
    process with the cached figures)."""
    from types import SimpleNamespace

    from nnscaler_policy_autodist import plan_graph

    from nnscaler.graph import IRGraph
    from nnscaler.models import GPTWithLoss
    from nnscaler.models.gpt import make_batch
    from nnscaler.trace import trace

    cfg = _gpt(args, seq)
    graph = IRGraph.from_graph(trace(GPTWithLoss(cfg), {"batch": make_batch(cfg, 1)}))
    config = SimpleNamespace(plan_ngpus=world, runtime_ngpus=world, use_end2end=True,
                             pas_config={"profile_dir": args.profile_dir})
    return max(s.mem for s in plan_graph(graph, config)[1].solutions)


def _case(world: int, seq: int, args: argparse.Namespace) -> dict[str, Any]:
    mem_limit = None
    if args.mem_frac is not None and seq == max(args.seqs):
        mem_limit = args.mem_frac * _estimate_only(world, seq, args)
    with tempfile.TemporaryDirectory() as gen:
        results = launch(_run, world, seq, args, gen, mem_limit)
    info = results[0]["infos"]["autodist"]
    steps = {m: slowest_steps(results, m) for m in ("autodist", "sequence", "dp")}
    med = {m: statistics.median(t) for m, t in steps.items()}

    def paired(other: str, scale: float = 1.0) -> float:
        return statistics.median(a / (b * scale) for a, b in zip(steps["autodist"], steps[other]))

    return {
        "world": world, "seq": seq, "mem_limit_mib": None if mem_limit is None
        else round(mem_limit / 2**20, 1), "chosen": {k: info[k] for k in (
            "attention", "loss", "ops_split_along_seq", "ops")},
        "estimate_ms": round(info["estimate_ms"], 1),
        "measured_ms": {m: round(v * 1e3, 1) for m, v in med.items()},
        "estimate_over_measured": round(info["estimate_ms"] / 1e3 / med["autodist"], 3),
        "autodist_over_sequence": round(paired("sequence"), 3),
        "autodist_over_dp": round(paired("dp"), 3),
        "autodist_over_dp_per_sequence": round(paired("dp", 1.0 / world), 3),
        "estimate_mem_mib": round(info["estimate_mem_mib"], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2])
    ap.add_argument("--seqs", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--attention", default="ring", help="the sequence policy's strategy")
    ap.add_argument("--mem-frac", type=float, default=None,
                    help="autodist's memory limit for the longest sequence, as a fraction "
                         "of its estimate without one")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--profile-dir", default=os.path.join(tempfile.gettempdir(),
                                                          "nnscaler-bench-sequence"))
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    rows = []
    for world in args.world:
        for seq in args.seqs:
            row = _case(world, seq, args)
            rows.append(row)
            c = row["chosen"]
            print(f"world {world}, {seq} tokens"
                  + (f", limit {row['mem_limit_mib']} MiB" if row["mem_limit_mib"] else "")
                  + f": autodist chose attention {c['attention']}, loss {c['loss']}, "
                  f"{c['ops_split_along_seq']}/{c['ops']} ops along the sequence")
            m = row["measured_ms"]
            print(f"  estimate {row['estimate_ms']} ms, measured {m['autodist']} ms "
                  f"(estimate/measured {row['estimate_over_measured']}); sequence "
                  f"{m['sequence']} ms, dp {m['dp']} ms ({world} sequences); autodist/sequence "
                  f"{row['autodist_over_sequence']}, autodist/dp {row['autodist_over_dp']} "
                  f"(per sequence {row['autodist_over_dp_per_sequence']})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
