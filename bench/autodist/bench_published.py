"""autodist's estimate for named GPUs against published training runs.

Each run below is a public measurement of a well-known model on A100s, with the parallel
plan its publication gives. The model is built on the meta device with the published
sizes (``bfloat16``), planned by autodist for ``device_type='A100'`` with that plan
(the unit of tensor x pipeline devices, the rest data parallel; the same recompute;
the micro-batches of the global batch), and autodist's estimated step time is compared
with the step time the publication implies. Prints a table (estimate / published) and
the median of ``|estimate / published - 1|`` (goal <= 0.15), then one JSON line.

The runs:

- torchtitan, docs/performance.md ("Llama 3 performance numbers", 64 A100 80GB, FSDP2,
  local batch 1, sequence 8192): Llama 3 8B, selective op activation checkpointing,
  2973 tokens/s per GPU; Llama 3 70B, full activation checkpointing, 331 tokens/s per
  GPU. Step = 8192 tokens / (tokens/s per GPU).
- Megatron-LM, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM" (arXiv 2104.04473), Table 1 (A100 80GB on Selene, GPT
  with vocabulary 51200, sequence 2048, activation recomputation): 18.4B (hidden 6144,
  48 heads, 40 layers, TP 8, 256 GPUs, batch 1024) at 135 TFLOP/s per GPU; 39.1B
  (8192, 64, 48 layers, TP 8, PP 2, 512 GPUs, batch 1536) at 138 TFLOP/s. Step =
  the paper's FLOPs per step, ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``, over the
  TFLOP/s per GPU times the GPUs.

How each plan is given to autodist: FSDP2 as data parallelism over units of one device
with ZeRO stage 3 (``zero_stage=3``: every weight gathered before forward and again
before backward, its gradient reduce-scattered, prefetched behind compute as autodist's
model counts it), the reduction from backward's hooks (``use_async_reducer``).
Megatron's tensor parallelism as units of 8 devices (one node) and
``pipeline_nstages``; its data parallelism over the units, the gradients summed after
backward (the 2021 code did not overlap them; ``overlap_grad_reduce`` came later); its
attention as an explicit softmax over the masked scores (``GPTConfig(attn='manual')``:
the 2021 code fused scale, mask and softmax but had no flash attention), no ZeRO;
its micro-batch of 1 (the paper's Table 1 does not give one: 1 keeps the pipeline's
bubble small). The memory limit is lifted (``mem_constraint`` 10 TB): the published runs fit their devices, and
this checks time, not memory. torchtitan's selective op checkpointing (the 8B) keeps
the outputs of every other matmul and of attention and recomputes the rest; autodist
recomputes whole modules only, so it is modelled as no recomputation (the estimate
misses the recomputed half of the matmuls' forward, about 15% of the step).

Usage::

    python bench/autodist/bench_published.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

GOAL = 0.15


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: str  # 'llama' or 'gpt'
    sizes: dict
    seq: int
    gpus: int
    tp: int
    pp: int
    global_batch: int
    recompute: bool
    published_step_s: float
    published: str  # the figure as published
    overlap: bool = True  # the gradient reduction overlaps backward
    zero_stage: int = 0


def _megatron_step(h: int, layers: int, batch: int, gpus: int,
                   tflops: float, seq: int = 2048, vocab: int = 51200) -> float:
    flops = 96 * batch * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))
    return flops / (tflops * 1e12 * gpus)


RUNS = (
    Run("llama3-8b-fsdp64", "torchtitan docs/performance.md, 64 A100", "llama",
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
        8192, 64, 1, 1, 64, False, 8192 / 2973, "2973 tok/s/GPU", zero_stage=3),
    Run("llama3-70b-fsdp64", "torchtitan docs/performance.md, 64 A100", "llama",
        dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
             num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
        8192, 64, 1, 1, 64, True, 8192 / 331, "331 tok/s/GPU", zero_stage=3),
    Run("gpt-18.4b-tp8", "Narayanan et al. 2021 Table 1", "gpt",
        dict(n_layer=40, n_head=48, d_model=6144, vocab_size=51200, attn="manual"),
        2048, 256, 8, 1, 1024, True,
        _megatron_step(6144, 40, 1024, 256, 135), "135 TFLOP/s/GPU", overlap=False),
    Run("gpt-39.1b-tp8-pp2", "Narayanan et al. 2021 Table 1", "gpt",
        dict(n_layer=48, n_head=64, d_model=8192, vocab_size=51200, attn="manual"),
        2048, 512, 8, 2, 1536, True,
        _megatron_step(8192, 48, 1536, 512, 138), "138 TFLOP/s/GPU", overlap=False),
)


class WithLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss


def _build(run: Run) -> tuple[nn.Module, dict, str]:
    """The model on meta, its sample (one micro-batch of one sequence), and the module
    class recomputed when the run recomputes."""
    with torch.device("meta"):
        if run.model == "llama":
            import transformers

            cfg = transformers.LlamaConfig(**run.sizes, max_position_embeddings=run.seq,
                                           torch_dtype=torch.bfloat16)
            cfg._attn_implementation = "sdpa"
            model = WithLoss(transformers.LlamaForCausalLM(cfg)).to(torch.bfloat16)
            ids = torch.zeros(1, run.seq, dtype=torch.long)
            return model, {"batch": {"input_ids": ids, "labels": ids}}, "LlamaDecoderLayer"
        from nnscaler.models.gpt import GPTConfig, GPTWithLoss

        cfg = GPTConfig(seq_len=run.seq, **run.sizes)
        model = GPTWithLoss(cfg).to(torch.bfloat16)
    ids = torch.zeros(1, run.seq, dtype=torch.long)
    return model, {"batch": {"input_ids": ids, "labels": ids}}, "Block"


def estimate(run: Run) -> tuple[float, float]:
    """(autodist's estimated step seconds, seconds it took to plan)."""
    from nnscaler_policy_autodist.policy import plan_graph

    from nnscaler import ComputeConfig
    from nnscaler.graph import IRGraph
    from nnscaler.trace import trace

    model, sample, block = _build(run)
    unit = run.tp * run.pp
    dp = run.gpus // unit
    nmicros = run.global_batch // dp  # micro-batches of one sequence per replica
    pas = {"device_type": "A100", "mem_constraint": 10000, "pipeline_nstages": run.pp,
           "max_partition_degree": run.tp,
           "profile_dir": tempfile.mkdtemp(prefix="bench_published_")}
    if nmicros > 1:
        pas["pipeline_nmicros"] = nmicros
    if run.recompute:
        pas["recompute_modules"] = block
    config = ComputeConfig(plan_ngpus=unit, runtime_ngpus=run.gpus, use_end2end=True,
                           zero_stage=run.zero_stage, use_async_reducer=run.overlap,
                           trace_strategy="meta",
                           pas_config=pas)
    t0 = time.perf_counter()
    graph = IRGraph.from_graph(trace(model, sample, strategy="meta"))
    _, result = plan_graph(graph, config)
    return result.pipeline.step_time, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="run these names only")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for run in RUNS:
        if args.only and run.name not in args.only:
            continue
        est, took = estimate(run)
        rows.append((run, est, took))
        print(f"{run.name}: estimate {est:.3f} s, published {run.published_step_s:.3f} s "
              f"({run.published}), ratio {est / run.published_step_s:.3f} "
              f"[planned in {took:.1f} s]", flush=True)
    print()
    print("| run | plan (GPUs, TP, PP) | published | published step (s) | estimate (s) "
          "| estimate / published | source |")
    print("|---|---|---|---|---|---|---|")
    for run, est, _ in rows:
        print(f"| {run.name} | {run.gpus}, {run.tp}, {run.pp} | {run.published} "
              f"| {run.published_step_s:.3f} | {est:.3f} | {est / run.published_step_s:.3f} "
              f"| {run.source} |")
    errors = [abs(est / run.published_step_s - 1) for run, est, _ in rows]
    median = statistics.median(errors) if errors else float("nan")
    print(f"\nmedian |estimate / published - 1| = {median:.3f} (goal <= {GOAL}): "
          f"{'ok' if median <= GOAL else 'MISSED'}")
    print(json.dumps({"bench": "autodist_published", "median_error": round(median, 4),
                      "runs": {run.name: {"estimate_s": round(est, 4),
                                          "published_s": round(run.published_step_s, 4),
                                          "ratio": round(est / run.published_step_s, 4),
                                          "plan_s": round(took, 1)}
                               for run, est, took in rows}}))


if __name__ == "__main__":
    main()
