"""``autodist``: search the plan (pipeline stages, each op's split) by measured costs.

The order of the steps:

1. read ``pas_config`` (`config`); build the cost model: the device's figures
   (`comm`), the compute profiler (`profile`), constraints and recomputation;
2. choose the pipeline (`pipeline`): the number of stages, the cuts at layer
   boundaries, each stage's devices; or replay a saved plan (`planfile`); with
   ``plan_ngpus='auto'``, at every unit size that divides ``runtime_ngpus``, keeping the
   best mesh (`mesh`);
3. solve each stage (`spmd`) under the memory limit, with the stage's in-flight
   micro-batches;
4. apply the choices through the policy writer's API (``staging``, ``partition`` /
   ``replicate``, ``assign``, ``recompute``), check the plan, log the report, save the
   plan.
"""

from __future__ import annotations

import fnmatch
import logging
import time

import attrs

from nnscaler.extend import (
    AUTO,
    ComputeConfig,
    Graph,
    IRGraph,
    Op,
    PartitionError,
    TensorKind,
    as_policy_graph,
    call_on_every_rank,
    is_moe,
    policy_config,
    repeated_blocks,
)
from nnscaler_policy_autodist import twoaxis
from nnscaler_policy_autodist.comm import (
    CommModel,
    DeviceSpec,
    comm_measured,
    device_spec,
    measure_for_plan,
)
from nnscaler_policy_autodist.config import AutoDistConfig, AutoDistError, parse_config
from nnscaler_policy_autodist.constraints import load_constraints
from nnscaler_policy_autodist.experts import ExpertAxis, search_unit
from nnscaler_policy_autodist.mesh import (
    Mesh,
    rank_meshes,
    search_meshes,
    step_bound,
    unit_sizes,
)
from nnscaler_policy_autodist.model import CostModel, SharedCosts, StageProblem
from nnscaler_policy_autodist.pipeline import (
    PipelinePlan,
    count_layers,
    search_pipeline,
    search_pipeline_bounded,
    stage_counts,
)
from nnscaler_policy_autodist.profile import ComputeProfiler, core_share
from nnscaler_policy_autodist.sequence import PartTimes, planning
from nnscaler_policy_autodist.spmd import NoPlanFits, Solution
from nnscaler_policy_autodist.twoaxis import TwoAxis
from nnscaler_policy_autodist.zero import StageEstimate, choose_stage

__all__ = ["AutoDistResult", "autodist", "plan_graph"]

logger = logging.getLogger("nnscaler.autodist")  # under nnscaler's loggers


@attrs.frozen(eq=False)
class AutoDistResult:
    """What ``autodist`` chose and estimated (also what the report and plan file show)."""

    config: AutoDistConfig
    plan_ngpus: int
    pipeline: PipelinePlan
    problems: tuple[StageProblem, ...]
    solutions: tuple[Solution, ...]
    limit: float | None
    search_seconds: float
    profiled: int
    #: ``plan_ngpus='auto'``: every mesh searched, best (the chosen one) first
    meshes: tuple[Mesh, ...] = ()
    #: the ZeRO stage the estimate counts (`ComputeConfig.reducer`), over ``replicas``
    zero_stage: int = 0
    replicas: int = 1
    #: ``zero_stage='auto'``: every stage searched, best (the chosen one) first
    zero_stages: tuple[StageEstimate, ...] = ()


def _recompute_paths(graph: IRGraph, names: tuple[str, ...]) -> list[str]:
    """Module paths named by ``recompute_modules``: class names (a path whose ops run in a
    module of that class) or module paths/globs; outermost paths only."""
    classes = {}
    for op in graph.nodes():
        if op.module_path:
            classes.setdefault(op.module_path, set()).add(op.module_class.rsplit(".", 1)[-1])
    found: list[str] = []
    for name in names:
        hits = [p for p, cls in classes.items() if name in cls or name.rsplit(".", 1)[-1] in cls
                or fnmatch.fnmatchcase(p, name) or p == name]
        if not hits:
            known = sorted({c for cls in classes.values() for c in cls})
            raise AutoDistError(
                f"policy 'autodist': pas_config['recompute_modules'] names {name!r}, but no "
                f"op of the model runs in a module of that class or path. Module classes of "
                f"this model: {', '.join(known)}")
        found += hits
    found = sorted(set(found))
    return [p for p in found if not any(p != q and p.startswith(q + ".") for q in found)]


def _in(op: Op, path: str) -> bool:
    return op.module_path == path or op.module_path.startswith(path + ".")


def _with_nodes(spec: DeviceSpec, per_node: int | None, runtime: int) -> DeviceSpec:
    """``spec`` with ``pas_config['devices_per_node']``: the job's devices fill whole
    nodes, or it runs inside part of one."""
    if per_node is None:
        return spec
    if runtime % per_node and per_node % runtime:
        whole = [n for n in range(1, runtime + 1) if runtime % n == 0]
        raise AutoDistError(
            f"policy 'autodist': pas_config['devices_per_node'] is {per_node}, which does not "
            f"divide runtime_ngpus={runtime}: the job would hold part of a node. Give the "
            f"devices of each node, one of {whole}, or a runtime_ngpus that is a multiple of "
            f"{per_node}"
        )
    return attrs.evolve(spec, per_node=per_node)


def _unit_sizes(config: ComputeConfig, cfg: AutoDistConfig) -> list[int]:
    """The unit sizes to search: the given ``plan_ngpus``; for ``'auto'`` the saved plan's
    (``load_plan_path``) or every divisor of ``runtime_ngpus`` that the stage count fits."""
    from nnscaler_policy_autodist import planfile

    if config.plan_ngpus != AUTO:
        return [config.plan_ngpus]
    if cfg.load_plan_path is not None:
        return [planfile.saved_unit(cfg.load_plan_path, config.runtime_ngpus)]
    s = 1 if cfg.pipeline_nstages == "auto" else int(cfg.pipeline_nstages)
    return [n for n in unit_sizes(config.runtime_ngpus) if n % s == 0]


def compute_floor(ops: list[Op], model: CostModel, k: int,
                  same: dict[Op, Op] | None = None) -> float:
    """Seconds per micro-batch that ``ops`` compute at least on stages of ``k`` devices:
    per op, the least forward + backward (+ recomputed forward) of any option the model
    gives it (`CostModel.transforms`); an option's time adds communication and the
    optimizer's step to this, so the sum bounds every plan's stage times from below.
    ``same[op]``: an op that computes the same (its place in the template of its
    repeated block), whose options are timed once for all its instances."""
    same = same or {}
    times: dict[Op, list[tuple[float, float]]] = {}
    total = 0.0
    for op in ops:
        grads = not op.no_grad and any(x.full.requires_grad for x in op.input_tensors())
        again = grads and op.oid in model.recompute
        like = same.get(op, op)
        if model.allowed.get(like.oid) != model.allowed.get(op.oid):  # constrained apart
            like = op
        if like not in times:
            times[like] = [model.profiler.time(like, t, k) for t in model.transforms(like, k)]
        total += min(fw + (bw if grads else 0.0) + (fw if again else 0.0)
                     for fw, bw in times[like])
    return total


def _templates(ops: list[Op]) -> dict[Op, Op]:
    """Each op of a repeated block's instance -> the op at its place in the template."""
    same: dict[Op, Op] = {}
    for kind in repeated_blocks(ops):
        for inst in kind.instances:
            for op, tpl in zip(inst.ops, kind.template.ops, strict=True):
                if op is not tpl:
                    same[op] = tpl
    return same


def weights_floor(ops: list[Op], model: CostModel) -> float:
    """Bytes the weights take at least over all devices of a unit: every weight is held
    once at least, a trained one with what the model holds for it under the ZeRO stage
    (`CostModel._weight_bytes`: linear in the piece, so the pieces of every device sum
    to the bytes of the whole weights)."""
    seen: set = set()
    trained = frozen = 0.0
    for op in ops:
        for x in op.input_tensors():
            full = x.full
            if full in seen or not full.is_leaf or full.kind is TensorKind.INPUT:
                continue
            seen.add(full)
            if full.requires_grad:
                trained += full.numel * full.dtype.itemsize
            else:
                frozen += full.numel * full.dtype.itemsize
    return model._weight_bytes(trained)[0] + frozen


def activations_floor(ops: list[Op], model: CostModel) -> float:
    """Bytes of activations a unit keeps for backward at least, over all its devices,
    for one micro-batch: the floating-point outputs of every op that gradients flow
    through and that is not recomputed (the model counts at least these, per device a
    piece, and the pieces of a tensor cover it)."""
    total = 0.0
    for op in ops:
        grads = not op.no_grad and any(x.full.requires_grad for x in op.input_tensors())
        if not grads or op.oid in model.recompute:
            continue
        total += sum(y.full.numel * y.full.dtype.itemsize for y in op.output_tensors()
                     if y.full.dtype.is_floating_point)
    return total


class _Bounds:
    """Lower bounds of the mesh search, cached across unit sizes: the computation floor
    depends on the stage's degree only, not on the unit size or the replicas."""

    def __init__(self, ops: list[Op], cfg: AutoDistConfig, nmicros: int) -> None:
        self.ops, self.cfg, self.nmicros = ops, cfg, nmicros
        self.layers = count_layers(ops)
        self._floor: dict[tuple[int, int], float] = {}
        self._same = _templates(ops)
        self._weights: dict[tuple[int, bool, float], float] = {}

    def floor(self, model: CostModel, k: int, key: int = 0) -> float:
        """``key``: the expert degree ``model`` is held to (`experts.ExpertAxis`)."""
        if (k, key) not in self._floor:
            self._floor[k, key] = compute_floor(self.ops, model, k, self._same)
        return self._floor[k, key]

    def weights(self, model: CostModel) -> float:
        """Bytes a unit holds at least over its devices: weights and one micro-batch's
        activations."""
        key = (model.units, model.stage, model.opt_state)
        if key not in self._weights:
            self._weights[key] = (weights_floor(self.ops, model)
                                  + activations_floor(self.ops, model))
        return self._weights[key]

    def step(self, model: CostModel, n: int, s: int, key: int = 0) -> float:
        """Lower bound on the step time of ``s`` stages of ``n // s`` devices."""
        return step_bound(self.floor(model, n // s, key), s, self.nmicros, model.share)

    def per_batch(self, model: CostModel, n: int, runtime: int) -> float:
        """Lower bound on the time per batch of unit size ``n``."""
        counts = stage_counts(n, self.cfg, len(self.ops), self.layers)
        return min(self.step(model, n, s) for s in counts) / (runtime // n)


def _search_meshes(ops: list[Op], models: dict[int, CostModel], cfg: AutoDistConfig,
                   limit: float | None, nmicros: int, outputs: list, runtime: int,
                   ) -> tuple[int, tuple, tuple[Mesh, ...]]:
    """The plan at each unit size, pruned by lower bounds (`mesh.search_meshes`); the
    best mesh's size, its plan and every mesh ranked."""
    found: dict[int, tuple] = {}
    bounds = _Bounds(ops, cfg, nmicros)

    axis = ExpertAxis(ops)

    def search(n: int, cap: float | None, memory_floor: bool = True) -> Mesh | None:
        # the expert degree is an axis inside the unit (`experts.search_unit`)
        mesh, plan = search_unit(axis, ops, n, models[n], cfg, limit, nmicros, outputs,
                                 bounds, runtime, cap, memory_floor,
                                 search_pipeline=search_pipeline_bounded)
        if mesh is not None and mesh.pruned == "memory":
            logger.info("autodist: unit of %d device(s) skipped: its weights and activations "
                        "need at least %.3f GB per device", n, mesh.memory / 1024**3)
        if plan is not None:
            found[n] = plan
            logger.info("autodist: mesh %s: estimated step %.3f ms", mesh.describe(),
                        mesh.step_time * 1e3)
        return mesh

    meshes = search_meshes(models, runtime,
                           lambda n: bounds.per_batch(models[n], n, runtime), search)
    if not any(m.fits for m in meshes):
        # nothing fits: the error names the least memory a plan needs, so the units
        # skipped by their floor are searched, least floor first, while the floor is
        # below the least need found (a unit needs at least its floor)
        least = min((m.memory for m in meshes if m.pruned is None), default=float("inf"))
        for i in sorted((i for i, m in enumerate(meshes) if m.pruned == "memory"),
                        key=lambda i: (meshes[i].memory, meshes[i].unit)):
            if meshes[i].memory >= least:
                break
            meshes[i] = search(meshes[i].unit, None, memory_floor=False)
            least = min(least, meshes[i].memory)
    ranked = tuple(rank_meshes(meshes))
    if not ranked[0].fits:
        e = NoPlanFits(ranked[0].memory, limit or 0.0)
        e.add_note(f"plan_ngpus='auto': no unit size of runtime_ngpus={runtime} fits (tried "
                   f"{sorted(models)}); the least memory is needed with {ranked[0].describe()}")
        raise e
    return ranked[0].unit, found[ranked[0].unit], ranked


def _reduces_in_backward(config: ComputeConfig, stage: int) -> bool:
    """Whether the runtime's reducer sums gradients from backward's hooks, bucket by
    bucket while backward goes on (``use_async_reducer``, or ZeRO stage 2 and up; as
    the runtime decides from `ComputeConfig.reducer`), rather than after backward."""
    return config.use_async_reducer or stage >= 2


def _zero_stages(config: ComputeConfig, cfg: AutoDistConfig) -> tuple[int, ...]:
    """The ZeRO stages to search: the config's; for ``zero_stage='auto'`` the saved
    plan's (``load_plan_path``) or every stage it allows (`zero`)."""
    from nnscaler_policy_autodist import planfile

    if config.zero_stage == AUTO and cfg.load_plan_path is not None:
        return (planfile.saved_zero_stage(cfg.load_plan_path, config.zero_stages),)
    return config.zero_stages


def _search(g: IRGraph, models: dict[int, CostModel], config: ComputeConfig,
            cfg: AutoDistConfig, limit: float | None) -> tuple:
    """The plan under ``models`` (one per unit size, at one ZeRO stage): replayed from
    ``load_plan_path``, the best mesh for ``plan_ngpus='auto'``, or the given unit's;
    ``(unit, pipeline, problems, solutions, meshes)``."""
    from nnscaler_policy_autodist import planfile

    ops, outputs, nmicros = g.nodes(), g.output_tensors(), cfg.pipeline_nmicros or 1
    meshes: tuple[Mesh, ...] = ()
    n = next(iter(models))
    if cfg.load_plan_path is not None:
        pipe, problems, solutions = planfile.replay(cfg.load_plan_path, g, ops, n, models[n],
                                                    nmicros)
    elif config.plan_ngpus == AUTO:
        n, (pipe, problems, solutions), meshes = _search_meshes(
            ops, models, cfg, limit, nmicros, outputs, config.runtime_ngpus)
    else:
        bounds = _Bounds(ops, cfg, nmicros)
        pipe, problems, solutions = search_pipeline(
            ops, n, models[n], cfg, limit, nmicros, outputs,
            bound=lambda s: bounds.step(models[n], n, s))
    return n, pipe, problems, solutions, meshes


def plan_graph(graph: Graph, compute_config: ComputeConfig) -> tuple[IRGraph, AutoDistResult]:
    """Plan ``graph`` like the ``autodist`` policy and also return what it chose."""
    with planning():  # a mean loss's token split is an option too (`sequence`)
        return _plan_graph(graph, compute_config)


def _plan_graph(graph: Graph, compute_config: ComputeConfig) -> tuple[IRGraph, AutoDistResult]:
    from nnscaler_policy_autodist import planfile, report

    t0 = time.perf_counter()
    config = policy_config(compute_config, "autodist")
    runtime = config.runtime_ngpus
    cfg = parse_config(config.pas_config, config.pipeline)
    sizes = _unit_sizes(config, cfg)
    g = as_policy_graph(graph)
    ops = g.nodes()
    from nnscaler.extend import device_type

    here = cfg.device_type in (None, device_type())
    moe = any(is_moe(op) for op in ops)  # the all-to-all is measured for MoE models
    if here and not comm_measured(cfg.profile_dir, runtime, alltoall=moe):
        # every rank takes part (while rank 0 plans); alone, there is nothing to measure
        call_on_every_rank(measure_for_plan, cfg.profile_dir, moe)
    spec = _with_nodes(device_spec(cfg.device_type, cfg.profile_dir, runtime),
                       cfg.devices_per_node, runtime)
    profiler = ComputeProfiler(spec, cfg.profile_dir, measure=here)
    profiler.note_program(ops)
    parts = PartTimes(profiler)
    rec_paths = _recompute_paths(g, cfg.recompute_modules)
    recompute = frozenset(op.oid for op in ops if any(_in(op, p) for p in rec_paths))
    allowed = load_constraints(cfg.partition_constraints_path, g)
    nmicros = cfg.pipeline_nmicros or 1
    zero_stages = _zero_stages(config, cfg)
    shared = SharedCosts()  # what every unit size, stage and expert degree computes alike
    by_stage = {z: {n: CostModel(profiler=profiler, comm=CommModel(spec), units=runtime // n,
                                 zero=z >= 1, zero_stage=z,
                                 recompute=recompute, allowed=allowed,
                                 max_degree=cfg.max_partition_degree,
                                 two_axis=cfg.two_axis,
                                 micro_batches=nmicros * cfg.update_freq,
                                 share=core_share() if here else 1.0,
                                 overlap_grads=_reduces_in_backward(config, z), unit=n,
                                 parts=parts, expert_imbalance=cfg.expert_imbalance,
                                 shared=shared)
                    for n in sizes} for z in zero_stages}
    models = by_stage[zero_stages[0]]  # the options, what is profiled, are the same
    limit = cfg.mem_constraint if cfg.mem_constraint is not None else spec.memory
    if here and cfg.load_plan_path is None:  # what the search asks for, over the ranks
        requests = [(op, t, n // s) for n, model in models.items()
                    for s in stage_counts(n, cfg, len(ops), count_layers(ops))
                    for op in ops for t in model.transforms(op, n // s)]
        profiler.prefetch(requests)
        parts.prefetch(requests)
    if here:  # the ops' times as they take in a whole step of this model
        profiler.calibrate(ops, g.output_tensors())
    def search(stage: int) -> tuple:
        return _search(g, by_stage[stage], config, cfg, limit)

    stage_estimates: tuple[StageEstimate, ...] = ()
    if len(zero_stages) > 1:  # zero_stage='auto': every stage it allows (`zero`)
        zero_stage, found, stage_estimates = choose_stage(zero_stages, search, runtime, limit)
    else:
        zero_stage, found = zero_stages[0], search(zero_stages[0])
    n, pipe, problems, solutions, meshes = found
    profiler.save()
    parts.save()
    _apply(g, pipe, problems, solutions)
    for path in rec_paths:
        g.recompute(path)
    g.check(n)
    g.choose_zero_stage(zero_stage)
    result = AutoDistResult(config=cfg, plan_ngpus=n, pipeline=pipe, problems=tuple(problems),
                            solutions=tuple(solutions), limit=limit,
                            search_seconds=time.perf_counter() - t0, profiled=profiler.profiled,
                            meshes=meshes, zero_stage=zero_stage,
                            replicas=runtime // n, zero_stages=stage_estimates)
    if cfg.task_name is not None:
        logger.info("autodist plan of task %r:", cfg.task_name)
    logger.info("%s", report.text(result))
    if cfg.save_plan_path is not None:
        planfile.save(cfg.save_plan_path, result)
    if cfg.plot_path is not None:
        report.plot(result, cfg.plot_path)
    return g, result


def _apply(g: IRGraph, pipe: PipelinePlan, problems: list[StageProblem],
           solutions: list[Solution]) -> None:
    if len(pipe.starts) > 1:
        g.staging([problems[s].ops[0] for s in range(len(problems))])
    for s, (problem, sol) in enumerate(zip(problems, solutions)):
        base = s * problem.k
        for i, (op, choice) in enumerate(zip(problem.ops, sol.choice)):
            t = problem.options[i][choice].transform
            if isinstance(t, TwoAxis):  # legal by construction: a failure is raised
                for p, part in enumerate(twoaxis.apply(g, op, t)):
                    g.assign(part, base + p)
                continue
            try:
                parts = (g.replicate(op, problem.k) if t is None else
                         g.partition(op, idx=t.idx, dim=t.dim, num=problem.k))
            except PartitionError as e:
                logger.warning("autodist: %s cannot be split as planned (%s); replicating it",
                               g.describe(op), e)
                parts = g.replicate(op, problem.k)
            for p, part in enumerate(parts):
                g.assign(part, base + p)


def autodist(graph: Graph, compute_config: ComputeConfig) -> IRGraph:
    """The ``autodist`` policy: ``(graph, compute_config) -> graph``. See
    ``docs/plugins/policy_autodist.md`` for the ``pas_config`` keys and the report."""
    g, _ = plan_graph(graph, compute_config)
    return g
