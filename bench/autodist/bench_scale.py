"""Plan only, at scale: a Hugging Face Llama with 70B-shaped layers (hidden 8192, MLP
28672, 64 heads, 8 KV heads, vocabulary 128256), 80 layers, built on the meta device (its
70B parameters would not fit in memory), sequence 4096, micro-batch 1, for 1024 H100s:
``parallelize(..., load_module=False)`` with ``trace_strategy='meta'`` and autodist with
``device_type='H100'`` (analytic compute, NVLink/InfiniBand figures), ``plan_ngpus=64``
(the rest is data parallelism across 16 scale units, ZeRO on), ``pipeline_nstages='auto'``,
16 micro-batches, at most 8-way tensor parallelism (one node), 80 GB per device. Prints
the phases and the plan report; goal under 60 s on this 2-core machine.

``--model gpt18b``: the 18.4B-parameter GPT of Megatron-LM's scaling table (the
project's ``GPTWithLoss``, hidden 6144, 48 heads, 40 layers, vocabulary 51200, sequence
2048) for 256 devices as units of 8, with ``--recompute`` every block recomputed (the
code generation of 40 x 3 checkpointed pieces per rank); goal under 15 s.

``--model deepseek-v3``: a DeepSeek-V3-shaped MoE (`deepseek_v3.py`: 61 layers, the
first 3 dense, 256 routed experts top-8 and a shared expert, hidden 7168; multi-head latent
attention approximated by standard attention with its parameter count) for 2048 devices
given only ``runtime_ngpus`` (``plan_ngpus='auto'``): autodist chooses the unit, the
stages and the expert degree (`nnscaler_policy_autodist.experts`); expert and tensor
splits up to 64 devices (``--max-degree``); goal under 120 s.

Usage::

    python bench/autodist/bench_scale.py [--layers 80] [--plan-ngpus 64|auto]
        [--runtime-ngpus 1024] [--batch 1] [--seq 4096] [--profile PATH] [--no-two-axis]
    python bench/autodist/bench_scale.py --model gpt18b --recompute
    python bench/autodist/bench_scale.py --model deepseek-v3

``--batch`` sequences of ``--seq`` tokens are the traced batch (what one scale unit
computes per micro-batch); ``--plan-ngpus auto`` lets autodist choose the unit size too
(every divisor of ``--runtime-ngpus``, pruned by lower bounds). ``--profile PATH`` also
writes a cProfile of ``parallelize`` and prints the search's phases from it (cumulative
CPU time of this process per function: robust to the load of a shared machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

TARGET_S = 60.0
PHASES = ("trace", "search", "apply", "check", "codegen", "write")


class PhaseClock:
    """Exclusive wall time per phase: each named function is wrapped so that its time,
    less the time of phases nested in it, goes to its phase (a check inside codegen counts
    as check). What no phase covers is ``other`` (report, fingerprints, saving the graph)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)
        self.cpu = dict.fromkeys(PHASES, 0.0)  # the same in CPU time of this process
        self._stack: list[float] = []  # time of nested phases, per open frame
        self._cpu_stack: list[float] = []

    def wrap(self, owner: object, attr: str, phase: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:  # an older kernel (to compare with): not there
            return

        def timed(*args: object, **kwargs: object) -> object:
            self._stack.append(0.0)
            self._cpu_stack.append(0.0)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent, used = time.perf_counter() - t0, time.process_time() - c0
                nested, nested_cpu = self._stack.pop(), self._cpu_stack.pop()
                self.seconds[phase] += spent - nested
                self.cpu[phase] += used - nested_cpu
                self.calls[phase] += 1
                if self._stack:
                    self._stack[-1] += spent
                    self._cpu_stack[-1] += used

        setattr(owner, attr, timed)

    def install(self) -> None:
        import nnscaler_policy_autodist.policy as policy

        import nnscaler.codegen.files as cfiles
        import nnscaler.graph.check as gcheck
        import nnscaler.trace as ntrace

        self.wrap(ntrace, "trace", "trace")
        self.wrap(policy, "search_pipeline", "search")  # kernels before the bounds
        self.wrap(policy, "search_pipeline_bounded", "search")
        self.wrap(policy, "_search_meshes", "search")  # plan_ngpus='auto': the bounds too
        self.wrap(policy, "_apply", "apply")
        self.wrap(gcheck, "check_plan", "check")
        import nnscaler.codegen.program as cprogram

        cprogram.check_plan = gcheck.check_plan  # build_program imported it by name
        self.wrap(cfiles, "build_program", "codegen")
        self.wrap(cfiles, "generate", "codegen")
        self.wrap(cfiles, "generate_rank", "codegen")  # older kernels: rank by rank
        self.wrap(cfiles, "full_state", "write")
        self.wrap(cfiles, "_write_atomic", "write")


class WithLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss


def _ngpus(text: str) -> int | str:
    return text if text == "auto" else int(text)


#: cProfile rows summed into the phases of the search (cumulative seconds of each)
SEARCH_PHASES = {
    "floor": "policy.py:.*\\(compute_floor\\)",
    "build": "model.py:.*\\(build\\)",
    "solve": "spmd.py:.*\\(solve\\)",
    "cuts": "pipeline.py:.*\\(_best_cuts\\)",
    "search_meshes": "policy.py:.*\\(_search_meshes\\)",
    "search_pipeline": "pipeline.py:.*\\(search_pipeline(_bounded)?\\)",
    "plan_graph": "policy.py:.*\\(plan_graph\\)",
}


def search_phases(path: str) -> dict[str, float]:
    """Cumulative seconds of the search's functions in the cProfile at ``path``."""
    import pstats
    import re

    stats = pstats.Stats(path).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    out = {}
    for phase, pattern in SEARCH_PHASES.items():
        rx = re.compile(pattern)
        out[phase] = round(sum(v[3] for (f, line, name), v in stats.items()
                               if rx.search(f"{os.path.basename(f)}:{line}({name})")), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--plan-ngpus", type=_ngpus, default=64,
                    help="devices per scale unit, or 'auto' (autodist chooses)")
    ap.add_argument("--runtime-ngpus", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1, help="sequences in the traced batch")
    ap.add_argument("--profile", metavar="PATH", help="also write a cProfile of parallelize")
    ap.add_argument("--model", choices=("llama70b", "gpt18b", "deepseek-v3"),
                    default="llama70b")
    ap.add_argument("--max-degree", type=int, default=None,
                    help="the largest split of a stage (default 8; 64 for deepseek-v3)")
    ap.add_argument("--recompute", action="store_true", help="recompute every layer")
    ap.add_argument("--no-two-axis", action="store_true",
                    help="leave out two-axis (data x tensor) splits inside a stage")
    args = ap.parse_args()
    if args.model == "gpt18b":
        for name, default, value in (("layers", 80, 40), ("plan_ngpus", 64, 8),
                                     ("runtime_ngpus", 1024, 256), ("seq", 4096, 2048)):
            if getattr(args, name) == default:
                setattr(args, name, value)
    if args.model == "deepseek-v3":
        for name, default, value in (("layers", 80, 61), ("plan_ngpus", 64, "auto"),
                                     ("runtime_ngpus", 1024, 2048)):
            if getattr(args, name) == default:
                setattr(args, name, value)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("nnscaler.autodist").setLevel(logging.INFO)
    import transformers
    from nnscaler_policy_autodist import NoPlanFits

    from nnscaler import ComputeConfig, parallelize

    t0 = time.perf_counter()
    pas = {"device_type": "H100", "mem_constraint": 80, "pipeline_nstages": "auto",
           "pipeline_nmicros": 16,
           "max_partition_degree": args.max_degree or (64 if args.model == "deepseek-v3" else 8)}
    if args.model == "gpt18b":
        from nnscaler.models.gpt import GPTConfig, GPTWithLoss

        gcfg = GPTConfig(vocab_size=51200, n_layer=args.layers, n_head=48, d_model=6144,
                         seq_len=args.seq)
        with torch.device("meta"):
            model = GPTWithLoss(gcfg).to(torch.bfloat16)
        block = "Block"
    elif args.model == "deepseek-v3":
        from deepseek_v3 import DeepSeekV3LM, DeepSeekV3Shape

        with torch.device("meta"):
            model = DeepSeekV3LM(DeepSeekV3Shape(layers=args.layers)).to(torch.bfloat16)
        block = "Layer"
    else:
        cfg = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672,
                                       num_hidden_layers=args.layers, num_attention_heads=64,
                                       num_key_value_heads=8, vocab_size=128256,
                                       max_position_embeddings=args.seq,
                                       torch_dtype=torch.bfloat16)
        with torch.device("meta"):
            model = WithLoss(transformers.LlamaForCausalLM(cfg)).to(torch.bfloat16)
        block = "LlamaDecoderLayer"
    if args.recompute:
        pas["recompute_modules"] = block
    if args.no_two_axis:
        pas["two_axis"] = False
    params = sum(p.numel() for p in model.parameters())
    built = time.perf_counter() - t0
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    compute = ComputeConfig(
        plan_ngpus=args.plan_ngpus, runtime_ngpus=args.runtime_ngpus, use_end2end=True,
        use_zero=True, trace_strategy="meta", pas_config=pas)
    clock = PhaseClock()
    clock.install()
    with tempfile.TemporaryDirectory() as gen:
        prof = None
        if args.profile:
            import cProfile

            prof = cProfile.Profile(time.process_time)  # CPU time: robust to the load
        t1 = time.perf_counter()
        if prof is not None:
            prof.enable()
        failed = None
        try:
            parallelize(model, {"batch": {"input_ids": ids, "labels": ids}}, "autodist",
                        compute, gen_savedir=gen, load_module=False)
        except NoPlanFits as e:  # still a search to time: say so and report it
            failed = str(e).split(". Raise")[0]
        finally:
            if prof is not None:
                prof.disable()
        seconds = time.perf_counter() - t1
        if prof is not None:
            prof.dump_stats(args.profile)
            print("search phases from cProfile (cumulative s): " + ", ".join(
                f"{k} {v:.2f}" for k, v in search_phases(args.profile).items()))
        paths = sorted(os.path.join(d, n) for d, _, ns in os.walk(gen) for n in ns)
        files = [os.path.basename(p) for p in paths]
        written = sum(os.path.getsize(p) for p in paths)
        digest = hashlib.sha256()  # of the generated code: equal digests, equal programs
        for path in paths:
            if os.path.basename(path).startswith("gencode"):
                with open(path, "rb") as f:
                    digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    if failed:
        print(f"NO PLAN: {failed}")
    phases = {k: round(v, 2) for k, v in clock.seconds.items()}
    phases["other"] = round(seconds - sum(clock.seconds.values()), 2)
    print("phases (s): " + ", ".join(f"{k} {v:.2f}" + (f" ({clock.calls[k]} calls)"
                                                       if clock.calls.get(k, 1) > 1 else "")
                                      for k, v in phases.items()))
    print("phases, CPU time of this process (s): " + ", ".join(
        f"{k} {v:.2f}" for k, v in clock.cpu.items()))
    target = {"gpt18b": 15.0, "deepseek-v3": 120.0}.get(args.model, TARGET_S)
    print(f"{args.model} {args.layers} layers{' (recomputed)' if args.recompute else ''}, {params / 1e9:.1f} B parameters (meta), built in "
          f"{built:.1f} s; parallelize(load_module=False) for {args.runtime_ngpus} devices "
          f"(plan_ngpus {args.plan_ngpus}): {seconds:.1f} s (goal < {target} s): "
          f"{'ok' if seconds < target and not failed else 'MISSED'}; {len(files)} files written "
          f"({written / 1e6:.1f} MB)")
    print(json.dumps({"bench": "autodist_scale", "model": args.model,
                      "recompute": args.recompute, "layers": args.layers, "params": params,
                      "plan_ngpus": args.plan_ngpus, "runtime_ngpus": args.runtime_ngpus,
                      "batch": args.batch, "seq": args.seq, "planned": not failed,
                      "two_axis": not args.no_two_axis,
                      "parallelize_s": round(seconds, 1), "phases_s": phases,
                      "phases_cpu_s": {k: round(v, 2) for k, v in clock.cpu.items()},
                      "files": len(files), "bytes": written,
                      "gencode_sha256": digest.hexdigest()[:16]}))


if __name__ == "__main__":
    main()
