"""Expert parallelism against the dense plan, on CPU processes (gloo, OMP_NUM_THREADS=1).

A language model of ``--layers`` MoE blocks (``--experts`` experts, top-2, a gated MLP of
``--ffn`` per expert, hidden ``--hidden``, a shared expert, a load-balancing loss; the
experts called through `moe_experts`) trains on ``--world`` processes in three modes, built
in the same processes and timed step by step, interleaved (``bench/_launch.py``):

- ``dense``: the ``dp`` policy, every expert on every rank, each rank its own samples;
- ``ep``: ``data`` with ``expert_parallel``: ``plan_ngpus = world``, each rank holds
  ``experts / world`` of every layer's experts and the same number of tokens as in
  ``dense`` (the unit's batch is ``world`` times a rank's);
- ``ep-skewed``: ``ep`` with a router biased so that every token's first choice is expert
  0 (its rank runs every token once, the others share the second choices);
- ``ffn-tp``: the ``megatron`` policy with ``tensor_model_parallel_size = world`` and no
  expert parallelism: every expert split by its intermediate units (each rank holds
  ``1 / world`` of ``gate_up``, its gate rows and its up rows, and of ``down``), every
  rank running the unit's tokens, the same batch as ``ep``;
- ``autodist`` (with ``--autodist``): the ``autodist`` policy on a unit of ``world``
  devices, the batch of ``ep``, with a memory limit (``--autodist-mem`` GB per device;
  default: halfway between what the experts need split over the unit and what they need
  whole, so that the replicated experts cannot meet it), ``expert_imbalance``
  ``--imbalance``; its estimated step (the plan file's) is printed against its measured
  step, with the expert degree it chose; with ``--autodist-experts`` its MoE ops may
  only be split by their experts (a constraints file), the rest of the plan its own:
  autodist's estimate of an expert-parallel plan against its measured step;
  ``--autodist-ffn`` the same with the ffn split (every expert's intermediate units).

Reported: the median step (a step as slow as its slowest rank) and its ratio to
``dense``; the bytes of expert weights per rank; the all-to-all's share of the ``ep``
step (the time inside the token exchanges, forward and backward, over the step, rank
mean); the busiest rank's token-expert pairs over the mean (``imbalance``). Prints a
table, then one JSON line. Usage::

    python bench/moe/bench_moe.py [--world 4] [--experts 8] [--steps 10]
        [--autodist [--optimizer adam]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))  # bench/_launch.py
from _launch import compare_modes, launch, time_modes  # noqa: E402

VOCAB, SEQ = 256, 64


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, skew: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.register_buffer("bias", torch.zeros(experts).index_fill(0, torch.tensor(0), skew))
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) / hidden**0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, ffn) / ffn**0.5)
        self.shared = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from nnscaler.ops.builtin.moe import moe_experts

        b, s, h = x.shape
        flat = self.norm(x).reshape(b * s, h)
        probs = (self.router(flat) + self.bias).softmax(-1)
        weights, index = probs.topk(2, dim=-1)
        routed = moe_experts(flat, index, weights / weights.sum(-1, keepdim=True),
                             self.gate_up, self.down)
        aux = (F.one_hot(index, probs.size(-1)).float().sum(1).mean(0) * probs.mean(0)).sum()
        return x + (routed + self.shared(flat)).reshape(b, s, h), aux


class MoELM(nn.Module):
    def __init__(self, layers: int, hidden: int, ffn: int, experts: int, skew: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(Block(hidden, ffn, experts, skew) for _ in range(layers))
        self.head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x, aux = self.embed(batch["ids"]), 0.0
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        return F.cross_entropy(self.head(x).flatten(0, 1), batch["ids"].flatten()) + 0.01 * aux


def _batch(samples: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, VOCAB, (samples, SEQ), generator=g)}


class A2ATimer:
    """Seconds spent in the token exchanges (`raw_all_to_all_uneven`), forward and backward."""

    def __init__(self) -> None:
        from nnscaler.runtime import collectives

        self.seconds, self.mod, self.raw = 0.0, collectives, collectives.raw_all_to_all_uneven

        def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return self.raw(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        collectives.raw_all_to_all_uneven = timed


def _autodist_limit(args: argparse.Namespace, world: int) -> float:
    """GB per device: halfway between the experts' bytes (parameter, gradient, Adam's two
    states) split over ``world`` and whole, plus the rest of the weights whole."""
    model = MoELM(args.layers, args.hidden, args.ffn, args.experts, 0.0)
    experts = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 3)
    rest = sum(p.numel() * 4 for p in model.parameters() if p.dim() != 3)
    return 4 * (rest + experts * (1 + 1 / world) / 2) / 2**30


def _autodist_config(args: argparse.Namespace, world: int, root: str) -> Any:
    from nnscaler import ComputeConfig

    limit = args.autodist_mem or _autodist_limit(args, world)
    pas = {"mem_constraint": limit, "expert_imbalance": args.imbalance,
           "profile_dir": f"{root}/profile", "save_plan_path": f"{root}/autodist-plan.json"}
    if args.autodist_experts or args.autodist_ffn:
        path = Path(root, f"experts-only.{os.getpid()}.yaml")
        split = "3,0" if args.autodist_experts else "3,2"
        path.write_text(f"- name: moe_experts\n  splits: ['{split}']\n")
        pas["partition_constraints_path"] = str(path)
    return ComputeConfig(world, world, use_end2end=True, pas_config=pas)


def _rank(rank: int, world: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.ops.builtin.moe import record_routing

    dims = (args.layers, args.hidden, args.ffn, args.experts)
    per_rank = args.samples
    modules, steps, info = {}, {}, {}
    modes = ("dense", "ep", "ep-skewed", "ffn-tp") + (("autodist",) if args.autodist else ())
    for mode in modes:
        model = MoELM(*dims, skew=100.0 if mode == "ep-skewed" else 0.0)
        if mode == "dense":
            cfg, policy, batch = ComputeConfig(1, world, use_end2end=True), "dp", \
                _batch(per_rank, rank)
        elif mode == "ffn-tp":
            from nnscaler_policy_megatron import megatron_compute_config

            cfg = megatron_compute_config(tensor_model_parallel_size=world, use_end2end=True)
            policy, batch = "megatron", _batch(per_rank * world, 0)
        elif mode == "autodist":
            cfg, policy = _autodist_config(args, world, root), "autodist"
            batch = _batch(per_rank * world, 0)
        else:
            cfg = ComputeConfig(world, world, use_end2end=True,
                                pas_config={"expert_parallel": True})
            policy, batch = "data", _batch(per_rank * world, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = parallelize(model, {"batch": batch}, policy, cfg, gen_savedir=root,
                             instance_name=mode)
        opt = (torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD)(
            pm.parameters_for_optimizer(), lr=1e-3)

        def step(pm: Any = pm, opt: Any = opt, batch: Any = batch) -> torch.Tensor:
            loss = pm.train_step([batch])[0]
            pm.sync_grad()
            opt.step()
            opt.zero_grad()
            return loss

        expert = sum(getattr(pm, a).numel() * 4 for a, m in pm.fullmap.items()  # 3-d stacks
                     if m.kind == "parameter" and len(m.model_shape or m.shape) == 3)
        with record_routing() as records:
            step()
        imbalance = statistics.mean(r.imbalance for r in records) if records else 1.0
        modules[mode], steps[mode] = pm, step
        info[mode] = {"expert_bytes": expert, "imbalance": imbalance}
    timed = time_modes(steps, args.steps, args.warmup)
    timer = A2ATimer()  # the share: ep steps alone, exchange time over step time
    total = 0.0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        steps["ep"]()
        total += time.perf_counter() - t0
    info["a2a_share"] = timer.seconds / total
    return {**timed, "info": info}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--samples", type=int, default=2, help="sequences of 64 tokens per rank")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--autodist", action="store_true", help="also autodist's plan")
    p.add_argument("--autodist-mem", type=float, default=None, help="its limit, GB/device")
    p.add_argument("--imbalance", type=float, default=1.0, help="its expert_imbalance")
    p.add_argument("--autodist-experts", action="store_true",
                   help="autodist's MoE ops split by their experts only")
    p.add_argument("--autodist-ffn", action="store_true",
                   help="autodist's MoE ops split by their intermediate units only")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="every mode's optimizer (autodist's estimate assumes Adam)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        results = launch(_rank, args.world, args, root)
        plan = (json.loads(Path(root, "autodist-plan.json").read_text())
                if args.autodist else None)
    table = compare_modes(results, "dense", args.steps, "step_ratio_to_dense")
    infos = [r["info"] for r in results]
    out: dict[str, Any] = {"world": args.world, "experts": args.experts, "modes": {}}
    print(f"{'mode':<10} {'step ms':>9} {'/ dense':>8} {'expert MiB/rank':>16} {'imbalance':>10}")
    for mode, row in table.items():
        mib = max(i[mode]["expert_bytes"] for i in infos) / 2**20
        imb = statistics.mean(i[mode]["imbalance"] for i in infos)
        out["modes"][mode] = {**row, "expert_mib_per_rank": round(mib, 3),
                              "imbalance": round(imb, 3)}
        print(f"{mode:<10} {row['median_ms']:>9.1f} {row['step_ratio_to_dense']:>8.3f} "
              f"{mib:>16.3f} {imb:>10.2f}")
    share = statistics.mean(i["a2a_share"] for i in infos)
    out["a2a_share_of_ep_step"] = round(share, 3)
    print(f"all-to-all share of the ep step: {share:.1%}")
    if plan is not None:
        estimate = plan["estimate"]["step_time_ms"]
        measured = table["autodist"]["median_ms"]
        splits = {json.dumps(o["split"]) for o in plan["ops"] if o["op"].endswith("moe_experts")}
        expert = any(s in ('{"idx": 3, "dim": 0}', '{"idx": 4, "dim": 0}') for s in splits)
        out["autodist"] = {"estimate_ms": round(estimate, 2), "measured_ms": round(measured, 2),
                           "estimate_over_measured": round(estimate / measured, 3),
                           "moe_splits": sorted(splits), "expert_parallel": expert,
                           "optimizer": args.optimizer}
        print(f"autodist: {'expert parallel' if expert else 'no expert split'} "
              f"(moe splits {sorted(splits)}); estimated {estimate:.1f} ms, measured "
              f"{measured:.1f} ms: estimate / measured {estimate / measured:.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
