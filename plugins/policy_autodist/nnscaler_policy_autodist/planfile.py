"""The plan as a JSON file a person can read, edit and replay.

``save_plan_path`` writes, for every op in program order, its name, module, source line,
pipeline stage and choice (``"replicate"`` or ``{"idx": i, "dim": d}``: split input ``i``
along dim ``d`` over the stage's devices), with the pipeline and the estimates; with
``plan_ngpus='auto'`` also the chosen ``mesh`` (replicas x unit) and the alternatives
searched, so that ``load_plan_path`` under ``'auto'`` replays the same unit size; and
the ZeRO stage (``zero_stage``, with every stage searched under ``zero_stage='auto'``,
which replays the file's stage).
``load_plan_path`` replays the choices on the graph being compiled: the ops must be the
same (name and module, in order; shapes may differ), every split must be legal for the
shapes now, and the costs are derived anew for them (the estimates in the file are not
read back).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nnscaler.extend import DEFAULT_SCHEDULER, IRGraph, Op
from nnscaler_policy_autodist.config import AutoDistError
from nnscaler_policy_autodist.model import CostModel, StageProblem
from nnscaler_policy_autodist.pipeline import PipelinePlan, replay_solutions, stages_time
from nnscaler_policy_autodist.spmd import Solution
from nnscaler_policy_autodist.twoaxis import TwoAxis, aliases

if TYPE_CHECKING:
    from nnscaler_policy_autodist.policy import AutoDistResult

__all__ = ["FORMAT", "PlanFileError", "replay", "save", "saved_unit", "saved_zero_stage",
           "to_json"]

FORMAT = "nnscaler-autodist-plan/1"


class PlanFileError(AutoDistError):
    """A plan file that does not match the graph being compiled, or is malformed."""


def _choice(t: Any) -> Any:
    if isinstance(t, TwoAxis):  # an entry older files never hold: their choices stay
        return t.choice()
    return "replicate" if t is None else {"idx": t.idx, "dim": t.dim}


def _names(t: Any, want: Any) -> bool:
    """Whether a one-axis ``want`` (``{"idx", "dim"}``) names the split ``t`` through
    another tensor it cuts: the search keeps one option per split (a linear's input
    columns are its weight's), a file may name it by either."""
    if t is None or isinstance(t, TwoAxis) or not isinstance(want, dict) or "then" in want:
        return False
    return (want.get("idx"), want.get("dim")) in aliases(t)


def to_json(result: AutoDistResult) -> dict[str, Any]:
    ops = []
    pipe = result.pipeline
    stages = []
    for s, (problem, sol) in enumerate(zip(result.problems, result.solutions)):
        stages.append({"devices": list(range(s * pipe.k, (s + 1) * pipe.k)),
                       "time_ms": sol.time * 1e3, "comm_ms": sol.comm * 1e3,
                       "memory_gb": sol.mem / 1024**3, "solver": sol.solver})
        for i, op in enumerate(problem.ops):
            ops.append({"op": op.name, "module": op.module_path, "source": op.short_source,
                        "stage": s, "split": _choice(problem.options[i][sol.choice[i]].transform)})
    for i, entry in enumerate(ops):
        entry["index"] = i
    out = {"format": FORMAT, "plan_ngpus": result.plan_ngpus, "zero_stage": result.zero_stage,
           "pipeline": {"nstages": pipe.nstages, "devices_per_stage": pipe.k,
                        "nmicros": pipe.nmicros, "scheduler": pipe.scheduler},
           "estimate": {"step_time_ms": pipe.step_time * 1e3, "stages": stages},
           "ops": ops}
    if result.meshes:
        out["mesh"] = {"replicas": result.meshes[0].replicas, "unit": result.meshes[0].unit,
                       "runtime_ngpus": result.meshes[0].replicas * result.meshes[0].unit,
                       "experts": result.meshes[0].experts,
                       "searched": [_mesh(m) for m in result.meshes]}
    if result.zero_stages:
        out["zero_stages_searched"] = [
            {"stage": e.stage, "fits": e.fits, "unit": e.unit,
             "step_time_ms": None if e.step_time is None else e.step_time * 1e3,
             "memory_gb": e.memory / 1024**3} for e in result.zero_stages]
    return out


def _mesh(m: Any) -> dict[str, Any]:
    return {"replicas": m.replicas, "unit": m.unit, "stages": m.stages, "fits": m.fits,
            "step_time_ms": None if m.step_time is None else m.step_time * 1e3,
            "time_per_batch_ms": None if m.step_time is None else m.time_per_batch * 1e3,
            "memory_gb": m.memory / 1024**3, "pruned": m.pruned, "experts": m.experts,
            "bound_ms": None if m.bound is None else m.bound * 1e3}


def saved_unit(path: Path, runtime_ngpus: int) -> int:
    """The unit size a saved plan was made for (``plan_ngpus='auto'`` replays it)."""
    try:
        n = json.loads(Path(path).read_text()).get("plan_ngpus")
    except (OSError, ValueError, AttributeError) as e:
        raise PlanFileError(f"policy 'autodist': cannot read the plan {str(path)!r}: "
                            f"{e}") from None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or runtime_ngpus % n:
        raise PlanFileError(
            f"policy 'autodist': the plan {str(path)!r} was made for plan_ngpus={n!r}, which "
            f"does not divide runtime_ngpus={runtime_ngpus}; replan without load_plan_path")
    return n


def saved_zero_stage(path: Path, allowed: tuple[int, ...]) -> int:
    """The ZeRO stage a saved plan was made for (``zero_stage='auto'`` replays it)."""
    try:
        data = json.loads(Path(path).read_text())
        stage = data.get("zero_stage", "missing")
    except (OSError, ValueError, AttributeError) as e:
        raise PlanFileError(f"policy 'autodist': cannot read the plan {str(path)!r}: "
                            f"{e}") from None
    if isinstance(stage, bool) or stage not in allowed:
        what = ("records no ZeRO stage (written before plans recorded one)"
                if stage == "missing" else f"was made for zero_stage={stage!r}")
        raise PlanFileError(
            f"policy 'autodist': the plan {str(path)!r} {what}, and zero_stage='auto' "
            f"replays the file's stage, one of {list(allowed)} here; give zero_stage, or "
            f"replan without load_plan_path")
    return stage


def save(path: Path, result: AutoDistResult) -> None:
    """Write the plan atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(to_json(result), indent=1))
    tmp.replace(path)


def _fail(path: Path, what: str) -> PlanFileError:
    return PlanFileError(f"policy 'autodist': the plan {str(path)!r} does not match this "
                         f"graph: {what}. Replan without load_plan_path (and save_plan_path "
                         f"to write a new one), or edit the file")


def replay(path: Path, graph: IRGraph, ops: Sequence[Op], n: int, model: CostModel,
           nmicros: int) -> tuple[PipelinePlan, list[StageProblem], list[Solution]]:
    """The saved choices on ``ops``, costed for the shapes now."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PlanFileError(f"policy 'autodist': cannot read the plan {str(path)!r}: "
                            f"{e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanFileError(f"policy 'autodist': {str(path)!r} is not an autodist plan "
                            f"(format {FORMAT!r} expected)")
    if data.get("plan_ngpus") != n:
        raise _fail(path, f"it plans plan_ngpus={data.get('plan_ngpus')}, this compile has "
                          f"plan_ngpus={n}")
    entries = data.get("ops", [])
    if len(entries) != len(ops):
        raise _fail(path, f"it has {len(entries)} ops, the graph has {len(ops)}")
    for i, (entry, op) in enumerate(zip(entries, ops)):
        if entry.get("op") != op.name or entry.get("module") != op.module_path:
            raise _fail(path, f"op {i} is {entry.get('op')} in {entry.get('module')!r} there, "
                              f"{op.name} in {op.module_path!r} ({op.short_source}) here")
    pipe_cfg = data.get("pipeline", {})
    k = int(pipe_cfg.get("devices_per_stage", n))
    stages = [int(e.get("stage", 0)) for e in entries]
    starts = [0] + [i for i in range(1, len(stages)) if stages[i] != stages[i - 1]]
    if sorted(set(stages)) != list(range(len(starts))) or k * len(starts) != n:
        raise _fail(path, f"its stages {sorted(set(stages))} x {k} devices do not cover "
                          f"plan_ngpus={n} in program order")
    outs = {t.full for t in graph.output_tensors()}
    bounds = [*starts, len(ops)]
    problems, choices = [], []
    for s in range(len(starts)):
        stage_ops = list(ops[bounds[s]:bounds[s + 1]])
        problem = model.build(stage_ops, k, outs, all_ops=ops)
        picked = []
        for j, op in enumerate(stage_ops):
            want = entries[bounds[s] + j].get("split")
            for o, opt in enumerate(problem.options[j]):
                if _choice(opt.transform) == want or _names(opt.transform, want):
                    picked.append(o)
                    break
            else:
                legal = [_choice(opt.transform) for opt in problem.options[j]]
                raise _fail(path, f"op {bounds[s] + j} ({op.name} in {op.module_path!r}, "
                                  f"{op.short_source}) takes {want}, which is not legal for its "
                                  f"shapes now; legal: {legal}")
        problems.append(problem)
        choices.append(picked)
    nm = int(pipe_cfg.get("nmicros", nmicros))
    scheduler = str(pipe_cfg.get("scheduler", DEFAULT_SCHEDULER))
    pipe = PipelinePlan(tuple(starts), k, nm, scheduler, 0.0)
    sols = replay_solutions(problems, choices, pipe)
    import attrs

    pipe = attrs.evolve(pipe, step_time=stages_time(sols, nm, model.share))
    return pipe, problems, sols
