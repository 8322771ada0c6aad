"""The plan report (logged at INFO) and, with the ``[plot]`` extra, a picture of the plan."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from nnscaler_policy_autodist.config import AutoDistError

if TYPE_CHECKING:
    from nnscaler_policy_autodist.policy import AutoDistResult

__all__ = ["plot", "text"]

TOP = 5
GB = 1024**3


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def text(result: AutoDistResult, top: int = TOP) -> str:
    """Estimated step time (compute / communication), memory per device against the
    limit, per stage; the costliest ops with their split and model source line."""
    pipe = result.pipeline
    lines = [
        f"autodist plan for plan_ngpus={result.plan_ngpus}: {pipe.nstages} stage(s) x "
        f"{pipe.k} device(s), {pipe.nmicros} micro-batch(es), searched in "
        f"{result.search_seconds:.2f} s ({result.profiled} op parts profiled, the rest "
        f"cached or estimated)",
        f"  data parallel over {result.replicas} scale unit(s), ZeRO stage "
        f"{result.zero_stage} (counted in the memory and the step time"
        + (", chosen by zero_stage='auto')" if result.zero_stages else ")"),
        f"  estimated step time {_ms(pipe.step_time)}"
        + (f" ({pipe.scheduler}: sum of stages + (micro-batches - 1) x slowest)"
           if pipe.nstages > 1 else ""),
    ]
    lines += _meshes(result, top)
    lines += [f"    ZeRO {e.describe(result.limit)}" for e in result.zero_stages]
    limit = "none" if result.limit is None else f"{result.limit / GB:.3f} GB"
    for s, (problem, sol) in enumerate(zip(result.problems, result.solutions)):
        devices = f"{s * pipe.k}..{(s + 1) * pipe.k - 1}" if pipe.k > 1 else f"{s * pipe.k}"
        lines.append(
            f"  stage {s} on devices {devices} ({sol.solver}): {_ms(sol.time)} per micro-batch "
            f"= compute {_ms(sol.time - sol.comm)} + communication {_ms(sol.comm)}; memory "
            f"{sol.mem / GB:.4f} GB per device (limit {limit})")
        costs = []
        for i, op in enumerate(problem.ops):
            o = problem.options[i][sol.choice[i]]
            edges = sum(e.cost[sol.choice[e.src]][sol.choice[e.dst]]
                        for e in problem.edges if e.dst == i)
            costs.append((o.time + edges, o.compute, o.comm + edges, op,
                          o.describe() if problem.k > 1 else "whole"))
        costs.sort(key=lambda c: -c[0])
        for total, comp, comm, op, how in costs[:top]:
            code = f" `{op.code.strip()}`" if op.code else ""
            lines.append(f"    {_ms(total)} (compute {_ms(comp)}, comm {_ms(comm)}) "
                         f"{op.name} in {op.module_path or '<root>'}: {how} "
                         f"at {op.short_source}{code}")
    return "\n".join(lines)


def _meshes(result: AutoDistResult, top: int) -> list[str]:
    """``plan_ngpus='auto'``: the chosen mesh and the ``top`` best alternatives."""
    if not result.meshes:
        return []
    chosen, *others = result.meshes
    runtime = chosen.replicas * chosen.unit
    lines = [f"  mesh: {chosen.describe()} (plan_ngpus='auto': chosen from {len(result.meshes)} "
             f"factorisation(s) of runtime_ngpus={runtime} by estimated time per batch = step "
             f"time / replicas)"]
    for tag, m in [("chosen", chosen), *(("", m) for m in others[:top])]:
        if m.fits:
            est = (f"step {_ms(m.step_time)}, per batch {_ms(m.time_per_batch)}, "
                   f"memory {m.memory / GB:.4f} GB per device")
        elif m.pruned == "time":
            est = f"not searched: at least {_ms(m.bound)} per batch (lower bound)"
        elif m.pruned == "memory":
            est = (f"not searched: weights and activations need at least "
                   f"{m.memory / GB:.4f} GB per device")
        else:
            est = f"no plan fits: needs {m.memory / GB:.4f} GB per device"
        lines.append(f"    {tag:6} {m.describe()}: {est}")
    return lines


def plot(result: AutoDistResult, path: Path | str) -> Path:
    """Save a picture of the plan: which devices run which layers (time per stage and
    device), how each large op is split, and the pipeline schedule as a timeline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AutoDistError(
            "policy 'autodist': pas_config['plot_path'] asks for a picture of the plan, "
            "which needs matplotlib: pip install 'nnscaler-policy-autodist[plot]'") from None
    pipe = result.pipeline
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 9))
    for s, sol in enumerate(result.solutions):
        ax1.barh([f"stage {s}\ndev {s * pipe.k}-{(s + 1) * pipe.k - 1}"],
                 [(sol.time - sol.comm) * 1e3], color="tab:blue")
        ax1.barh([f"stage {s}\ndev {s * pipe.k}-{(s + 1) * pipe.k - 1}"], [sol.comm * 1e3],
                 left=[(sol.time - sol.comm) * 1e3], color="tab:orange")
    ax1.set_xlabel("ms per micro-batch (blue: compute, orange: communication)")
    big = []
    for problem, sol in zip(result.problems, result.solutions):
        for i, op in enumerate(problem.ops):
            o = problem.options[i][sol.choice[i]]
            big.append((o.compute, f"{op.module_path or op.name} ({o.describe()})"))
    big.sort(reverse=True)
    ax2.barh([b[1][:70] for b in big[:12]][::-1], [b[0] * 1e3 for b in big[:12]][::-1])
    ax2.set_xlabel("ms: the largest ops and how each is split")
    times = [sol.time for sol in result.solutions]
    t = 0.0
    for m in range(pipe.nmicros):
        for s, st in enumerate(times):
            start = sum(times[:s]) + m * max(times)
            ax3.barh([f"stage {s}"], [st * 1e3], left=[start * 1e3], color=f"C{m % 10}")
            t = max(t, start + st)
    ax3.set_xlabel("ms: pipeline timeline of the micro-batches (forward+backward blocks)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
