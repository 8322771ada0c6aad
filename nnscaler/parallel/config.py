"""``ComputeConfig``, ``ReuseType`` and ``BroadcastGenFilesStrategy``: the settings of
:func:`nnscaler.parallelize`.

``ComputeConfig`` is a frozen, keyword-only attrs class validated when it is built. Its
JSON form (:meth:`ComputeConfig.to_dict`) is what ``config.json`` stores and what
``ReuseType.MATCH`` compares, so it is stable: sorted keys, plain JSON values.
"""

from __future__ import annotations

import enum
import json
import numbers
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from nnscaler.errors import NNScalerError

__all__ = [
    "BroadcastGenFilesStrategy",
    "ComputeConfig",
    "ComputeConfigError",
    "FrozenDict",
    "ReuseType",
    "TRACE_STRATEGIES",
    "jsonable",
]

#: The tracer's strategies (``nnscaler.trace.STRATEGIES``), spelled out here so that
#: importing the config does not import the tracer.
TRACE_STRATEGIES = ("real", "meta")


class ComputeConfigError(NNScalerError, ValueError):
    """A ``ComputeConfig`` field with a value that cannot work."""


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


# -- validators ---------------------------------------------------------------------------
def _positive_int(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ComputeConfigError(
            f"ComputeConfig.{attribute.name} must be a positive int, got {value!r}; e.g. "
            f"ComputeConfig(plan_ngpus=2, runtime_ngpus=4)"
        )


def _bool(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ComputeConfigError(
            f"ComputeConfig.{attribute.name} must be True or False, got {value!r} "
            f"({type(value).__name__})"
        )


def _trace_strategy(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in TRACE_STRATEGIES:
        raise ComputeConfigError(
            f"ComputeConfig.trace_strategy must be one of {list(TRACE_STRATEGIES)}, got "
            f"{value!r}: 'real' runs forward on the dummy inputs, 'meta' on the meta device "
            f"(shapes only, fast, but no values can be read from tensor data)"
        )


def _bucket_cap(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ComputeConfigError(
            f"ComputeConfig.reducer_bucket_cap_mb must be a positive number of MiB or None "
            f"(the reducer's default, {DEFAULT_BUCKET_CAP_MB} MiB), got {value!r}"
        )


def _mapping(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise ComputeConfigError(
            f"ComputeConfig.{attribute.name} must be a dict, got {type(value).__name__} "
            f"{value!r}"
        )
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise ComputeConfigError(
            f"ComputeConfig.{attribute.name} must be keyed by strings (it is stored as "
            f"JSON in config.json), got the keys {bad!r}"
        )


def _to_frozen(value: Any) -> Any:
    if isinstance(value, Mapping) and not isinstance(value, FrozenDict):
        if any(not isinstance(k, str) for k in value):
            return value  # the validator reports it
        return FrozenDict(value)
    return value


def _near_multiples(value: int, step: int) -> str:
    below, above = value // step * step, -(-value // step) * step
    return " or ".join(str(m) for m in dict.fromkeys((below, above)) if m > 0)


#: The bucket size the reducer uses when ``reducer_bucket_cap_mb`` is None (MiB).
DEFAULT_BUCKET_CAP_MB = 25.0


@attrs.frozen(kw_only=True)
class ComputeConfig:
    """The compute environment of a parallel module.

    Every field is keyword-only. A *scale unit* is ``plan_ngpus`` devices that run one
    copy of the plan; ``runtime_ngpus // plan_ngpus`` units run data parallel.

    Args:
        plan_ngpus: devices in one scale unit (the policy places ops on ``0..plan_ngpus-1``).
        runtime_ngpus: devices of the whole job; a positive multiple of ``plan_ngpus``.
        use_zero: shard optimizer state (ZeRO stage 1) over the data-parallel replicas.
        zero_ngroups: split the replicas into this many ZeRO groups (state replicated
            across groups); must divide the number of scale units; 1 unless ``use_zero``.
        use_end2end: the module returns its loss first; train with ``train_step``.
        inference_only: generate code for inference only (no gradient reducers).
        constant_folding: kept for nnScaler compatibility (recorded, compared for reuse):
            the tracer always folds Python values such as shapes into constants.
        trace_strategy: ``'real'`` (run forward on the dummy inputs) or ``'meta'``.
        use_async_reducer: overlap gradient reduction with backward.
        reducer_bucket_cap_mb: reducer bucket size in MiB; None for the default (25).
        allow_data_dependent: accept a traced graph that read values or sizes from
            tensor data (``if x.sum() > 0:``, ``x.item()``, ``torch.nonzero``): the values
            the dummy inputs gave are then used for every batch. Off: ``parallelize``
            refuses such a graph, naming each line (``docs/tracing.md``).
        check_custom_ops: at ``parallelize``, check every op registered outside the
            built-ins whose pieces the plan runs against its annotation, on random inputs
            of its traced shapes (``docs/annotations.md``); off skips the check.
        pas_config: options for the policy (read by policies as
            ``compute_config.pas_config``).
        user_config: anything else that should decide whether generated code is reused
            (e.g. the model's constructor arguments when a class is parallelized).
    """

    plan_ngpus: int = attrs.field(validator=_positive_int)
    runtime_ngpus: int = attrs.field(validator=_positive_int)
    use_zero: bool = attrs.field(default=False, validator=_bool)
    zero_ngroups: int = attrs.field(default=1, validator=_positive_int)
    use_end2end: bool = attrs.field(default=False, validator=_bool)
    inference_only: bool = attrs.field(default=False, validator=_bool)
    constant_folding: bool = attrs.field(default=True, validator=_bool)
    trace_strategy: str = attrs.field(default="real", validator=_trace_strategy)
    use_async_reducer: bool = attrs.field(default=False, validator=_bool)
    reducer_bucket_cap_mb: float | None = attrs.field(default=None, validator=_bucket_cap)
    allow_data_dependent: bool = attrs.field(default=False, validator=_bool)
    check_custom_ops: bool = attrs.field(default=True, validator=_bool)
    pas_config: FrozenDict = attrs.field(
        factory=FrozenDict, converter=_to_frozen, validator=_mapping
    )
    user_config: FrozenDict = attrs.field(
        factory=FrozenDict, converter=_to_frozen, validator=_mapping
    )

    def __attrs_post_init__(self) -> None:
        if self.runtime_ngpus % self.plan_ngpus:
            raise ComputeConfigError(
                f"ComputeConfig.runtime_ngpus must be a multiple of plan_ngpus (each scale "
                f"unit of plan_ngpus devices runs one copy of the plan), got "
                f"runtime_ngpus={self.runtime_ngpus}, plan_ngpus={self.plan_ngpus}; use a "
                f"multiple such as {_near_multiples(self.runtime_ngpus, self.plan_ngpus)}"
            )
        units = self.scale_units
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

    # -- derived ------------------------------------------------------------------------
    @property
    def scale_units(self) -> int:
        """How many copies of the plan run data parallel: ``runtime_ngpus // plan_ngpus``."""
        return self.runtime_ngpus // self.plan_ngpus

    @property
    def bucket_cap_mb(self) -> float:
        """``reducer_bucket_cap_mb``, or the default when it is None."""
        if self.reducer_bucket_cap_mb is None:
            return DEFAULT_BUCKET_CAP_MB
        return float(self.reducer_bucket_cap_mb)

    def unit_ranks(self, rank: int) -> tuple[int, ...]:
        """The runtime ranks of the scale unit that ``rank`` belongs to."""
        start = rank // self.plan_ngpus * self.plan_ngpus
        return tuple(range(start, start + self.plan_ngpus))

    def replica_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks at ``rank``'s position in every scale unit (data parallel replicas)."""
        return tuple(range(rank % self.plan_ngpus, self.runtime_ngpus, self.plan_ngpus))

    # -- serialization ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON form stored in ``config.json``: every field, plain JSON values."""
        return {a.name: jsonable(getattr(self, a.name)) for a in attrs.fields(type(self))}

    def to_json(self) -> str:
        """:meth:`to_dict` as canonical JSON text (sorted keys): equal configs, equal text."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ComputeConfig:
        """The config that :meth:`to_dict` gave ``data`` for (unknown keys are an error)."""
        names = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ComputeConfigError(
                f"ComputeConfig has no field(s) {unknown}; its fields are {sorted(names)}"
            )
        return cls(**dict(data))

    def diff(self, other: ComputeConfig | Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """``{field: (self's value, other's value)}`` for every field whose JSON form differs."""
        mine = self.to_dict()
        theirs = other.to_dict() if isinstance(other, ComputeConfig) else dict(other)
        keys = sorted(set(mine) | set(theirs))
        return {k: (mine.get(k), theirs.get(k)) for k in keys if mine.get(k) != theirs.get(k)}


class _LenientEnum(str, enum.Enum):
    """An enum that also accepts its value or name in any case (``'match'``, ``'MATCH'``)."""

    @classmethod
    def _missing_(cls, value: object) -> Any:
        if isinstance(value, str):
            key = value.strip().lower()
            for member in cls:
                if key in (member.value, member.name.lower()):
                    return member
        return None

    @classmethod
    def parse(cls, value: Any, what: str) -> Any:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise ValueError(
                f"{what} must be a {cls.__name__} or one of the strings {choices}, got "
                f"{value!r}"
            ) from None

    def __str__(self) -> str:
        return self.value


class ReuseType(_LenientEnum):
    """What ``parallelize`` may reuse from files generated before (in ``gen_savedir``).

    - ``MATCH``: reuse the generated files if their config matches this call; a different
      config is an error naming what differs; generate if there are none.
    - ``OVERRIDE``: always regenerate (what was there is removed first).
    - ``MOO`` (match or override): reuse if the config matches, regenerate otherwise.
    - ``GRAPH``: reuse the traced graph if one was saved for the same module and inputs;
      always regenerate the code.
    """

    MATCH = "match"
    OVERRIDE = "override"
    MOO = "moo"
    GRAPH = "graph"


class BroadcastGenFilesStrategy(_LenientEnum):
    """Which newly generated files rank 0 sends to the other nodes (never reused files).

    - ``NONE``: nothing (one node, or a shared file system).
    - ``ALL``: every file (code, weights, graph, config).
    - ``NO_WEIGHTS``: every file except the initial weights (``fullmodel.pt``); build
      the module with ``init_module_params=False`` off node 0 and call
      :func:`nnscaler.broadcast_weights`.
    - ``CODE``: the generated code only (``gencode*.py``).
    """

    NONE = "none"
    ALL = "all"
    NO_WEIGHTS = "no_weights"
    CODE = "code"
