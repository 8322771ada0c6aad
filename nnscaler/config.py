"""``ComputeConfig``: the compute environment of a parallel module, one typed value that
every layer reads (this module is on the ground floor: it imports only ``nnscaler.errors``).

``ComputeConfig`` is a frozen dataclass validated when it is built: ``plan_ngpus`` and
``runtime_ngpus`` may be given by position (as in nnScaler), the other fields by keyword.
What the layers read of it comes in typed parts, each parsed and defaulted here, once:

- [`ComputeConfig.pipeline`][nnscaler.ComputeConfig.pipeline] (`PipelineConfig`): the micro-batches
  of each ``train_step`` and the schedule's name; users write them as nnScaler does, in
  ``pas_config['pipeline_nmicros']`` and ``pas_config['pipeline_scheduler']``;
- [`ComputeConfig.reducer`][nnscaler.ComputeConfig.reducer] (`ReducerConfig`): ZeRO, the async
  reducer and the bucket size;
- [`ComputeConfig.tracing`][nnscaler.ComputeConfig.tracing] (`TracingConfig`): how the module is
  traced;
- [`ComputeConfig.compiler`][nnscaler.ComputeConfig.compiler] (`CompileConfig`): torch.compile.

Its JSON form ([`ComputeConfig.to_dict`][nnscaler.ComputeConfig.to_dict]) is what ``config.json``
stores and what ``ReuseType.MATCH`` compares, so it is stable: sorted keys, plain JSON values.
`as_compute_config` turns an object or mapping with the same names (a test's
``SimpleNamespace``) into a ``ComputeConfig``: the one place a duck-typed config is checked.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import numbers
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from nnscaler.config_reducer import (
    DEFAULT_BUCKET_CAP_MB,
    ReducerConfig,
    check_reduce_dtype,
    check_zero_stage,
    check_zero_units,
    zero_stage_choices,
)
from nnscaler.errors import CompileConfigError, ComputeConfigError
from nnscaler.torch_compile import CompileConfig

__all__ = [
    "AUTO",
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_SCHEDULER",
    "TRACE_STRATEGIES",
    "ComputeConfig",
    "ComputeConfigError",
    "FrozenDict",
    "PipelineConfig",
    "ReducerConfig",
    "TracingConfig",
    "as_compute_config",
    "jsonable",
]

#: The tracer's strategies (``nnscaler.trace.STRATEGIES``), spelled out here so that
#: importing the config does not import the tracer.
TRACE_STRATEGIES = ("real", "meta")

#: ``ComputeConfig(plan_ngpus=AUTO)``: the policy (``autodist``) chooses the unit size.
AUTO = "auto"

#: The pipeline schedule used when ``pas_config`` names none.
DEFAULT_SCHEDULER = "1f1b"


# -- frozen, JSON-able values -----------------------------------------------------------
class FrozenDict(Mapping[str, Any]):
    """A read-only, hashable mapping (``pas_config`` and ``user_config`` are stored as one;
    nested dicts become ``FrozenDict`` and lists become tuples)."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data: dict[str, Any] = {k: _freeze(v) for k, v in (data or {}).items()}
        self._hash: int | None = None

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(json.dumps(jsonable(self), sort_keys=True))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._data) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (dict(self._data),))

    def to_dict(self) -> dict[str, Any]:
        """A plain, mutable (deep) copy."""
        return {k: _thaw(v) for k, v in self._data.items()}


def _freeze(value: Any) -> Any:
    if isinstance(value, FrozenDict):
        return value
    if isinstance(value, Mapping):
        return FrozenDict(value)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, FrozenDict):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data, deterministically: mappings with sorted string keys,
    sequences as lists, enums as their value, anything else that JSON cannot hold as its
    ``repr`` (a ``torch.dtype`` becomes ``'torch.float32'``)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v) for v in value), key=repr)
    return repr(value)


# -- the typed parts ----------------------------------------------------------------------
@dataclass(frozen=True)
class PipelineConfig:
    """The pipeline schedule of a staged plan (read by policies and code generation).

    Args:
        nmicros: micro-batches of each ``train_step``; None when not given (a plan that
            cuts the graph into stages then fails, asking for it).
        scheduler: the name of a registered schedule (``nnscaler.schedule``).
    """

    nmicros: int | None = None
    scheduler: str = DEFAULT_SCHEDULER

    @classmethod
    def from_pas_config(cls, pas_config: Mapping[str, Any]) -> PipelineConfig:
        """The ``pipeline_nmicros`` / ``pipeline_scheduler`` keys of ``pas_config``, checked."""
        nmicros = pas_config.get("pipeline_nmicros")
        if nmicros is not None and (isinstance(nmicros, bool) or not isinstance(
                nmicros, numbers.Integral) or nmicros < 1):
            raise ComputeConfigError(
                f"ComputeConfig.pas_config['pipeline_nmicros'] is the number of micro-batches "
                f"of each train_step, a positive int; got {nmicros!r}"
            )
        scheduler = pas_config.get("pipeline_scheduler", DEFAULT_SCHEDULER)
        if not isinstance(scheduler, str) or not scheduler:
            raise ComputeConfigError(
                f"ComputeConfig.pas_config['pipeline_scheduler'] is the name of a registered "
                f"schedule, e.g. {DEFAULT_SCHEDULER!r}; got {scheduler!r}"
            )
        return cls(nmicros=None if nmicros is None else int(nmicros), scheduler=scheduler)


@dataclass(frozen=True)
class TracingConfig:
    """How ``parallelize`` traces the module (read by the tracer's caller and the graph
    reuse check).

    Args:
        strategy: ``'real'`` or ``'meta'`` (`TRACE_STRATEGIES`).
        constant_folding: recorded for nnScaler compatibility (Python values always fold).
        allow_data_dependent: accept a graph that read values from tensor data.
    """

    strategy: str = "real"
    constant_folding: bool = True
    allow_data_dependent: bool = False


# -- checks -------------------------------------------------------------------------------
def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ComputeConfigError(f"ComputeConfig.{name} must be a positive int, got {value!r}; "
                                 f"e.g. ComputeConfig(plan_ngpus=2, runtime_ngpus=4)")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ComputeConfigError(f"ComputeConfig.{name} must be True or False, got {value!r} "
                                 f"({type(value).__name__})")


def _bool_or_none(name: str, value: Any) -> None:
    return None if value is None else _bool(name, value)


def _trace_strategy(name: str, value: Any) -> None:
    if value not in TRACE_STRATEGIES:
        nnscaler_names = ""
        if value in ("cpu", "cuda", "cuda_run_cpu_offload", "reuse_cache"):
            nnscaler_names = (
                f" ({value!r} is nnScaler's: its 'cpu', 'cuda' and 'cuda_run_cpu_offload' run "
                f"the real ops, which is 'real' here, on the device of the dummy inputs and "
                f"weights; 'reuse_cache' has no counterpart)"
            )
        raise ComputeConfigError(
            f"ComputeConfig.trace_strategy must be one of {list(TRACE_STRATEGIES)}, got "
            f"{value!r}: 'real' runs forward on the dummy inputs, 'meta' on the meta device "
            f"(shapes only, fast, but no values can be read from tensor data){nnscaler_names}"
        )


def _bucket_cap(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
        raise ComputeConfigError(
            f"ComputeConfig.reducer_bucket_cap_mb must be a positive number of MiB, or 0 or "
            f"None for the reducer's default ({DEFAULT_BUCKET_CAP_MB} MiB), got {value!r}"
        )


def _mapping(name: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise ComputeConfigError(
            f"ComputeConfig.{name} must be a dict, got {type(value).__name__} {value!r}"
        )
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise ComputeConfigError(
            f"ComputeConfig.{name} must be keyed by strings (it is stored as JSON in "
            f"config.json), got the keys {bad!r}"
        )


def _world_size() -> int:
    """nnScaler's default ``runtime_ngpus``: the job's ``$WORLD_SIZE`` (set by torchrun)."""
    text = os.environ.get("WORLD_SIZE")
    if text is None or not text.strip().isdigit() or int(text) < 1:
        raise ComputeConfigError(
            f"ComputeConfig.runtime_ngpus was not given, so it is taken from $WORLD_SIZE (as "
            f"in nnScaler), but $WORLD_SIZE is {text!r}; launch with torchrun or pass it: "
            f"ComputeConfig(plan_ngpus, runtime_ngpus)"
        )
    return int(text)


def _compile(name: str, value: Any) -> None:
    try:
        CompileConfig.from_value(value)
    except CompileConfigError as e:
        raise ComputeConfigError(str(e)) from None


def _near_multiples(value: int, step: int) -> str:
    below, above = value // step * step, -(-value // step) * step
    return " or ".join(str(m) for m in dict.fromkeys((below, above)) if m > 0)


def _check(fn: Callable[[str, Any], None]) -> dict[str, Any]:
    return {"check": fn}


@dataclass(frozen=True)
class ComputeConfig:
    """The compute environment of a parallel module.

    ``plan_ngpus`` and ``runtime_ngpus`` may be given by position, every other field by
    keyword only. A *scale unit* is ``plan_ngpus`` devices that run one copy of the plan;
    ``runtime_ngpus // plan_ngpus`` units run data parallel. ``dataclasses.replace``
    gives a changed copy, validated again.

    Args:
        plan_ngpus: devices in one scale unit (the policy places ops on ``0..plan_ngpus-1``),
            or ``'auto'``: ``autodist`` chooses it (``parallelize`` then uses `resolved`).
        runtime_ngpus: devices of the whole job; a positive multiple of ``plan_ngpus``.
            Left out (None), it is ``$WORLD_SIZE``, as in nnScaler.
        use_zero: shard optimizer state (ZeRO stage 1) over the data-parallel replicas.
        zero_ngroups: split the replicas into this many ZeRO groups (state replicated
            across groups); must divide the number of scale units; 1 unless ``use_zero``.
        zero_stage: 0 to 3, what is sharded (``docs/zero.md``); None follows ``use_zero``,
            which (left out) follows it; the two given must agree. ``'auto'``: ``autodist``
            chooses it (among `zero_stages`; ``parallelize`` then uses `resolved`).
        zero_units: stage 3's gathering units by module path (``docs/zero.md``).
        reduce_dtype: the dtype ZeRO stages 2 and 3 reduce-scatter gradients in
            (``'float32'`` under bf16 parameters); None: the parameters' dtype.
        use_end2end: the module returns its loss first; train with ``train_step``.
        inference_only: generate code for inference only (no gradient reducers).
        constant_folding: kept for nnScaler compatibility (recorded, compared for reuse):
            the tracer always folds Python values such as shapes into constants.
        trace_strategy: ``'real'`` (run forward on the dummy inputs) or ``'meta'``.
        use_async_reducer: overlap gradient reduction with backward.
        reducer_bucket_cap_mb: reducer bucket size in MiB; None or 0 (nnScaler's spelling)
            for the default (25). 0 is stored as None, so the two configs are equal.
        zero_use_reduce_scatter: nnScaler's choice between reduce-scatter and all-reduce
            for ZeRO gradients; only with ``use_zero=True``. The ZeRO reducer here always
            reduce-scatters (both give every shard the same sum), so the flag is recorded
            (and compared for reuse) but changes no result.
        allow_data_dependent: accept a traced graph that read values or sizes from
            tensor data (``if x.sum() > 0:``, ``x.item()``, ``torch.nonzero``): the values
            the dummy inputs gave are then used for every batch. Off: ``parallelize``
            refuses such a graph, naming each line (``docs/tracing.md``).
        check_custom_ops: at ``parallelize``, check every op registered outside the
            built-ins whose pieces the plan runs against its annotation, on random inputs
            of its traced shapes (``docs/annotations.md``); off skips the check.
        pas_config: options for the policy (read by policies as
            ``compute_config.pas_config``); ``pipeline_nmicros`` and
            ``pipeline_scheduler`` are read into [`pipeline`][nnscaler.ComputeConfig.pipeline] for
            every layer.
        user_config: anything else that should decide whether generated code is reused
            (e.g. the model's constructor arguments when a class is parallelized).
        compile: ``torch.compile`` the generated code between communications: False, True
            (inductor) or a dict of `nnscaler.torch_compile.COMPILE_KEYS` (docs/compile.md).
    """

    plan_ngpus: int | str = field(
        metadata=_check(lambda n, v: None if v == AUTO else _positive_int(n, v)))
    runtime_ngpus: int = field(default=None, metadata=_check(_positive_int))  # type: ignore[assignment]
    _: KW_ONLY
    use_zero: bool = field(default=None, metadata=_check(_bool_or_none))  # type: ignore[assignment]
    zero_ngroups: int = field(default=1, metadata=_check(_positive_int))
    zero_stage: int | str | None = field(
        default=None, metadata=_check(lambda n, v: None if v == AUTO else check_zero_stage(n, v)))
    zero_units: Sequence[str] = field(default=(), metadata=_check(check_zero_units))
    reduce_dtype: str | None = field(default=None, metadata=_check(check_reduce_dtype))
    use_end2end: bool = field(default=False, metadata=_check(_bool))
    inference_only: bool = field(default=False, metadata=_check(_bool))
    constant_folding: bool = field(default=True, metadata=_check(_bool))
    trace_strategy: str = field(default="real", metadata=_check(_trace_strategy))
    use_async_reducer: bool = field(default=False, metadata=_check(_bool))
    reducer_bucket_cap_mb: float | None = field(default=None, metadata=_check(_bucket_cap))
    zero_use_reduce_scatter: bool = field(default=False, metadata=_check(_bool))
    allow_data_dependent: bool = field(default=False, metadata=_check(_bool))
    check_custom_ops: bool = field(default=True, metadata=_check(_bool))
    pas_config: Mapping[str, Any] = field(default_factory=FrozenDict,
                                          metadata=_check(_mapping))
    user_config: Mapping[str, Any] = field(default_factory=FrozenDict,
                                           metadata=_check(_mapping))
    compile: bool | Mapping[str, Any] = field(default=False, metadata=_check(_compile))

    def __post_init__(self) -> None:
        if self.runtime_ngpus is None:
            _positive_int("plan_ngpus", self.plan_ngpus)  # its own error comes first
            object.__setattr__(self, "runtime_ngpus", _world_size())
        for f in dataclasses.fields(self):
            f.metadata["check"](f.name, getattr(self, f.name))
        if self.reducer_bucket_cap_mb == 0:
            object.__setattr__(self, "reducer_bucket_cap_mb", None)
        self._settle_zero_stage()
        if self.zero_use_reduce_scatter and (not self.use_zero or self.zero_ngroups != 1):
            raise ComputeConfigError(
                f"ComputeConfig.zero_use_reduce_scatter only applies with use_zero=True and "
                f"zero_ngroups=1 (as in nnScaler); got use_zero={self.use_zero}, "
                f"zero_ngroups={self.zero_ngroups}. Leave zero_use_reduce_scatter at False"
            )
        if isinstance(self.compile, Mapping) and not isinstance(self.compile, FrozenDict):
            object.__setattr__(self, "compile", FrozenDict(self.compile))
        for name in ("pas_config", "user_config"):
            if not isinstance(getattr(self, name), FrozenDict):
                object.__setattr__(self, name, FrozenDict(getattr(self, name)))
        if self.plan_ngpus != AUTO and self.runtime_ngpus % self.plan_ngpus:
            raise ComputeConfigError(
                f"ComputeConfig.runtime_ngpus must be a multiple of plan_ngpus (each scale "
                f"unit of plan_ngpus devices runs one copy of the plan), got "
                f"runtime_ngpus={self.runtime_ngpus}, plan_ngpus={self.plan_ngpus}; use a "
                f"multiple such as {_near_multiples(self.runtime_ngpus, self.plan_ngpus)}"
            )
        object.__setattr__(self, "zero_units", tuple(self.zero_units))
        stage = max(self.zero_stages)  # 'auto' with a reduce_dtype chooses stage 2 or 3
        if self.reduce_dtype is not None and stage < 2:
            raise ComputeConfigError(f"ComputeConfig.reduce_dtype={self.reduce_dtype!r} is the "
                                     f"dtype of ZeRO stage 2 and 3's reduce-scatter, but "
                                     f"zero_stage is {stage}; set zero_stage=2 or 3")
        if self.zero_units and self.zero_stage != 3:
            raise ComputeConfigError(f"ComputeConfig.zero_units names ZeRO stage 3's units, but "
                                     f"zero_stage is {self.zero_stage}; set zero_stage=3")
        units = self.runtime_ngpus if self.plan_ngpus == AUTO else self.scale_units
        if not self.use_zero and self.zero_ngroups != 1:
            raise ComputeConfigError(
                f"ComputeConfig.zero_ngroups only applies with use_zero=True; got "
                f"zero_ngroups={self.zero_ngroups} with use_zero=False. Set use_zero=True or "
                f"leave zero_ngroups at 1"
            )
        if units % self.zero_ngroups:
            divisors = [d for d in range(1, units + 1) if units % d == 0]
            raise ComputeConfigError(
                f"ComputeConfig.zero_ngroups must divide the number of scale units "
                f"(runtime_ngpus // plan_ngpus = {units}), got {self.zero_ngroups}; pick one "
                f"of {divisors}"
            )
        object.__setattr__(self, "_pipeline", PipelineConfig.from_pas_config(self.pas_config))

    def _settle_zero_stage(self) -> None:
        """Make ``use_zero`` and ``zero_stage`` one answer (see the class docstring)."""
        use, stage = self.use_zero, self.zero_stage
        if stage == AUTO:  # the policy chooses; use_zero=True keeps stage 0 out of the choice
            if use is False:
                raise ComputeConfigError("ComputeConfig: use_zero=False disagrees with "
                                         "zero_stage='auto' (autodist chooses a stage); leave "
                                         "use_zero out, True to choose among stages 1 to 3, or "
                                         "set zero_stage=0")
            return
        if stage is not None and use is not None and use != (stage >= 1):
            raise ComputeConfigError(f"ComputeConfig: use_zero={use} disagrees with zero_stage="
                                     f"{stage} (use_zero is stage >= 1); give one, or both "
                                     f"agreeing (replace() of one needs the other too)")
        object.__setattr__(self, "use_zero", bool(use) if stage is None else stage >= 1)

    # -- the typed parts ----------------------------------------------------------------
    @property
    def pipeline(self) -> PipelineConfig:
        """The pipeline schedule: ``pas_config['pipeline_nmicros']`` and
        ``pas_config['pipeline_scheduler']`` (default `DEFAULT_SCHEDULER`), checked."""
        return self._pipeline  # type: ignore[attr-defined, no-any-return]

    @property
    def zero_stages(self) -> tuple[int, ...]:
        """The ZeRO stages this config allows: its stage, or for ``zero_stage='auto'`` the
        stages the policy chooses among (`zero_stage_choices`)."""
        if self.zero_stage == AUTO:
            return zero_stage_choices(self.use_zero, self.reduce_dtype)
        return (self.reducer.zero_stage,)

    @property
    def reducer(self) -> ReducerConfig:
        """The gradient reducer's options, with the default bucket size filled in."""
        if self.zero_stage == AUTO:
            raise ComputeConfigError("ComputeConfig(zero_stage='auto') has no reducer until "
                                     "autodist chooses the stage in parallelize; read it from "
                                     "the parallel module's reducers, or give zero_stage")
        return ReducerConfig(use_zero=self.use_zero, zero_ngroups=self.zero_ngroups,
                             async_op=self.use_async_reducer, bucket_cap_mb=self.bucket_cap_mb,
                             zero_stage=self.zero_stage,  # None: follows use_zero
                             zero_units=tuple(self.zero_units),
                             reduce_dtype=self.reduce_dtype)

    @property
    def tracing(self) -> TracingConfig:
        """How the module is traced."""
        return TracingConfig(strategy=self.trace_strategy,
                             constant_folding=self.constant_folding,
                             allow_data_dependent=self.allow_data_dependent)

    @property
    def compiler(self) -> CompileConfig:
        """``torch.compile`` of the generated code: the ``compile`` field, checked."""
        return CompileConfig.from_value(self.compile)

    # -- derived ------------------------------------------------------------------------
    def resolved(self, plan_ngpus: int | None = None, *,
                 zero_stage: int | None = None) -> ComputeConfig:
        """This config with ``plan_ngpus`` and/or ``zero_stage`` (what a policy chose for
        ``'auto'``; ``use_zero`` follows the stage); None keeps a field as it is."""
        changes: dict[str, Any] = {} if plan_ngpus is None else {"plan_ngpus": plan_ngpus}
        if zero_stage is not None:
            if zero_stage not in self.zero_stages:
                raise ComputeConfigError(
                    f"ComputeConfig: zero_stage={zero_stage!r} is not a stage this config "
                    f"allows ({list(self.zero_stages)}, from zero_stage={self.zero_stage!r}, "
                    f"use_zero={self.use_zero!r}, reduce_dtype={self.reduce_dtype!r})")
            changes.update(zero_stage=zero_stage, use_zero=zero_stage >= 1)
        return dataclasses.replace(self, **changes)

    @property
    def scale_units(self) -> int:
        """How many copies of the plan run data parallel: ``runtime_ngpus // plan_ngpus``."""
        if self.plan_ngpus == AUTO:
            raise ComputeConfigError("ComputeConfig(plan_ngpus='auto') has no scale units "
                                     "until autodist chooses plan_ngpus in parallelize; read "
                                     "it from the parallel module, or give it")
        return self.runtime_ngpus // self.plan_ngpus

    @property
    def bucket_cap_mb(self) -> float:
        """``reducer_bucket_cap_mb``, or the default when it is None."""
        if self.reducer_bucket_cap_mb is None:
            return DEFAULT_BUCKET_CAP_MB
        return float(self.reducer_bucket_cap_mb)

    def unit_ranks(self, rank: int) -> tuple[int, ...]:
        """The runtime ranks of the scale unit that ``rank`` belongs to."""
        _ = self.scale_units  # raises for an unresolved 'auto'
        start = rank // self.plan_ngpus * self.plan_ngpus
        return tuple(range(start, start + self.plan_ngpus))

    def replica_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks at ``rank``'s position in every scale unit (data parallel replicas)."""
        end = self.scale_units * self.plan_ngpus  # runtime_ngpus; raises for 'auto'
        return tuple(range(rank % self.plan_ngpus, end, self.plan_ngpus))

    # -- serialization ------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Every field, in order (what [`to_dict`][nnscaler.ComputeConfig.to_dict] holds)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form stored in ``config.json``: every field, plain JSON values."""
        return {name: jsonable(getattr(self, name)) for name in self.field_names()}

    def to_json(self) -> str:
        """[`to_dict`][nnscaler.ComputeConfig.to_dict] as canonical JSON text (sorted keys): equal
        configs, equal text."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ComputeConfig:
        """The config that [`to_dict`][nnscaler.ComputeConfig.to_dict] gave ``data`` for (unknown
        keys are an error)."""
        names = set(cls.field_names())
        unknown = sorted(set(data) - names)
        if unknown:
            raise ComputeConfigError(
                f"ComputeConfig has no field(s) {unknown}; its fields are {sorted(names)}"
            )
        for required in ("plan_ngpus",):
            if required not in data:
                raise ComputeConfigError(f"ComputeConfig.{required} is required (missing); "
                                         f"e.g. ComputeConfig(plan_ngpus=2, runtime_ngpus=4)")
        return cls(**dict(data))

    def diff(self, other: ComputeConfig | Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """``{field: (self's value, other's value)}`` for every field whose JSON form differs."""
        mine = self.to_dict()
        theirs = other.to_dict() if isinstance(other, ComputeConfig) else dict(other)
        keys = sorted(set(mine) | set(theirs))
        return {k: (mine.get(k), theirs.get(k)) for k in keys if mine.get(k) != theirs.get(k)}


def as_compute_config(value: Any, *, plan_ngpus: int | None = None,
                      runtime_ngpus: int | None = None) -> ComputeConfig:
    """``value`` as a [`ComputeConfig`][nnscaler.ComputeConfig]: itself, or one built from the
    fields of a mapping or of an object's attributes (``types.SimpleNamespace(plan_ngpus=2,
    pas_config={...})``), or None for the defaults. ``plan_ngpus`` / ``runtime_ngpus``
    fill in what ``value`` lacks (``runtime_ngpus`` defaults to ``plan_ngpus``)."""
    if isinstance(value, ComputeConfig):
        return value
    names = ComputeConfig.field_names()
    if value is None:
        data: dict[str, Any] = {}
    elif isinstance(value, Mapping):
        data = dict(value)
    elif hasattr(value, "plan_ngpus") or plan_ngpus is not None:
        data = {n: getattr(value, n) for n in names if hasattr(value, n)}
    else:
        raise ComputeConfigError(
            f"a compute config must be an nnscaler.ComputeConfig (or an object with its "
            f"fields: plan_ngpus, runtime_ngpus, pas_config, ...), got "
            f"{type(value).__name__} {value!r}; pass ComputeConfig(plan_ngpus, runtime_ngpus)"
        )
    data = {k: v for k, v in data.items() if not (k in ("pas_config", "user_config")
                                                     and v is None)}
    if plan_ngpus is not None:
        data.setdefault("plan_ngpus", plan_ngpus)
    if "plan_ngpus" in data:
        data.setdefault("runtime_ngpus", runtime_ngpus or data["plan_ngpus"])
    return ComputeConfig.from_dict(data)
