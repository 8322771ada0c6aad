"""The ``pas_config`` keys of ``autodist``, checked once into a frozen `AutoDistConfig`.

Every key is optional. An unknown key is an error that names it and the closest known
key: a misspelt ``mem_constriant`` must not silently plan without a memory limit.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from nnscaler.extend import DEFAULT_SCHEDULER, ComputeConfigError, PipelineConfig, PolicyError

__all__ = ["KEYS", "SOLVERS", "AutoDistConfig", "AutoDistError", "parse_config"]


class AutoDistError(PolicyError):
    """``autodist`` cannot plan with the configuration it was given (the message says
    why, the value seen, and the fix)."""


#: The solvers of a stage: ``ilp`` (exact integer program, CBC through pulp), ``dp``
#: (dynamic program over the live tensors of the program, exact for chain-like graphs),
#: ``auto`` (the ILP where repeated blocks are tied: its size does not grow with depth;
#: else ``dp`` where its state stays small and the memory limit does not bind; else ``ilp``).
SOLVERS = ("auto", "ilp", "dp")

#: Every key of ``pas_config`` that ``autodist`` reads, with what it means.
KEYS: dict[str, str] = {
    "mem_constraint": "memory per device in GB (default: the device's memory)",
    "pipeline_nstages": "pipeline stages: an int, or 'auto' to search (default 1)",
    "pipeline_nmicros": "micro-batches of each train_step (needed for a pipeline)",
    "pipeline_scheduler": "a registered schedule for the pipeline (default '1f1b')",
    "recompute_modules": "module classes or paths whose activations are recomputed",
    "partition_constraints_path": "a YAML file of ops/modules with their allowed splits",
    "load_plan_path": "a JSON plan to replay (choices kept, costs re-derived)",
    "save_plan_path": "where to write the JSON plan that was chosen",
    "solver": "'auto', 'ilp' or 'dp'",
    "max_partition_degree": "the largest tensor-parallel degree of a stage",
    "two_axis": "also split an op on two axes at once inside a stage, data x tensor "
                "(True or False; default True)",
    "device_type": "plan for a named device ('cpu', 'H100', 'A100', ...) instead of this one",
    "devices_per_node": "devices in each node (default: the device's own figure, 8 for a "
                        "named GPU): collectives inside a node run at its bandwidth, across "
                        "nodes at the network's",
    "profile_dir": "where measured op and communication times are cached",
    "verbose": "log every op's choice and the solver's progress",
    "update_freq": "micro-batches per optimizer step (gradient accumulation; default 1): "
                   "the step and the gradient sum are spread over them in the cost model",
    "task_name": "a name for the run (nnScaler's label; logged above the plan)",
    "plot_path": "save a picture of the plan there (needs the [plot] extra)",
    "expert_imbalance": "the busiest device's token-expert pairs over the mean that an "
                        "expert-parallel split is costed with (>= 1, default 1.0: even)",
}


def _closest(key: str) -> str:
    match = difflib.get_close_matches(key, list(KEYS), n=1, cutoff=0.5)
    return f" Did you mean {match[0]!r}?" if match else ""


def _bad(key: str, value: Any, want: str) -> AutoDistError:
    return AutoDistError(f"policy 'autodist': pas_config[{key!r}] is {KEYS[key]}; it must "
                         f"be {want}, got {value!r}")


def default_profile_dir() -> Path:
    """``$NNSCALER_AUTODIST_CACHE``, else ``$NNSCALER_CACHE_DIR/autodist`` (the folder
    nnscaler's other caches share), else ``~/.cache/nnscaler/autodist``."""
    env = os.environ.get("NNSCALER_AUTODIST_CACHE", "").strip()
    if env:
        return Path(env)
    shared = os.environ.get("NNSCALER_CACHE_DIR", "").strip()
    return Path(shared) / "autodist" if shared else Path.home() / ".cache" / "nnscaler" / "autodist"


@attrs.frozen(kw_only=True)
class AutoDistConfig:
    """What ``autodist`` was asked for (see `KEYS`)."""

    mem_constraint: float | None = None  # bytes per device
    pipeline_nstages: int | str = 1
    pipeline_nmicros: int | None = None
    pipeline_scheduler: str = DEFAULT_SCHEDULER
    recompute_modules: tuple[str, ...] = ()
    partition_constraints_path: Path | None = None
    load_plan_path: Path | None = None
    save_plan_path: Path | None = None
    solver: str = "auto"
    max_partition_degree: int | None = None
    two_axis: bool = True
    device_type: str | None = None
    devices_per_node: int | None = None
    profile_dir: Path = attrs.field(factory=default_profile_dir)
    update_freq: int = 1
    task_name: str | None = None
    verbose: bool = False
    plot_path: Path | None = None
    expert_imbalance: float = 1.0


def _path(key: str, value: Any) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise _bad(key, value, "a path (str or os.PathLike)")
    return Path(value)


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(key, value, "a positive int")
    return value


def parse_config(pas_config: Mapping[str, Any] | None,
                 pipeline: PipelineConfig | None = None) -> AutoDistConfig:
    """Check ``pas_config`` and return the `AutoDistConfig` it asks for; the
    micro-batches and the scheduler come from ``pipeline`` (the compute config's
    ``pipeline``, read from the same ``pas_config`` keys), or else from ``pas_config``."""
    cfg = dict(pas_config or {})
    for key in cfg:
        if key not in KEYS:
            raise AutoDistError(
                f"policy 'autodist': unknown pas_config key {key!r}.{_closest(key)} The keys "
                f"autodist reads are: {', '.join(KEYS)}"
            )
    out: dict[str, Any] = {}
    mem = cfg.get("mem_constraint")
    if mem is not None:
        if isinstance(mem, bool) or not isinstance(mem, (int, float)) or not mem > 0:
            raise _bad("mem_constraint", mem, "a number of GB > 0 (e.g. 40 or 0.5)")
        out["mem_constraint"] = float(mem) * 1024**3
    nstages = cfg.get("pipeline_nstages", 1)
    if nstages != "auto":
        if isinstance(nstages, bool) or not isinstance(nstages, int) or nstages < 1:
            raise _bad("pipeline_nstages", nstages, "a positive int or 'auto'")
    out["pipeline_nstages"] = nstages
    if pipeline is None:
        for key, what in (("pipeline_nmicros", "a positive int"),
                          ("pipeline_scheduler", "the name of a registered schedule")):
            try:
                PipelineConfig.from_pas_config({key: cfg.get(key)} if key in cfg else {})
            except ComputeConfigError:
                raise _bad(key, cfg[key], what) from None
        pipeline = PipelineConfig.from_pas_config(cfg)
    out["pipeline_nmicros"] = pipeline.nmicros
    sched = pipeline.scheduler
    if nstages != 1:
        from nnscaler.extend import get_schedule

        get_schedule(sched)  # an unknown name lists the registered ones
    out["pipeline_scheduler"] = sched
    rec = cfg.get("recompute_modules", ())
    if isinstance(rec, str):
        rec = tuple(s.strip() for s in rec.split(",") if s.strip())
    elif isinstance(rec, (list, tuple)) and all(isinstance(s, str) for s in rec):
        rec = tuple(rec)
    else:
        raise _bad("recompute_modules", rec, "a comma-separated str or a list of str "
                   "(module class names such as 'Block', or module paths such as 'gpt.blocks')")
    out["recompute_modules"] = rec
    for key in ("partition_constraints_path", "load_plan_path", "save_plan_path", "plot_path"):
        out[key] = _path(key, cfg.get(key))
    if out["partition_constraints_path"] is not None and not out[
            "partition_constraints_path"].is_file():
        raise AutoDistError(f"policy 'autodist': pas_config['partition_constraints_path'] "
                            f"names {str(out['partition_constraints_path'])!r}, which is not a "
                            f"file. Give the path of a YAML constraints file")
    if out["load_plan_path"] is not None and not out["load_plan_path"].is_file():
        raise AutoDistError(f"policy 'autodist': pas_config['load_plan_path'] names "
                            f"{str(out['load_plan_path'])!r}, which is not a file. Give a plan "
                            f"written by save_plan_path")
    solver = cfg.get("solver", "auto")
    if solver not in SOLVERS:
        raise _bad("solver", solver, f"one of {', '.join(map(repr, SOLVERS))}")
    out["solver"] = solver
    if cfg.get("max_partition_degree") is not None:
        out["max_partition_degree"] = _positive_int("max_partition_degree",
                                                    cfg["max_partition_degree"])
    out.update(_device_keys(cfg))
    if cfg.get("profile_dir") is not None:
        out["profile_dir"] = _path("profile_dir", cfg["profile_dir"])
    for key, default in (("verbose", False), ("two_axis", True)):
        value = cfg.get(key, default)
        if not isinstance(value, bool):
            raise _bad(key, value, "True or False")
        out[key] = value
    return AutoDistConfig(**out, **_nnscaler_keys(cfg))


def _device_keys(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``device_type`` (a name of `DEVICE_SPECS`, any case) and ``devices_per_node``,
    checked."""
    from nnscaler_policy_autodist.comm import DEVICE_SPECS

    out: dict[str, Any] = {}
    dev = cfg.get("device_type")
    if dev is not None:
        if not isinstance(dev, str) or dev.lower() not in {k.lower() for k in DEVICE_SPECS}:
            raise _bad("device_type", dev, f"one of {', '.join(DEVICE_SPECS)}")
        dev = next(k for k in DEVICE_SPECS if k.lower() == dev.lower())
    out["device_type"] = dev
    if cfg.get("devices_per_node") is not None:
        out["devices_per_node"] = _positive_int("devices_per_node", cfg["devices_per_node"])
    return out


def _nnscaler_keys(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """nnScaler's ``update_freq`` and ``task_name``, and ``expert_imbalance``, checked."""
    task = cfg.get("task_name")
    if task is not None and not isinstance(task, str):
        raise _bad("task_name", task, "a str")
    imbalance = cfg.get("expert_imbalance", 1.0)
    if isinstance(imbalance, bool) or not isinstance(imbalance, (int, float)) \
            or not imbalance >= 1.0:
        raise _bad("expert_imbalance", imbalance, "a number >= 1.0 (the busiest device's "
                   "tokens over the mean; 1.0 for an even routing, e.g. 1.3)")
    return {"update_freq": _positive_int("update_freq", cfg.get("update_freq", 1)),
            "task_name": task, "expert_imbalance": float(imbalance)}
