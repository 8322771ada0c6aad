"""Step time of nnscaler's ``pp`` policy (1f1b) vs ``torch.distributed.pipelining``'s
``Schedule1F1B``, and each rank's measured idle time vs the simulator's bubble.

Runs 2 CPU processes (gloo, one thread each) training the same ``GPTWithLoss`` (4 blocks,
d_model 256, 4 heads, seq 128, vocab 1024) on 4 micro-batches of ``--micro`` sequences
per step, with Adam, in each mode in turn in the same processes (steps interleave, so
load drifts on the machine hit both modes alike):

- ``nnscaler``: ``parallelize(model, ..., 'pp', ComputeConfig(plan_ngpus=2,
  runtime_ngpus=2, use_end2end=True, pas_config={'pipeline_nmicros': 4,
  'pipeline_scheduler': '1f1b'}))`` + ``build_optimizer``; a step is
  ``pm.train_step(micro_batches)`` and ``opt.step()`` (which sums the tied embedding's
  gradient over both stages);
- ``torch``: the model split by hand at the same block as the ``pp`` policy's cut, as two
  ``PipelineStage`` modules (the LM head on stage 1 holds its own copy of the tied
  embedding), ``Schedule1F1B(stage, 4, loss_fn, scale_grads=False)`` (gradients summed
  over micro-batches, as nnscaler does); a step is ``zero_grad``, ``schedule.step``, an
  all-reduce of the two copies' gradients, ``opt.step()``.

It prints the median step time of each (the max over ranks, per step) and the median
over iterations of the ratio of the two steps of one iteration (they ran back to back,
under the same load; the order alternates),
then each rank's idle time in the nnscaler schedule (its span, from the first action of
any rank to the last, less the rank's forwards and backwards, from
:func:`nnscaler.runtime.pipeline.timeline`) against what :func:`nnscaler.schedule.simulate`
predicts for the 1f1b lists with the measured mean forward and backward times, the time
outside the schedule, and one JSON line.

Usage::

    python bench/pipeline/bench_pp_vs_torch.py [--steps 10] [--warmup 2] [--micro 4]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/_launch.py
from _launch import launch, slowest_steps  # noqa: E402
from torch import nn

from nnscaler import ComputeConfig, build_optimizer, parallelize
from nnscaler.graph import IRGraph
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.policies import pp
from nnscaler.runtime import pipeline
from nnscaler.schedule import get_schedule, simulate
from nnscaler.trace import trace

CONFIG = GPTConfig(vocab_size=1024, n_layer=4, n_head=4, d_model=256, seq_len=128)
NMICROS = 4
LR = 1e-4
TARGET = 1.0  # nnscaler / torch
PAS = {"pipeline_nmicros": NMICROS, "pipeline_scheduler": "1f1b"}


def _model() -> GPTWithLoss:
    torch.manual_seed(0)
    return GPTWithLoss(CONFIG)


def split_block(micro: int) -> int:
    """The block where the ``pp`` policy starts stage 1."""
    warnings.simplefilter("ignore")
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_end2end=True, pas_config=PAS)
    graph = pp(IRGraph.from_graph(trace(_model(), {"batch": make_batch(CONFIG, micro)})), cfg)
    first = next(op for op in graph.nodes() if op.stage == 1)
    parts = first.module_path.split(".")
    if parts[:2] != ["gpt", "blocks"] or graph.nodes()[graph.nodes().index(first) - 1] \
            .module_path.startswith(f"gpt.blocks.{parts[2]}"):
        raise SystemExit(f"the pp policy cut at {first.module_path!r}, not at a block start")
    return int(parts[2])


class _First(nn.Module):
    def __init__(self, model: GPTWithLoss, k: int) -> None:
        super().__init__()
        gpt = model.gpt
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.blocks = nn.ModuleList(gpt.blocks[:k])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return x


class _Last(nn.Module):
    def __init__(self, model: GPTWithLoss, k: int) -> None:
        super().__init__()
        gpt = model.gpt
        self.blocks = nn.ModuleList(gpt.blocks[k:])
        self.ln_f = gpt.ln_f
        self.lm_head = nn.Linear(CONFIG.d_model, CONFIG.vocab_size, bias=False)
        self.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())  # tied copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1))


def _torch_step(rank: int, k: int, data: list[dict[str, torch.Tensor]]
                ) -> Callable[[], list[float]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model = copy.deepcopy(_model())
    module = _First(model, k) if rank == 0 else _Last(model, k)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, NMICROS, loss_fn=_loss, scale_grads=False)
    opt = torch.optim.Adam(module.parameters(), lr=LR)
    tied = module.wte.weight if rank == 0 else module.lm_head.weight  # type: ignore[union-attr]
    ids = torch.cat([b["input_ids"] for b in data])
    labels = torch.cat([b["labels"] for b in data])

    def step() -> list[float]:
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=labels, losses=losses)
        dist.all_reduce(tied.grad)  # type: ignore[arg-type]
        opt.step()
        return [float(x) for x in losses]

    return step


def _nnscaler_step(rank: int, world: int, gen_savedir: str, data: list[dict[str, torch.Tensor]]
                   ) -> Callable[[], list[float]]:
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=world, use_end2end=True, pas_config=PAS)
    pm = parallelize(_model(), {"batch": data[0]}, "pp", cfg, gen_savedir=gen_savedir)
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)

    def step() -> list[float]:
        outs = pm.train_step(data)  # zeroes the gradients first
        opt.step()  # sync_grad: the tied embedding's copies sum their gradients
        return [float(x) for x in outs]

    return step


def _run(rank: int, world: int, steps: int, warmup: int, micro: int, k: int,
         gen_savedir: str) -> dict[str, Any]:
    data = [make_batch(CONFIG, micro, seed=m) for m in range(NMICROS)]
    fns = {"torch": _torch_step(rank, k, data),
           "nnscaler": _nnscaler_step(rank, world, gen_savedir, data)}
    times: dict[str, list[float]] = {m: [] for m in fns}
    first: dict[str, list[float]] = {}
    entries: list[list[pipeline.TimelineEntry]] = []  # per timed nnscaler step
    for i in range(warmup + steps):
        order = list(fns.items()) if i % 2 == 0 else list(reversed(fns.items()))
        for mode, fn in order:  # alternate which goes first: no mode always runs cold
            dist.barrier()
            with pipeline.timeline() as record:  # perf_counter: one clock for all processes
                t0 = time.perf_counter()
                losses = fn()
                elapsed = time.perf_counter() - t0
            if i == 0:
                first[mode] = losses
            if i >= warmup:
                times[mode].append(elapsed)
                if mode == "nnscaler":
                    entries.append(list(record))
    return {"times": times, "first": first, "entries": entries}


def _analyse(results: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """The nnscaler steps' schedule: per step, its span (the first action of any rank to
    the last), each rank's busy time (forwards and backwards) and idle time (span less
    busy); medians over the steps, against the simulator's idle time for the 1f1b lists
    with the measured mean forward and backward times."""
    spans, busy, fwd, bwd = [], [[] for _ in results], [[] for _ in results], \
        [[] for _ in results]
    for i in range(steps):
        per_rank = [r["entries"][i] for r in results]
        start = min(e[0].start for e in per_rank)
        spans.append(max(e[-1].end for e in per_rank) - start)
        for d, record in enumerate(per_rank):
            busy[d].append(sum(e.end - e.start for e in record if e.kind != "comm"))
            fwd[d] += [e.end - e.start for e in record if e.kind == "forward"]
            bwd[d] += [e.end - e.start for e in record if e.kind == "backward"]
    span = statistics.median(spans)
    step = statistics.median(slowest_steps(results, "nnscaler")[:steps])
    lists = get_schedule("1f1b")(2, NMICROS)
    # the simulator times every stage alike: the mean forward and backward of both ranks
    f_mean = statistics.mean(statistics.median(f) for f in fwd)
    b_mean = statistics.mean(statistics.median(b) for b in bwd)
    sim = simulate(lists, 2, NMICROS, fwd_time=f_mean, bwd_time=b_mean)
    ideal = simulate(lists, 2, NMICROS)
    ranks = []
    for d in range(len(results)):
        idle = statistics.median(s - b for s, b in zip(spans, busy[d], strict=True))
        ranks.append({
            "rank": d,
            "forward_ms": round(statistics.median(fwd[d]) * 1e3, 2),
            "backward_ms": round(statistics.median(bwd[d]) * 1e3, 2),
            "busy_ms": round(statistics.median(busy[d]) * 1e3, 2),
            "idle_ms": round(idle * 1e3, 2),
            "idle_fraction": round(idle / span, 3),
            "predicted_idle_ms": round(sim.idle[d] * 1e3, 2),
            "predicted_idle_fraction": round(sim.idle[d] / sim.makespan, 3),
        })
    return {"step_ms": round(step * 1e3, 2), "schedule_ms": round(span * 1e3, 2),
            "outside_schedule_ms": round((step - span) * 1e3, 2), "ranks": ranks,
            "predicted_makespan_ms": round(sim.makespan * 1e3, 2),
            "predicted_bubble_fraction": round(sim.bubble_fraction, 3),
            "ideal_bubble_fraction": round(ideal.bubble_fraction, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    ap.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    args = ap.parse_args()
    k = split_block(args.micro)
    with tempfile.TemporaryDirectory() as gen_savedir:
        results = launch(_run, 2, args.steps, args.warmup, args.micro, k, gen_savedir)
    per_step = {m: slowest_steps(results, m) for m in ("torch", "nnscaler")}
    medians = {m: statistics.median(t) for m, t in per_step.items()}
    # the two modes' steps of one iteration ran back to back: their ratio sees the same load
    ratio = statistics.median(n / t for n, t in zip(per_step["nnscaler"], per_step["torch"],
                                                   strict=True))
    idle = _analyse(results, args.steps)
    print(f"GPTWithLoss {CONFIG}\n2 stages (stage 1 starts at gpt.blocks.{k}), 1f1b, "
          f"{NMICROS} micro-batches of {args.micro} sequences, Adam, {args.steps} steps "
          f"after {args.warmup} warm-up (median of the per-step max over ranks)")
    for m, v in medians.items():
        print(f"{m:>9}: {v * 1e3:8.1f} ms")
    print(f"nnscaler / torch = {ratio:.3f} (median over iterations of the two modes' step "
          f"times; target <= {TARGET}): "
          f"{'ok' if ratio <= TARGET else 'MISSED'}")
    print(f"losses at step 0: torch (rank 1) {results[1]['first']['torch']}, nnscaler "
          f"{results[1]['first']['nnscaler']}")
    print(f"nnscaler step {idle['step_ms']} ms: schedule {idle['schedule_ms']} ms, outside "
          f"it (zero_grad, outputs to the unit, sync_grad, optimizer) "
          f"{idle['outside_schedule_ms']} ms")
    print(f"idle per rank within the schedule (simulator with the measured mean "
          f"forward/backward: makespan {idle['predicted_makespan_ms']} ms, bubble "
          f"{idle['predicted_bubble_fraction']}; with backward = 2 x forward: "
          f"{idle['ideal_bubble_fraction']})")
    for r in idle["ranks"]:
        print(f"  rank {r['rank']}: forward {r['forward_ms']} ms, backward {r['backward_ms']} "
              f"ms, busy {r['busy_ms']} ms, idle {r['idle_ms']} ms ({r['idle_fraction']:.1%}); "
              f"predicted idle {r['predicted_idle_ms']} ms "
              f"({r['predicted_idle_fraction']:.1%})")
    print(json.dumps({"bench": "pp_vs_torch_pipelining", "nmicros": NMICROS,
                      "micro_batch": args.micro, "split_block": k, "steps": args.steps,
                      "median_ms": {m: round(v * 1e3, 2) for m, v in medians.items()},
                      "ratio": round(ratio, 3), "target": TARGET, "idle": idle}))


if __name__ == "__main__":
    main()
