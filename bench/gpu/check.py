"""The one-GPU check: the CUDA paths of nnscaler, run and measured in one command.

Run it as ``bash bench/gpu/check.sh [--device cuda|cpu|auto]`` from anywhere (the shell
script sets the environment, then runs this file). Each check prints one line,
``PASS|FAIL|SKIP <name>: <figures>``; then the throughput table, a summary line, and the
JSON of every figure is written (``--json``, default ``$OUT/gpu_check.json`` where
``$OUT`` is set). The exit status is 1 when a check failed, 0 otherwise.

Checks (see bench/README.md, "GPU check", for what each figure means):

- ``cuda-tests``: the suite's tests marked ``@pytest.mark.cuda``, run by pytest in a
  subprocess (on CPU they all skip, and so does the check);
- ``parity-{gpt,llama}-{fp32,bf16}``: ``parallelize`` of the project's GPT and of a Hugging
  Face Llama (random weights) with a plan of one device, on the device: the loss and every
  gradient against the eager model on the same device;
- ``quickstart``: ``examples/quickstart/model.py``, unchanged, under
  ``torchrun --nproc_per_node=1`` (the Trainer, policy ``autodist``, 10 steps);
- ``autodist-estimate``: autodist profiles the GPT's ops on the device, plans one device,
  and its estimated step time is held against the measured step;
- ``measure-peak``: ``measure_peak`` of the autodist plugin against known allocations and
  against ``torch.cuda.max_memory_allocated`` of the same step (on CPU: its profiler path);
- ``compiled-codegen``: generated code under ``ComputeConfig(compile=...)`` (the
  ``--compile-backend``), GPT with a plan of one device: loss and gradients against the
  eager model, and its step time against the same generated code run eagerly;
- ``ring-flash``: ring and zigzag ring attention (4 parts on the one GPU) with
  flash-attention's block kernel, bf16: parity against float32 attention on the whole
  sequence, and its time against the ring on the math kernel (SKIP without
  ``flash_attn``);
- ``throughput``: a Llama of about 1 B parameters in bf16 with sdpa attention at sequence
  2048 (tiny on CPU) through the Trainer (a plan of one device), against a plain PyTorch
  loop and ``torch.compile`` of that loop on the same model and batch.

Each check runs under a time limit (``--limit-scale`` stretches them all), and all under
one budget (``--budget``, 540 s), so that a 10-minute call on a lent GPU ends with its
report; the whole GPU run is meant to take about 5 minutes on one H100.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the checks beside this file

from gpu_common import REPO, CheckTimeout, Context, Result  # noqa: E402

#: Packages a check needs beyond torch, pluggy, attrs, pyyaml and networkx (which the
#: project cannot run without), and what their absence costs.
OPTIONAL = {
    "numpy": "parallelize hashes and broadcasts weights through Tensor.numpy",
    "transformers": "the Llama models (parity-llama-*, throughput)",
    "pulp": "autodist's ILP solver (autodist-estimate plans with solver='dp' without it)",
    "pytest": "cuda-tests",
}


# -- environment ------------------------------------------------------------------------

def missing_packages() -> dict[str, str]:
    """The optional packages this interpreter lacks, with what each absence costs."""
    return {name: why for name, why in OPTIONAL.items()
            if importlib.util.find_spec(name) is None}


def _project(pyproject: Path) -> dict[str, Any]:
    """The ``[project]`` table of a ``pyproject.toml``."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(pyproject.read_text())["project"]


def _dist_info(folder: Path, pyproject: Path) -> str | None:
    """Write ``<name>-<version>.dist-info`` (METADATA and entry_points.txt) for the package
    of ``pyproject`` into ``folder``, as pip would; return its name, or None when it
    declares no entry points of the group ``nnscaler``."""
    project = _project(pyproject)
    points = project.get("entry-points", {}).get("nnscaler", {})
    if not points:
        return None
    name, version = project["name"], project["version"]
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{key} = {value}\n" for key, value in points.items())
    (info / "entry_points.txt").write_text(f"[nnscaler]\n{lines}")
    return name


def register_plugins(workdir: Path) -> str:
    """Make the in-tree plugins' entry points visible where they are not installed.

    nnscaler loads its built-in plugins by module name, but third-party ones (the plugins
    under ``plugins/``: ``autodist`` among them, the quickstart's default policy) only
    through entry points of installed distributions. Where the repository is merely on
    ``PYTHONPATH`` (a bare machine), this writes their ``dist-info`` into a folder that goes
    on ``sys.path`` and ``PYTHONPATH`` (so subprocesses see them too). Returns how the
    plugins were found."""
    pyprojects = sorted(REPO.glob("plugins/*/pyproject.toml"))
    absent = []
    for pyproject in pyprojects:
        try:
            importlib.metadata.distribution(_project(pyproject)["name"])
        except importlib.metadata.PackageNotFoundError:
            absent.append(pyproject)
    if not absent:
        return "installed"
    site = workdir / "entry-points"
    written = [n for p in absent if (n := _dist_info(site, p))]
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(site), str(REPO)] + [str(p.parent) for p in pyprojects]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    importlib.invalidate_caches()
    return f"from the source tree ({', '.join(written)}: entry points written to {site})"


def peak_bf16_tflops(name: str) -> float | None:
    """The dense bf16 peak of a GPU, from its name (datasheet figures), or None."""
    name = name.upper()
    if "H100" in name and "PCIE" in name:
        return 756.0
    if "H100" in name or "H200" in name or "H800" in name:
        return 989.4
    if "A100" in name or "A800" in name:
        return 312.0
    return None


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`CheckTimeout` in this (the main) thread after ``seconds``."""

    def expire(signum: int, frame: Any) -> None:
        raise CheckTimeout(f"ran past its limit of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# -- running ----------------------------------------------------------------------------

@dataclass
class Check:
    name: str
    run: Callable[[Context], list[Result]]
    limit_cpu: float  # seconds
    limit_cuda: float
    needs: tuple[str, ...] = ()
    names: tuple[str, ...] = ()  # the result names, when not just ``name``


def all_checks() -> list[Check]:
    from gpu_checks import autodist_estimate, cuda_tests, measure_peak_check, parity, quickstart
    from gpu_compile import compiled_codegen
    from gpu_ring import ring_flash
    from gpu_throughput import throughput

    return [
        Check("cuda-tests", cuda_tests, 60, 120, needs=("pytest",)),
        Check("parity", parity, 90, 120, needs=("numpy",), names=tuple(
            f"parity-{m}-{d}" for m in ("gpt", "llama") for d in ("fp32", "bf16"))),
        Check("quickstart", quickstart, 120, 120, needs=("numpy",)),
        Check("autodist-estimate", autodist_estimate, 90, 90, needs=("numpy",)),
        Check("measure-peak", measure_peak_check, 30, 30),
        Check("compiled-codegen", compiled_codegen, 90, 120, needs=("numpy",)),
        Check("ring-flash", ring_flash, 30, 90),
        Check("throughput", throughput, 120, 300, needs=("numpy", "transformers")),
    ]


#: Seconds a check is given at least; with less of the run's budget left it does not start.
MIN_LIMIT = 10.0


def run_check(check: Check, ctx: Context, scale: float, left: float) -> list[Result]:
    """Run one check under its limit (never past ``left``, what remains of the run's
    budget); a raise or a timeout is a FAIL line."""
    missing = [p for p in check.needs if p in ctx.missing]
    names = check.names or (check.name,)
    if missing:
        return [Result("SKIP", n, f"needs {', '.join(missing)}, not installed "
                                  f"(carry its wheel: bench/README.md, 'GPU check')")
                for n in names]
    limit = min((check.limit_cuda if ctx.cuda else check.limit_cpu) * scale, left)
    if left < MIN_LIMIT:
        return [Result("FAIL", n, f"not run: {left:.0f} s of the run's budget (--budget) "
                                  f"left") for n in names]
    t0 = time.perf_counter()
    try:
        with time_limit(limit):
            results = check.run(ctx)
    except Exception as e:  # noqa: BLE001 - every failure is a FAIL line, and the run goes on
        detail = traceback.format_exc(limit=-4)
        print(detail, file=sys.stderr)
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        results = [Result("FAIL", n, f"{type(e).__name__}: {first}",
                          {"error": f"{type(e).__name__}: {e}", "traceback": detail})
                   for n in names]
    finally:
        gc.collect()  # the check's models, before the next check measures memory or time
        if ctx.cuda:
            import torch

            torch.cuda.empty_cache()
    seconds = time.perf_counter() - t0
    for r in results:
        r.seconds = round(seconds / len(results), 2)
    return results


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "device": device, "torch": torch.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda, "host": platform.node(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count)
    for pkg in ("transformers", "numpy", "pulp", "pytest"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            env[pkg] = importlib.metadata.version(pkg)
    return env


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temp file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, default=str)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where to run (auto: cuda when available)")
    parser.add_argument("--only", default="",
                        help="comma-separated checks to run (default: all): "
                             "cuda-tests,parity,quickstart,autodist-estimate,measure-peak,"
                             "compiled-codegen,ring-flash,throughput")
    parser.add_argument("--json", default=None,
                        help="where to write the figures (default: $OUT/gpu_check.json "
                             "when $OUT is set, else nowhere)")
    parser.add_argument("--limit-scale", type=float, default=1.0,
                        help="multiply every check's time limit by this")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for all the checks together (default 540, so that a "
                             "10-minute call ends with its report); a check gets at most "
                             "what is left")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak for MFU (default: from the GPU's "
                             "name; H100 SXM and H200 989.4)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per mode of autodist-estimate and throughput "
                             "(default 10 on CUDA, 3 on CPU)")
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile's backend in the compiled-codegen and throughput checks (default: "
                             "inductor on CUDA, aot_eager on CPU)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    import torch

    device = ns.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda, but torch {torch.__version__} sees no CUDA device "
              f"(torch.cuda.is_available() is False). Fix: run on a GPU machine, or pass "
              f"--device cpu.", file=sys.stderr)
        return 2
    checks = all_checks()
    only = [n.strip() for n in ns.only.split(",") if n.strip()]
    unknown = sorted(set(only) - {c.name for c in checks})
    if unknown:
        print(f"--only names {unknown}, which are not checks; the checks are "
              f"{[c.name for c in checks]}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="nnscaler-gpu-check-"))
    os.environ["NNSCALER_DEVICE"] = device
    # autodist's profiles and the custom-op cache: fresh, so the device is profiled now
    os.environ["NNSCALER_CACHE_DIR"] = str(workdir / "cache")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    plugins = register_plugins(workdir)
    env = environment(device)
    missing = missing_packages()
    name = env.get("gpu", "")
    ctx = Context(device=device, workdir=workdir, missing=missing,
                  peak_tflops=ns.peak_tflops or (peak_bf16_tflops(name) if name else None),
                  steps=ns.steps, compile_backend=ns.compile_backend
                  or ("inductor" if device == "cuda" else "aot_eager"))
    print(f"nnscaler GPU check on {device}"
          + (f" ({name}, {env['gpu_memory_gib']} GiB)" if name else "")
          + f": torch {env['torch']}, python {env['python']}; plugins {plugins}")
    for pkg, why in missing.items():
        print(f"missing package {pkg}: {why}")
    out = ns.json or (os.path.join(os.environ["OUT"], "gpu_check.json")
                      if os.environ.get("OUT") else None)
    results: list[Result] = []
    t0 = time.perf_counter()

    def report() -> dict[str, int]:
        """The counts so far; the JSON rewritten (after every check: a run stopped from
        outside still leaves the figures of the checks that ended)."""
        counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
        if out:
            write_json(Path(out), {
                "environment": env, "missing": missing, "plugins": plugins,
                "wall_seconds": round(time.perf_counter() - t0, 1), "summary": counts,
                "checks": [{"name": r.name, "status": r.status, "line": r.line,
                            "seconds": r.seconds, "figures": r.figures} for r in results]})
        return counts

    try:
        for check in checks:
            if only and check.name not in only:
                continue
            left = ns.budget - (time.perf_counter() - t0)
            for r in run_check(check, ctx, ns.limit_scale, left):
                print(r.text(), flush=True)
                results.append(r)
            report()
    finally:
        if not ns.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    wall = time.perf_counter() - t0
    table = next((r.figures.get("table") for r in results if r.name == "throughput"), None)
    if table:
        print(table)
    counts = report()
    print(f"summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} "
          f"skipped in {wall:.1f} s on {device}" + (f" ({name})" if name else ""))
    if out:
        print(f"figures written to {out}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
