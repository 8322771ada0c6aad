"""Compile time of ``parallelize(..., load_module=False)``: trace to generated files.

No process group, one process (``OMP_NUM_THREADS=1``). The model is a ``GPTWithLoss``
(d_model 256, 8 heads, seq 128, vocab 1024, batch 4), planned with the ``tp`` policy for a
scale unit of 4 devices (``plan_ngpus = runtime_ngpus = 4``), traced with
``trace_strategy='meta'``.

1. 24 layers: ``parallelize`` end to end (median of ``--repeat`` runs, each into a fresh
   ``gen_savedir``, after one untimed warm-up compile that pays torch's one-time costs),
   and its phases, timed by running the pieces that ``parallelize`` runs, in its order:
   fingerprints (module and inputs, for reuse), ``nnscaler.trace.trace``,
   ``IRGraph.from_graph``, the policy, ``graph.check`` (parallelize checks the policy's
   result), ``nnscaler.codegen.build_program``, ``generate`` (every rank's source), writing
   the files (``emit_files`` minus ``generate``: sources and ``fullmodel.pt``) and pickling
   the traced graph (``graph.pkl``, for ``ReuseType.GRAPH``).
2. The same for ``--layers`` (default 2, 6, 12, 24, 48): end to end and by phase, with
   the time per layer; linear growth keeps the time per layer flat.

``--profile`` adds a cProfile of one 24-layer ``parallelize`` (top functions by cumulative
and by own time). Prints the tables, then one JSON line.

Usage::

    python bench/parallel/bench_compile.py [--repeat 3] [--layers 2 6 12 24 48] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import os
import pstats
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from nnscaler import (  # noqa: E402
    ComputeConfig,
    gendir,  # noqa: E402
    parallelize,
)
from nnscaler.codegen import build_program, emit_files, generate  # noqa: E402
from nnscaler.graph import IRGraph  # noqa: E402
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch  # noqa: E402
from nnscaler.parallel import fingerprint, graph_pickle  # noqa: E402
from nnscaler.plugins import get_plugin_manager  # noqa: E402
from nnscaler.trace import trace  # noqa: E402

HEADLINE_LAYERS = 24
BATCH = 4
NGPUS = 4
POLICY = "tp"
TARGET_S = 3.5
PHASES = ("fingerprint", "trace", "from_graph", "policy", "check", "build_program",
          "generate", "write_files", "save_graph")


def gpt_config(n_layer: int) -> GPTConfig:
    return GPTConfig(vocab_size=1024, n_layer=n_layer, n_head=8, d_model=256, seq_len=128)


def compute_config() -> ComputeConfig:
    return ComputeConfig(plan_ngpus=NGPUS, runtime_ngpus=NGPUS, trace_strategy="meta")


def make(n_layer: int) -> tuple[GPTWithLoss, dict[str, dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    cfg = gpt_config(n_layer)
    return GPTWithLoss(cfg), {"batch": make_batch(cfg, BATCH)}


def end_to_end(model: GPTWithLoss, args: dict) -> float:
    """Seconds of one ``parallelize(load_module=False)`` into a fresh directory."""
    with tempfile.TemporaryDirectory() as gen_savedir:
        start = time.perf_counter()
        parallelize(model, args, POLICY, compute_config(), gen_savedir=gen_savedir,
                    load_module=False)
        return time.perf_counter() - start


def phases(model: GPTWithLoss, args: dict) -> dict[str, float]:
    """Seconds of each piece of ``parallelize``, run one after the other as it runs them."""
    cfg = compute_config()
    policy = get_plugin_manager().policies.get(POLICY)
    signature = inspect.signature(model.forward)
    out: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], object]) -> object:
        start = time.perf_counter()
        value = fn()
        out[name] = out.get(name, 0.0) + time.perf_counter() - start
        return value

    timed("fingerprint", lambda: (fingerprint.module_fingerprint(model),
                                  fingerprint.inputs_fingerprint(args)))
    traced = timed("trace", lambda: trace(model, args, strategy=cfg.trace_strategy))
    graph = timed("from_graph", lambda: IRGraph.from_graph(traced))
    planned = timed("policy", lambda: policy(graph, cfg)) or graph
    timed("check", lambda: planned.check(cfg.plan_ngpus))
    program = timed("build_program", lambda: build_program(
        planned, plan_ngpus=cfg.plan_ngpus, runtime_ngpus=cfg.runtime_ngpus,
        compute_config=cfg, forward_signature=signature))
    timed("generate", lambda: generate(program))
    with tempfile.TemporaryDirectory() as outdir:
        start = time.perf_counter()
        emit_files(planned, outdir, plan_ngpus=cfg.plan_ngpus, runtime_ngpus=cfg.runtime_ngpus,
                   state=model, compute_config=cfg, forward_signature=signature,
                   program=program)
        out["write_files"] = time.perf_counter() - start - out["generate"]
        timed("save_graph", lambda: graph_pickle.save_graph(traced, Path(outdir) / gendir.GRAPH_FILE))
    out["total"] = sum(out[p] for p in PHASES)
    out["ops_traced"] = len(traced.ops)
    out["ops_planned"] = len(planned.nodes())
    return out


def profile(model: GPTWithLoss, args: dict, top: int) -> str:
    prof = cProfile.Profile()
    with tempfile.TemporaryDirectory() as gen_savedir:
        prof.enable()
        parallelize(model, args, POLICY, compute_config(), gen_savedir=gen_savedir,
                    load_module=False)
        prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.strip_dirs().sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--repeat", type=int, default=3,
                    help="end-to-end runs of the 24-layer model (median)")
    ap.add_argument("--layers", type=int, nargs="*", default=[2, 6, 12, 24, 48],
                    help="depths of the growth table (none: skip it)")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile one 24-layer parallelize")
    ap.add_argument("--top", type=int, default=25, help="rows of each profile listing")
    opts = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # notes about the plan: not what is measured
    print(f"torch {torch.__version__}, 1 thread; GPTWithLoss d_model 256, 8 heads, seq 128, "
          f"vocab 1024, batch {BATCH}; policy {POLICY!r}, plan_ngpus = runtime_ngpus = "
          f"{NGPUS}, trace_strategy='meta'")

    warm_model, warm_args = make(2)
    cold = end_to_end(warm_model, warm_args)  # pays torch's one-time costs (meta kernels, ...)

    model, args = make(HEADLINE_LAYERS)
    runs = [end_to_end(model, args) for _ in range(opts.repeat)]
    headline = statistics.median(runs)
    parts = phases(model, args)
    print(f"\n{HEADLINE_LAYERS} layers ({parts['ops_traced']} traced ops, "
          f"{parts['ops_planned']} op instances planned): parallelize(load_module=False) "
          f"{headline:.2f} s (median of {opts.repeat}, min {min(runs):.2f}: "
          f"{', '.join(f'{r:.2f}' for r in runs)}); target < {TARGET_S} s: "
          f"{'ok' if headline < TARGET_S else 'MISSED'}")
    print(f"(first compile in the process, 2 layers: {cold:.2f} s)")
    print(f"{'phase':>13} | {'seconds':>7} | share")
    for p in PHASES:
        print(f"{p:>13} | {parts[p]:7.3f} | {parts[p] / parts['total']:5.1%}")
    print(f"{'sum':>13} | {parts['total']:7.3f} | (a run of its own, so not exactly the "
          f"end-to-end time)")

    growth = []
    for n in opts.layers:
        m, a = (model, args) if n == HEADLINE_LAYERS else make(n)
        e2e = headline if n == HEADLINE_LAYERS else end_to_end(m, a)
        pp = parts if n == HEADLINE_LAYERS else phases(m, a)
        growth.append({"layers": n, "parallelize_s": round(e2e, 3),
                       "ms_per_layer": round(e2e / n * 1e3, 1),
                       **{p: round(pp[p], 3) for p in PHASES},
                       "ops_planned": pp["ops_planned"]})
        del m, a
    if growth:
        print("\ngrowth with depth (end to end, then by phase, seconds):")
        cols = ("trace", "policy", "check", "build_program", "generate", "write_files")
        print(f"{'layers':>6} | {'parallelize':>11} | {'ms/layer':>8} | "
              + " | ".join(f"{c:>13}" for c in cols))
        for g in growth:
            print(f"{g['layers']:>6} | {g['parallelize_s']:11.2f} | {g['ms_per_layer']:8.1f} | "
                  + " | ".join(f"{g[c]:13.3f}" for c in cols))
        if len(growth) >= 2:
            a, b = growth[-2], growth[-1]
            k = b["layers"] / a["layers"]
            print(f"{a['layers']} -> {b['layers']} layers (x{k:g}): parallelize "
                  f"x{b['parallelize_s'] / a['parallelize_s']:.2f}, policy "
                  f"x{b['policy'] / a['policy']:.2f} (linear: x{k:g}, quadratic: x{k * k:g})")
    if opts.profile:
        print(f"\ncProfile of one {HEADLINE_LAYERS}-layer parallelize (profiling slows it "
              f"several times):")
        print(profile(model, args, opts.top))
    print(json.dumps({"bench": "compile", "layers": HEADLINE_LAYERS, "policy": POLICY,
                      "plan_ngpus": NGPUS, "parallelize_s": round(headline, 3),
                      "min_s": round(min(runs), 3), "runs_s": [round(r, 3) for r in runs],
                      "target_s": TARGET_S,
                      "phases_s": {p: round(parts[p], 3) for p in PHASES},
                      "first_compile_2_layers_s": round(cold, 3), "growth": growth}))


if __name__ == "__main__":
    main()
