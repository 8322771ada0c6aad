"""autodist's compute profile from cold, in one process on CPU: what a fresh profile sums
to against later passes, what it costs, and the calibration run against the eager model.

For the project's GPT (``--layers``, one unit's ``--batch`` of 64 tokens) it reports:

- the eager model's forward and backward (its own weights), the median of ``--steps``;
- the sum of the unsplit ops' profiled times (forward, plus backward where gradients
  flow: what `ComputeProfiler.calibrate` divides by), measured ``--passes`` times into
  fresh caches in this process: the first pass is the cold profile, the later ones warm,
  with the CPU seconds each pass took;
- the calibration's run of the whole model on made-up values (`_run_model`) as it is
  and, for comparison, as it was before method 4 (unit-scale random weights, subnormal
  floats not flushed), with the factors each gives.

Times are this thread's CPU time where the profiler reads CPU time (one thread per
process), so a loaded machine moves them little; the eager step is given both ways.

Usage::

    python bench/autodist/bench_profile.py [--layers 4] [--batch 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402


def _gpt(layers: int, batch: int):  # noqa: ANN202 - (model, batch, graph)
    from nnscaler.graph import IRGraph
    from nnscaler.models import GPTConfig, GPTWithLoss
    from nnscaler.trace import trace

    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(vocab_size=1024, n_layer=layers, n_head=8, d_model=256,
                                  seq_len=64))
    ids = torch.randint(1024, (batch, 64))
    data = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    return model, data, IRGraph.from_graph(trace(model, {"batch": data}))


def _eager(model, data, steps: int) -> tuple[float, float]:  # noqa: ANN001
    """Median (wall, CPU) seconds of the eager model's forward and backward."""
    walls, cpus = [], []
    for i in range(steps + 1):
        for p in model.parameters():
            p.grad = None
        w, c = time.perf_counter(), time.thread_time()
        model(data).backward()
        if i:
            walls.append(time.perf_counter() - w)
            cpus.append(time.thread_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def _profile_sum(ops) -> tuple[float, float]:  # noqa: ANN001
    """(the ops' profiled sum, CPU seconds of profiling) into a fresh cache."""
    from nnscaler_policy_autodist.comm import device_spec
    from nnscaler_policy_autodist.profile import ComputeProfiler

    with tempfile.TemporaryDirectory() as d:
        prof = ComputeProfiler(device_spec("cpu", d), d)
        t0 = time.process_time()
        total = 0.0
        for op in ops:
            fw, bw = prof.time(op, None, 1)
            grads = not op.no_grad and any(t.full.requires_grad for t in op.input_tensors())
            total += fw + (bw if grads else 0.0)
        return total, time.process_time() - t0


@contextlib.contextmanager
def _as_before_method_4():  # noqa: ANN202
    """The calibration's made-up values as they were: unit-scale weights, no flush."""
    from nnscaler_policy_autodist import profile

    make, flush = profile._make, profile.flushing_denormals
    profile._make = lambda spec, device, grad, weight=False: make(spec, device, grad)
    profile.flushing_denormals = contextlib.nullcontext
    try:
        yield
    finally:
        profile._make, profile.flushing_denormals = make, flush


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from nnscaler_policy_autodist.profile import _run_model

    model, data, g = _gpt(args.layers, args.batch)
    ops = g.nodes()
    wall, cpu = _eager(model, data, args.steps)
    print(f"GPT {args.layers} layers, batch {args.batch}x64, {len(ops)} ops; load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"eager forward+backward: {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU")
    sums = []
    for n in range(args.passes):
        total, spent = _profile_sum(ops)
        sums.append(total)
        print(f"profile pass {n + 1} ({'cold' if n == 0 else 'warm'}): ops sum to "
              f"{total * 1e3:.1f} ms; profiling took {spent:.2f} s CPU")
    rows = {"eager_ms": cpu * 1e3, "profile_ms": [s * 1e3 for s in sums]}
    for name, ctx in (("before method 4", _as_before_method_4), ("now", contextlib.nullcontext)):
        with ctx():
            step = _run_model(ops, g.output_tensors(), 1 << 30)[0]
        rows[f"calibration_{name.replace(' ', '_')}_ms"] = step * 1e3
        print(f"calibration run ({name}): {step * 1e3:.1f} ms = {step / cpu:.2f}x the eager "
              f"step; factor over the cold profile {step / sums[0]:.2f}")
    print(json.dumps({"bench": "autodist_profile", **vars(args), **rows}))


if __name__ == "__main__":
    main()
