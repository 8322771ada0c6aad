"""Smaller config classes of `TrainerArgs`, under nnScaler's names: `ResumeOptions`
(``checkpoint.resume_from`` as a mapping), `DebugConfig` (``TrainerArgs.debug``),
`ModuleParallelizeConfig` (an entry of ``model.parallel_modules``) and
`OptionalComputeConfig` (its changes to ``compute_config``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from nnscaler.config import ComputeConfig, ComputeConfigError
from nnscaler.trainer.errors import ConfigError
from nnscaler.trainer.fields import Checked, TypeRef, key_field

__all__ = ["DebugConfig", "ModuleParallelizeConfig", "OptionalComputeConfig", "ResumeOptions"]


@dataclass(kw_only=True)
class ResumeOptions(Checked):
    """Where a run resumes from (``checkpoint.resume_from``; a plain string is its
    ``checkpoint``).

    ``checkpoint``: ``'last'``, ``'best'``, a checkpoint folder or a merged file (a
    ``'last'`` / ``'best'`` that does not exist yet starts from scratch).
    ``convert_fn``: a function (or its import path) ``state -> state`` applied to a
    merged file's contents before they are loaded (e.g. to rename keys of a checkpoint
    written by other code); only for a file. ``with_merged``: for a folder, True loads
    it through the merged state (any plan), False only as this plan's own per-rank
    files (an error when the world size or plan changed), None (the default) picks
    whichever fits.
    """

    checkpoint: str | None = "last"
    convert_fn: TypeRef | None = None
    with_merged: bool | None = None
    _key: str = key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "checkpoint.resume_from")


@dataclass(kw_only=True)
class DebugConfig(Checked):
    """Debug checks of a run (``TrainerArgs.debug``).

    ``check_gradient_sync_cross_devices``: before clipping, check that every rank
    holding a copy of a parameter holds the same reduced gradient (the replicas of a
    scale unit's position, or of a ZeRO group), and raise naming the first parameter
    that differs. One all-gather per parameter: for finding bugs, not for long runs.
    nnScaler turns it on by default; here it is off unless asked for, since it costs a
    collective per parameter at every step.
    """

    check_gradient_sync_cross_devices: bool = False
    _key: str = key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "debug")


_OPTIONAL_FIELDS = ("constant_folding", "trace_strategy", "use_zero", "zero_ngroups",
                    "zero_use_reduce_scatter", "use_async_reducer", "reducer_bucket_cap_mb",
                    "pas_config", "user_config")


@dataclass(frozen=True, kw_only=True)
class OptionalComputeConfig:
    """The fields of [`ComputeConfig`][nnscaler.ComputeConfig] that a parallel submodule may
    change (None: keep the Trainer's). ``resolve(cfg)`` is ``cfg`` with them replaced and
    ``use_end2end=False`` (a submodule is not the end-to-end model)."""

    constant_folding: bool | None = None
    trace_strategy: str | None = None
    use_zero: bool | None = None
    zero_ngroups: int | None = None
    zero_use_reduce_scatter: bool | None = None
    use_async_reducer: bool | None = None
    reducer_bucket_cap_mb: float | None = None
    pas_config: dict[str, Any] | None = None
    user_config: dict[str, Any] | None = None

    def resolve(self, compute_config: ComputeConfig) -> ComputeConfig:
        """``compute_config`` with this config's non-None fields, and ``use_end2end=False``."""
        changes = {name: getattr(self, name) for name in _OPTIONAL_FIELDS
                   if getattr(self, name) is not None}
        try:
            return dataclasses.replace(compute_config, use_end2end=False, **changes)
        except ComputeConfigError as e:
            raise ConfigError(f"a parallel module's compute_config {changes} does not fit "
                              f"the Trainer's: {e}", "compute_config") from e

    @classmethod
    def from_mapping(cls, data: Any, key: str) -> OptionalComputeConfig:
        """Built from a YAML mapping; an unknown key is an error naming it."""
        if isinstance(data, OptionalComputeConfig):
            return data
        if not isinstance(data, dict):
            raise ConfigError(f"{key} must be a mapping of ComputeConfig fields, got "
                              f"{type(data).__name__} {data!r}.", key)
        unknown = sorted(set(data) - set(_OPTIONAL_FIELDS))
        if unknown:
            raise ConfigError(f"{key}: {unknown} cannot be set per parallel module; the "
                              f"fields that can are {list(_OPTIONAL_FIELDS)} (plan_ngpus, "
                              f"runtime_ngpus and the rest come from the Trainer's).", key)
        return cls(**data)


@dataclass(kw_only=True)
class ModuleParallelizeConfig(Checked):
    """A submodule type the Trainer parallelizes instead of the whole model
    (``model.parallel_modules``, nnScaler's form).

    Every instance of ``type`` (exact type) inside the model becomes a parallel module
    that starts from that instance's own weights; the rest of the model runs as written,
    data parallel across the scale units. ``forward_args_gen_fn(trainer_args)`` returns
    the dummy forward arguments to trace with (a tensor that requires grad there is
    traced as one: give the submodule's input ``requires_grad=True`` when a trainable
    layer comes before it). ``args``: build the module traced from ``type(**args)``
    instead of the model's first instance. ``compute_config``: changes to the Trainer's
    (an `OptionalComputeConfig` or its mapping; ``use_end2end`` is always False).
    ``gen_savedir``, ``gen_reuse``, ``pas_policy``, ``broadcast_strategy``,
    ``instance_name``: None takes the Trainer's. nnScaler's ``tracing_from_weights``,
    ``tracing_from_weights_prefix`` and ``precision`` are refused: each instance's own
    weights are loaded after tracing, and the model has one precision.
    """

    type: TypeRef
    forward_args_gen_fn: TypeRef
    args: dict[str, Any] | None = None
    compute_config: Any = None
    gen_savedir: str | None = None
    gen_reuse: str | None = None
    pas_policy: Any = None
    broadcast_strategy: str | None = None
    instance_name: str | None = None
    tracing_from_weights: str | None = None
    tracing_from_weights_prefix: str | None = None
    precision: Any = None
    _key: str = key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "model.parallel_modules")

    def _validate(self, prefix: str) -> None:
        for name, why in (("tracing_from_weights", "each instance's own weights are loaded "
                                                   "into its parallel module after tracing"),
                          ("tracing_from_weights_prefix", "each instance's own weights are "
                                                          "loaded after tracing"),
                          ("precision", "the whole model has one precision "
                                        "(TrainerArgs.precision)")):
            if getattr(self, name) is not None:
                raise ConfigError(f"{prefix}{name} is not supported per parallel module: "
                                  f"{why}. Fix: remove it.", f"{prefix}{name}")
        if self.compute_config is not None:
            self.compute_config = OptionalComputeConfig.from_mapping(
                self.compute_config, f"{prefix}compute_config")
