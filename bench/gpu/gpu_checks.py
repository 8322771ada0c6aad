"""The checks of ``bench/gpu/check.py`` but the throughput table (``gpu_throughput.py``).

Each check takes the :class:`gpu_common.Context` and returns its result lines. Sizes are
small on CPU (the test suite runs them on 2 cores) and larger on CUDA, where they are
still chosen to finish in seconds.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_common import REPO, Context, Result, timeout_in
from torch import nn

# -- models and batches -----------------------------------------------------------------

GPT_SIZES = {
    "cpu": dict(vocab_size=96, n_layer=2, n_head=4, d_model=32, seq_len=16),
    "cuda": dict(vocab_size=1024, n_layer=4, n_head=8, d_model=256, seq_len=128),
}
LLAMA_SIZES = {
    "cpu": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                max_position_embeddings=64),
    "cuda": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
                 max_position_embeddings=256),
}
SEQ = {"cpu": 16, "cuda": 128}
BATCH = {"cpu": 2, "cuda": 4}

#: Gradient tolerances of the parity checks, as ||grad - eager|| / ||eager|| per tensor.
#: fp32: the project's parity rule (rtol 1e-5). bf16 keeps 8 significant bits (unit
#: roundoff 2**-9, about 2e-3): the same ops in another valid order of summation move a
#: result by a few units of roundoff, so 1e-2 (five units) separates reordering from a
#: wrong gradient, which differs by O(1).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


class LlamaLM(nn.Module):
    """A Hugging Face ``LlamaForCausalLM`` (random weights, sdpa attention) whose forward
    takes ``{'input_ids', 'labels'}`` and returns the loss. Keyword arguments are the
    ``LlamaConfig``'s."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        import transformers

        cfg = transformers.LlamaConfig(**config)
        cfg._attn_implementation = "sdpa"
        self.model = transformers.LlamaForCausalLM(cfg)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def token_batch(vocab: int, batch: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens, labels the inputs shifted by one (Llama shifts them itself)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def make_model(kind: str, device: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A seeded model on CPU in fp32 and a batch for it: ``gpt`` or ``llama``."""
    torch.manual_seed(0)
    if kind == "gpt":
        from nnscaler.models import GPTConfig, GPTWithLoss
        from nnscaler.models.gpt import make_batch

        model = GPTWithLoss(GPTConfig(**GPT_SIZES[device]))
        return model, make_batch(model.gpt.config, BATCH[device])
    size = LLAMA_SIZES[device]
    return LlamaLM(**size), token_batch(size["vocab_size"], BATCH[device], SEQ[device])


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_of(ctx: Context) -> torch.device:
    from nnscaler.runtime import current_device

    return current_device(ctx.device)


def time_steps(step: Callable[[], Any], device: torch.device, warmup: int,
               steps: int) -> tuple[list[float], Any]:
    """Seconds of each of ``steps`` calls of ``step`` after ``warmup`` untimed ones (the
    device synchronized around each), and the first call's result."""
    first = None
    for i in range(warmup):
        out = step()
        if i == 0:
            first = out
    sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = step()
        sync(device)
        times.append(time.perf_counter() - t0)
        if first is None:
            first = out
    return times, first


# -- cuda-tests -------------------------------------------------------------------------

def _marked_files() -> list[str]:
    """The test files that use ``@pytest.mark.cuda``, relative to the repository."""
    found = []
    for pattern in ("tests/**/test_*.py", "plugins/*/tests/**/test_*.py"):
        for path in REPO.glob(pattern):
            if "pytest.mark.cuda" in path.read_text():
                found.append(str(path.relative_to(REPO)))
    return sorted(found)


def run_command(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float
                ) -> tuple[int, str]:
    """Run ``cmd`` in a session of its own; on a timeout (or this check's own limit) end
    that session's processes (torchrun's workers too). Returns the status and the output
    (stdout and stderr together)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except BaseException:
        with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise


def _pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line (``1 passed, 2 skipped in 3.1s``)."""
    lines = [ln for ln in output.splitlines() if re.search(r"\d+ \w+.* in [\d.]+s", ln)]
    if not lines:
        return {}
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", lines[-1])}


def cuda_tests(ctx: Context) -> list[Result]:
    files = _marked_files()
    if not files:
        return [Result("FAIL", "cuda-tests", "no test file uses @pytest.mark.cuda: the "
                                             "marker or the search is broken")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
           *files]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    rc, out = run_command(cmd, REPO, env, timeout=600)
    counts = _pytest_counts(out)
    figures = {"files": files, "counts": counts, "returncode": rc,
               "seconds": round(time.perf_counter() - t0, 1), "output_tail": out[-3000:]}
    shown = ", ".join(f"{n} {w}" for w, n in counts.items()) or "no summary"
    where = f"{len(files)} file{'s' * (len(files) > 1)}"
    if rc == 0 and counts.get("passed", 0) and not counts.get("skipped", 0):
        return [Result("PASS", "cuda-tests", f"{shown} ({where}, pytest -m cuda)", figures)]
    if rc == 0 and not ctx.cuda and counts.get("skipped", 0) and not counts.get("passed"):
        return [Result("SKIP", "cuda-tests", f"no CUDA device: pytest -m cuda collected and "
                                             f"skipped them ({shown}; {where})", figures)]
    print(out[-3000:], file=sys.stderr)
    return [Result("FAIL", "cuda-tests", f"pytest exit {rc}: {shown} ({where}; the output's "
                                         f"end is in the JSON)", figures)]


# -- parity -----------------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    den = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num / den if den else num


def _parity_one(ctx: Context, kind: str, dtype: torch.dtype) -> Result:
    from nnscaler import ComputeConfig, parallelize

    dev = device_of(ctx)
    name = f"parity-{kind}-{'fp32' if dtype == torch.float32 else 'bf16'}"
    model, batch = make_model(kind, ctx.device)
    model = model.to(dtype)
    eager = copy.deepcopy(model).to(dev)
    pm = parallelize(model, {"batch": batch}, "dp", ComputeConfig(plan_ngpus=1, runtime_ngpus=1),
                     gen_savedir=str(ctx.workdir / "gen"), instance_name=name)
    data = to_device(batch, dev)
    ref_params = dict(eager.named_parameters(remove_duplicate=False))
    metas = [(attr, m) for attr, m in pm.fullmap.items() if m.kind == "parameter"]
    placed = {str(getattr(pm, attr).device) for attr, _ in metas}
    same_start = all(torch.equal(getattr(pm, a), ref_params[m.orig_name]) for a, m in metas)
    ref_loss = eager(data)
    ref_loss.backward()
    loss = pm(data)
    loss.backward()
    pm.sync_grad()
    sync(dev)
    errs = {m.orig_name: _rel(getattr(pm, a).grad, ref_params[m.orig_name].grad)
            for a, m in metas}
    bitwise = sum(torch.equal(getattr(pm, a).grad, ref_params[m.orig_name].grad)
                  for a, m in metas)
    tol = TOLERANCE[dtype]
    loss_err = _rel(loss, ref_loss)
    worst = max(errs, key=errs.get)
    figures = {"loss": loss.item(), "eager_loss": ref_loss.item(), "loss_rel_err": loss_err,
               "grads": len(errs), "bitwise_grads": bitwise, "max_grad_rel_err": errs[worst],
               "worst_grad": worst, "tolerance": tol, "devices": sorted(placed),
               "same_initial_weights": same_start}
    ok = (same_start and placed == {str(dev)} and loss_err <= tol
          and errs[worst] <= tol and all(math.isfinite(e) for e in errs.values()))
    line = (f"loss {loss.item():.6f} vs eager {ref_loss.item():.6f} (rel {loss_err:.1e}); "
            f"{len(errs)} grads, {bitwise} bitwise, max rel {errs[worst]:.1e} ({worst}); "
            f"tol {tol:g}; on {', '.join(sorted(placed))}")
    if not same_start:
        line += "; the module did not start from the eager weights"
    return Result("PASS" if ok else "FAIL", name, line, figures)


def parity(ctx: Context) -> list[Result]:
    out = []
    spent = None  # the check's time limit, once it has passed
    for kind in ("gpt", "llama"):
        for dtype in (torch.float32, torch.bfloat16):
            name = f"parity-{kind}-{'fp32' if dtype == torch.float32 else 'bf16'}"
            if spent is not None:
                out.append(Result("FAIL", name, f"not run: {spent}"))
            elif kind == "llama" and "transformers" in ctx.missing:
                out.append(Result("SKIP", name, "needs transformers, not installed"))
            else:
                try:
                    out.append(_parity_one(ctx, kind, dtype))
                except Exception as e:  # noqa: BLE001 - one failure does not hide the others
                    import traceback

                    traceback.print_exc()
                    spent = timeout_in(e)
                    text = str(e).strip().splitlines()
                    out.append(Result("FAIL", name, f"{type(e).__name__}: "
                                                    f"{text[0][:300] if text else ''}",
                                      {"error": f"{type(e).__name__}: {e}"}))
    return out


# -- quickstart -------------------------------------------------------------------------

def quickstart(ctx: Context) -> list[Result]:
    run = ctx.workdir / "quickstart"
    run.mkdir()
    shutil.copy(REPO / "examples" / "quickstart" / "model.py", run / "model.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=1", "--monitor-interval=0.2", "model.py"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    rc, out = run_command(cmd, run, env, timeout=300)
    wall = time.perf_counter() - t0
    done = "Reached max train steps(10): Training is done." in out
    folder = run / "checkpoints" / "0000-0010"
    files = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    losses = re.findall(r"train_loss=([\d.]+)", out)
    speed = re.findall(r"samples_per_sec=([\d.]+)", out)
    figures = {"returncode": rc, "seconds": round(wall, 1), "finished": done,
               "checkpoint": files, "train_loss": float(losses[-1]) if losses else None,
               "samples_per_sec": float(speed[-1]) if speed else None,
               "output_tail": out[-3000:]}
    ok = rc == 0 and done and files == ["0.ckpt", "meta.json"]
    if not ok:
        print(out[-3000:], file=sys.stderr)
    line = (f"torchrun --nproc_per_node=1 examples/quickstart/model.py: exit {rc}, "
            f"{'10 steps' if done else 'did not finish'}, train_loss "
            f"{figures['train_loss']}, checkpoint {files or 'missing'}, {wall:.1f} s")
    return [Result("PASS" if ok else "FAIL", "quickstart", line, figures)]


# -- autodist-estimate ------------------------------------------------------------------

AUTODIST_GPT = {
    "cpu": dict(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=64),
    "cuda": dict(vocab_size=8192, n_layer=8, n_head=16, d_model=1024, seq_len=512),
}
AUTODIST_BATCH = {"cpu": 4, "cuda": 8}
#: The band of estimate / measured step time that passes, by device. The cost model sums
#: op times profiled one by one (calibrated against a whole forward and backward of the
#: model). On a GPU, which nothing else shares, within a factor of 2 it ranks plans
#: usefully, and a ratio outside says the profile does not describe the device. On a
#: shared CPU the profile and the timed steps see different loads (2 cores, other jobs):
#: a factor of 4 there still catches a profile of the wrong device or unit.
ESTIMATE_BAND = {"cuda": (0.5, 2.0), "cpu": (0.25, 4.0)}


def autodist_estimate(ctx: Context) -> list[Result]:
    from nnscaler_policy_autodist import plan_graph

    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.models import GPTConfig, GPTWithLoss
    from nnscaler.models.gpt import make_batch

    dev = device_of(ctx)
    solver = "dp" if "pulp" in ctx.missing else "auto"
    profile_dir = ctx.workdir / "autodist-profile"
    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(**AUTODIST_GPT[ctx.device]))
    batch = make_batch(model.gpt.config, AUTODIST_BATCH[ctx.device])
    captured: dict[str, Any] = {}

    def policy(graph: Any, compute_config: Any) -> Any:
        g, result = plan_graph(graph, compute_config)
        captured["result"] = result
        return g

    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=1, use_end2end=True,
                        pas_config={"profile_dir": str(profile_dir), "solver": solver})
    t0 = time.perf_counter()
    pm = parallelize(model, {"batch": batch}, policy, cfg,
                     gen_savedir=str(ctx.workdir / "gen"), instance_name="autodist_gpt")
    plan_s = time.perf_counter() - t0
    result = captured["result"]
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-4)
    data = to_device(batch, dev)

    def step() -> torch.Tensor:
        loss = pm.train_step([data])[0]
        opt.step()
        return loss

    steps = ctx.steps or (10 if ctx.cuda else 3)
    times, _ = time_steps(step, dev, warmup=2, steps=steps)
    measured = statistics.median(times)
    estimate = result.pipeline.step_time
    ratio = estimate / measured
    band = ESTIMATE_BAND[ctx.device]
    profiles = sorted(p.name for p in profile_dir.rglob("*") if p.is_file())
    figures = {"estimate_ms": estimate * 1e3, "measured_ms": measured * 1e3,
               "estimate_over_measured": ratio, "band": band,
               "step_ms": [t * 1e3 for t in times], "profiled_ops": result.profiled,
               "profile_files": profiles, "solver": solver, "plan_seconds": round(plan_s, 1),
               "search_seconds": round(result.search_seconds, 2),
               "model": AUTODIST_GPT[ctx.device], "batch": AUTODIST_BATCH[ctx.device]}
    ok = band[0] <= ratio <= band[1] and bool(profiles)
    line = (f"estimate {estimate * 1e3:.2f} ms vs measured {measured * 1e3:.2f} ms "
            f"(median of {steps}): ratio {ratio:.2f}, band {band[0]}-{band[1]}; {result.profiled} ops profiled on {dev} "
            f"({', '.join(profiles) or 'no profile written'}); solver {solver}; "
            f"planned in {plan_s:.1f} s")
    return [Result("PASS" if ok else "FAIL", "autodist-estimate", line, figures)]


# -- measure-peak -----------------------------------------------------------------------

def measure_peak_check(ctx: Context) -> list[Result]:
    from nnscaler_policy_autodist.memory import measure_peak, tensor_bytes

    from nnscaler.models import GPTConfig, GPTWithLoss
    from nnscaler.models.gpt import make_batch

    dev = device_of(ctx)
    problems: list[str] = []
    # 1. a known allocation: two blocks of n bytes alive together, both freed
    n = 4 << 20  # a multiple of the CUDA allocator's 512-byte rounding
    held = torch.ones(1 << 18, device=dev)  # 1 MiB that persists

    def two_blocks() -> None:
        a = torch.empty(n, dtype=torch.uint8, device=dev)
        b = torch.empty(n, dtype=torch.uint8, device=dev)
        del a, b

    gc.collect()  # what earlier checks left in cycles goes now, not during the step
    sync(dev)
    before = torch.cuda.memory_allocated(dev) if ctx.cuda else tensor_bytes(held)
    known = measure_peak(two_blocks, held, device=dev)[1]
    if known.transient != 2 * n:
        problems.append(f"known step: transient {known.transient} B, expected {2 * n}")
    if known.resident != before:
        problems.append(f"known step: resident {known.resident} B, expected {before}")
    if known.end != known.resident:
        problems.append(f"known step: end {known.end} B != resident {known.resident}")
    # 2. a training step of the GPT, measured twice, then read from the allocator directly
    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(**GPT_SIZES[ctx.device])).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = to_device(make_batch(model.gpt.config, BATCH[ctx.device]), dev)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = model(batch)
        loss.backward()
        opt.step()
        return loss.detach()

    step()  # gradients and optimizer state exist from here on
    # the step's result (the loss) is dropped at once: kept, it would be resident after
    first = measure_peak(step, model, opt, batch)[1]
    second = measure_peak(step, model, opt, batch)[1]
    figures: dict[str, Any] = {
        "method": first.method, "known_bytes": 2 * n, "known_transient": known.transient,
        "step_resident": first.resident, "step_peak": first.peak,
        "step_transient": first.transient, "second_peak": second.peak,
        "unaccounted": first.unaccounted}
    if first.peak != second.peak:
        problems.append(f"the same step measured {first.peak} B then {second.peak} B")
    if ctx.cuda:
        gc.collect()
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        step()
        sync(dev)
        direct = torch.cuda.max_memory_allocated(dev)
        figures.update(direct_peak=direct, direct_resident=base)
        if (direct, base) != (first.peak, first.resident):
            problems.append(f"torch.cuda.max_memory_allocated read {direct} B from "
                            f"{base} B resident; measure_peak {first.peak} B from "
                            f"{first.resident} B")
        against = f"= max_memory_allocated {direct / 2**20:.2f} MiB"
    else:
        counted = tensor_bytes(model, opt, batch)
        figures.update(counted_resident=counted)
        if first.unaccounted or first.resident != counted:
            problems.append(f"CPU path: resident {first.resident} B vs {counted} B "
                            f"counted, {first.unaccounted} B unaccounted")
        against = f"unaccounted {first.unaccounted} B"
    if first.transient <= 0:
        problems.append(f"the training step allocated nothing ({first.transient} B)")
    figures["problems"] = problems
    line = (f"known 2x{n >> 20} MiB step: transient {known.transient / 2**20:.2f} MiB; "
            f"GPT step peak {first.peak / 2**20:.2f} MiB ({first.transient / 2**20:.2f} "
            f"transient) {against}; {first.method}")
    if problems:
        line += "; " + "; ".join(problems)
    return [Result("FAIL" if problems else "PASS", "measure-peak", line, figures)]
