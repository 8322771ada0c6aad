"""The pipeline solver: how many stages, where to cut, each stage's devices.

For ``s`` stages of ``k = plan_ngpus / s`` devices each, the ops are first solved as one
stage of ``k`` devices without a memory limit (repeated blocks tied, so this is cheap);
each op's share of that solution (its option's time and the edges into it, its
weights and activations) prices every run of layers. A dynamic program over the layer
boundaries (the module path up to its first index: ``gpt.blocks.3``) then finds the cuts
that make the slowest stage fastest with every stage within the memory limit, where
stage ``i`` of a 1F1B schedule keeps the activations of ``s - i`` micro-batches (GPipe:
all of them). Each stage is then solved alone, exactly, under the limit. The step time
of ``m`` micro-batches is modelled as ``sum(stage times) + (m - 1) * max(stage times)``;
one stage runs them one after the other, ``m * time``. ``pipeline_nstages='auto'`` tries
every divisor of ``plan_ngpus`` (pipelines only when ``pipeline_nmicros`` is given) and
keeps the fastest.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import attrs

from nnscaler.extend import Op, SubTensor, layer_path
from nnscaler_policy_autodist.config import AutoDistConfig, AutoDistError
from nnscaler_policy_autodist.mesh import SLACK
from nnscaler_policy_autodist.model import CostModel, StageProblem
from nnscaler_policy_autodist.spmd import NoPlanFits, Solution, evaluate, solve

__all__ = ["PipelinePlan", "count_layers", "inflight", "search_pipeline",
           "search_pipeline_bounded", "stage_counts", "stages_time", "step_time"]

logger = logging.getLogger("nnscaler.autodist.pipeline")  # under nnscaler's loggers


@attrs.frozen
class PipelinePlan:
    """``starts``: the index (in program order) of each stage's first op; each stage runs
    on ``k`` devices (stage ``s`` on devices ``s*k .. s*k+k-1``)."""

    starts: tuple[int, ...]
    k: int
    nmicros: int
    scheduler: str
    step_time: float

    @property
    def nstages(self) -> int:
        return len(self.starts)


def inflight(scheduler: str, nstages: int, stage: int, nmicros: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once."""
    if nstages == 1:
        return 1
    if scheduler == "gpipe":
        return nmicros
    return max(1, min(nmicros, nstages - stage))


def step_time(times: Sequence[float], nmicros: int, computes: Sequence[float] | None = None,
              share: float = 1.0) -> float:
    """1F1B: the first micro-batch passes every stage, the rest follow at the slowest
    stage's pace; one stage: ``nmicros`` times its time.

    ``share``: processes per core (four one-thread ranks on two cores: 2). Op times are
    measured with every rank computing, each at ``1 / share`` of a core; a pipeline's
    ranks wait for each other part of the time and leave their core to the others, so
    its stages' computation (``computes``, per micro-batch, of ``times``) runs up to
    ``share`` times faster, bounded by what the cores can do: the step is the larger of
    the 1F1B latency at that speed and every rank's computation over the cores."""
    if len(times) == 1:
        return nmicros * times[0]
    latency = sum(times) + (nmicros - 1) * max(times)
    if share <= 1.0 or computes is None:
        return latency
    fast = [t - c * (1.0 - 1.0 / share) for t, c in zip(times, computes, strict=True)]
    return max(sum(fast) + (nmicros - 1) * max(fast), nmicros * sum(computes) / len(computes))


def _shares(problem: StageProblem, sol: Solution) -> tuple[list[float], list[float], list[float]]:
    """Per op: its time (option and edges into it), weights bytes, activation bytes."""
    n = len(problem.ops)
    time = [problem.options[i][sol.choice[i]].time for i in range(n)]
    weights = [problem.options[i][sol.choice[i]].mem - problem.options[i][sol.choice[i]].act
               for i in range(n)]
    act = [problem.options[i][sol.choice[i]].act for i in range(n)]
    for e in problem.edges:
        time[e.dst] += e.cost[sol.choice[e.src]][sol.choice[e.dst]]
    return time, weights, act


def count_layers(ops: Sequence[Op]) -> int:
    """The layers a pipeline may cut between: layer starts plus one (0 without layers)."""
    paths = [layer_path(op) for op in ops]
    starts = sum(1 for i in range(1, len(ops)) if paths[i] != paths[i - 1] and paths[i])
    return starts + 1 if starts else 0


def _cuts(ops: Sequence[Op], nstages: int) -> list[int]:
    """Positions where a stage may start: where a new layer begins."""
    paths = [layer_path(op) for op in ops]
    allowed = [i for i in range(1, len(ops)) if paths[i] != paths[i - 1] and paths[i]]
    return allowed if len(allowed) >= nstages - 1 else list(range(1, len(ops)))


def _best_cuts(ops: Sequence[Op], nstages: int, time: list[float], weights: list[float],
               act: list[float], limit: float | None, scheduler: str, nmicros: int,
               by_memory: bool = False) -> tuple[list[int], float] | None:
    """Stage starts minimising the slowest stage with every stage in ``limit``
    (``by_memory``: minimising the largest stage memory instead)."""
    bounds = [0, *_cuts(ops, nstages), len(ops)]
    pre_t = [0.0]
    pre_w = [0.0]
    pre_a = [0.0]
    for i in range(len(ops)):
        pre_t.append(pre_t[-1] + time[i])
        pre_w.append(pre_w[-1] + weights[i])
        pre_a.append(pre_a[-1] + act[i])
    m = len(bounds)
    inf = math.inf
    best = [[inf] * m for _ in range(nstages + 1)]
    back = [[0] * m for _ in range(nstages + 1)]
    best[0][0] = 0.0
    for j in range(1, nstages + 1):
        held = inflight(scheduler, nstages, j - 1, nmicros)
        for b in range(1, m):
            for a in range(b):
                if best[j - 1][a] == inf:
                    continue
                lo, hi = bounds[a], bounds[b]
                mem = pre_w[hi] - pre_w[lo] + held * (pre_a[hi] - pre_a[lo])
                if limit is not None and mem > limit:
                    continue
                cost = max(best[j - 1][a], mem if by_memory else pre_t[hi] - pre_t[lo])
                if cost < best[j][b]:
                    best[j][b], back[j][b] = cost, a
    if best[nstages][m - 1] == inf:
        return None
    starts = []
    b = m - 1
    for j in range(nstages, 0, -1):
        b = back[j][b]
        starts.append(bounds[b])
    return sorted(starts), best[nstages][m - 1]


def _plan_for(ops: Sequence[Op], n: int, s: int, model: CostModel, cfg: AutoDistConfig,
              limit: float | None, nmicros: int, outs: set
              ) -> tuple[PipelinePlan, list[StageProblem], list[Solution]]:
    k = n // s
    if s == 1:
        problem = model.build(ops, k, outs)
        sol = solve(problem, limit, cfg.solver, 1, verbose=cfg.verbose)
        return (PipelinePlan((0,), k, nmicros, cfg.pipeline_scheduler,
                             step_time([sol.time], nmicros)), [problem], [sol])
    whole = model.build(ops, k, outs)
    sol = solve(whole, None, cfg.solver, 1, verbose=cfg.verbose)
    time, weights, act = _shares(whole, sol)
    found = _best_cuts(ops, s, time, weights, act, limit, cfg.pipeline_scheduler, nmicros)
    if found is None:
        least = _best_cuts(ops, s, time, weights, act, None, cfg.pipeline_scheduler, nmicros,
                           by_memory=True)
        raise NoPlanFits(least[1] if least else math.inf, limit or 0.0)
    starts, _ = found
    bounds = [*starts, len(ops)]
    problems, sols = [], []
    for idx in range(s):
        problem = _slice(whole, bounds[idx], bounds[idx + 1])
        held = inflight(cfg.pipeline_scheduler, s, idx, nmicros)
        problems.append(problem)
        mine = evaluate(problem, sol.choice[bounds[idx]:bounds[idx + 1]], held, sol.solver)
        if limit is None or mine.mem <= limit:  # the whole's choice fits: it is the best
            sols.append(mine)
        else:
            sols.append(solve(problem, limit, cfg.solver, held, verbose=cfg.verbose))
    sols = [attrs.evolve(x, time=x.time + extra, comm=x.comm + extra)
            for x, extra in zip(sols, _sends(whole, sol.choice, bounds, model))]
    return (PipelinePlan(tuple(starts), k, nmicros, cfg.pipeline_scheduler,
                         stages_time(sols, nmicros, model.share)), problems, sols)


def stages_time(sols: Sequence[Solution], nmicros: int, share: float = 1.0) -> float:
    """`step_time` of the stages' solutions."""
    return step_time([x.time for x in sols], nmicros, [x.time - x.comm for x in sols], share)


def _sends(problem: StageProblem, choice: Sequence[int], bounds: Sequence[int],
           model: CostModel) -> list[float]:
    """Per stage: seconds per micro-batch to receive the activations that earlier stages
    produce for it, point to point, each device its piece (and to send their gradients
    back)."""
    stage_of = {}
    for s in range(len(bounds) - 1):
        for i in range(bounds[s], bounds[s + 1]):
            stage_of[i] = s
    written = {}
    for i, opts in enumerate(problem.options):
        for full, lay in opts[choice[i]].writes:
            written[full] = (i, lay)
    extra = [0.0] * (len(bounds) - 1)
    seen = set()
    for j, op in enumerate(problem.ops):
        for x in op.input_tensors():
            src = written.get(x.full)
            if src is None or stage_of[src[0]] == stage_of[j] or (x.full, stage_of[j]) in seen:
                continue
            seen.add((x.full, stage_of[j]))
            lay = src[1]
            piece = x.full.numel if lay is None else lay.piece_numel
            once = model.comm.step_time([(0, 1)], piece, x.full.dtype.itemsize)
            extra[stage_of[j]] += 2 * once if x.full.requires_grad else once
    return extra


def _slice(problem: StageProblem, lo: int, hi: int) -> StageProblem:
    """The ops ``lo .. hi-1`` of ``problem`` as a stage of their own: the same options,
    the edges between them (a tensor from an earlier stage arrives by point-to-point
    sends, lane by lane in the layout it was written, as the kernel moves it)."""
    edges = tuple(attrs.evolve(e, src=e.src - lo, dst=e.dst - lo) for e in problem.edges
                  if lo <= e.src < hi and lo <= e.dst < hi)
    rep = tuple(r - lo if lo <= r < hi else i - lo
                for i, r in enumerate(problem.rep[lo:hi], start=lo))
    return StageProblem(ops=problem.ops[lo:hi], options=problem.options[lo:hi], edges=edges,
                        rep=rep, k=problem.k)


def stage_counts(n: int, cfg: AutoDistConfig, nops: int, layers: int = 0) -> list[int]:
    """The numbers of stages the search tries for ``plan_ngpus=n`` (each stage then has
    ``n // s`` devices); ``'auto'`` tries at most one stage per layer (``layers``, the
    layer starts plus one; 0 when the model has none, then one per op)."""
    if cfg.pipeline_nstages == "auto":
        # a stage per layer at most: more stages than layers would cut inside layers
        most = layers if layers else nops
        counts = [s for s in range(1, n + 1) if n % s == 0 and s <= most]
        if cfg.pipeline_nmicros is None:
            logger.info("autodist: pipeline_nstages='auto' without pipeline_nmicros: "
                        "considering one stage only (set pipeline_nmicros to try pipelines)")
            counts = [1]
        if cfg.max_partition_degree is not None:
            counts = [s for s in counts if n // s <= cfg.max_partition_degree] or [n]
        return counts
    s = int(cfg.pipeline_nstages)
    if n % s:
        raise AutoDistError(
            f"policy 'autodist': pipeline_nstages={s} must divide plan_ngpus={n} (each "
            f"stage gets plan_ngpus / pipeline_nstages devices); use one of "
            f"{[d for d in range(1, n + 1) if n % d == 0]}")
    if s > 1 and cfg.pipeline_nmicros is None:
        raise AutoDistError(
            f"policy 'autodist': pipeline_nstages={s} needs pas_config['pipeline_nmicros'] "
            f"(the micro-batches of each train_step), e.g. {2 * s}")
    return [s]


def search_pipeline(ops: Sequence[Op], n: int, model: CostModel, cfg: AutoDistConfig,
                    limit: float | None, nmicros: int, outputs: Sequence[SubTensor],
                    bound: Callable[[int], float] | None = None,
                    ) -> tuple[PipelinePlan, list[StageProblem], list[Solution]]:
    """The fastest plan over the stage counts ``cfg.pipeline_nstages`` allows (``bound``:
    as in `search_pipeline_bounded`, which without a cap always finds one)."""
    found = search_pipeline_bounded(ops, n, model, cfg, limit, nmicros, outputs, bound=bound)
    if found is None:  # pragma: no cover - the first stage count is always searched
        raise RuntimeError("autodist: the uncapped pipeline search returned no plan")
    return found


def search_pipeline_bounded(ops: Sequence[Op], n: int, model: CostModel, cfg: AutoDistConfig,
                            limit: float | None, nmicros: int, outputs: Sequence[SubTensor],
                            bound: Callable[[int], float] | None = None,
                            cap: float | None = None,
                            ) -> tuple[PipelinePlan, list[StageProblem], list[Solution]] | None:
    """`search_pipeline`, pruned: ``bound(s)`` is a lower bound on the step time of any
    plan of ``s`` stages (`nnscaler_policy_autodist.mesh.step_bound`); stage counts are
    visited by their bound, and one whose bound is above the best step found, or above
    ``cap`` (seconds: a plan must beat it to matter), is skipped. ``None`` when every
    stage count that fits was skipped by ``cap``."""
    outs = {t.full for t in outputs}
    counts = stage_counts(n, cfg, len(ops), count_layers(ops))
    if bound is not None:
        counts = sorted(counts, key=lambda s: (bound(s), s))
    best = None
    skipped = False
    failures: list[NoPlanFits] = []
    for s in counts:
        if bound is not None:
            tops = [x for x in (cap, None if best is None else best[0].step_time)
                    if x is not None]
            above = min(tops) if tops else None
            if above is not None and bound(s) > above * (1.0 + SLACK):
                skipped = True
                logger.info("autodist: %d stage(s) of %d device(s) skipped: their lower "
                            "bound %.3f ms is above %.3f ms", s, n // s, bound(s) * 1e3,
                            above * 1e3)
                continue
        try:
            found = _plan_for(ops, n, s, model, cfg, limit, nmicros, outs)
        except NoPlanFits as e:
            failures.append(e)
            continue
        logger.info("autodist: %d stage(s) of %d device(s): estimated step %.3f ms", s, n // s,
                    found[0].step_time * 1e3)
        # ties go to fewer stages, as when the counts were tried in ascending order
        if best is None or (found[0].step_time, s) < (best[0].step_time, best[0].nstages):
            best = found
    if best is None and skipped:
        return None
    if best is None:
        need = min(e.need for e in failures)
        raise NoPlanFits(need, limit or 0.0)
    return best


def replay_solutions(problems: Sequence[StageProblem], choices: Sequence[Sequence[int]],
                     pipe: PipelinePlan) -> list[Solution]:
    """The solutions of fixed choices (a reloaded plan), costed anew."""
    return [evaluate(p, c, inflight(pipe.scheduler, pipe.nstages, i, pipe.nmicros), "loaded")
            for i, (p, c) in enumerate(zip(problems, choices))]
