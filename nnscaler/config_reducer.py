"""``ReducerConfig``: the typed part of `nnscaler.ComputeConfig` that says how gradients
are reduced across data-parallel replicas (ZeRO's stage, groups and units, the async
reducer, the bucket size, the dtype of the reduce-scatter), with the checks of those
fields. Below `nnscaler.config`, which re-exports it; it imports only ``nnscaler.errors``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nnscaler.errors import ComputeConfigError

__all__ = ["DEFAULT_BUCKET_CAP_MB", "REDUCE_DTYPES", "ZERO_STAGES", "ReducerConfig",
           "check_reduce_dtype", "check_zero_stage", "check_zero_units", "zero_stage_choices"]

#: The bucket size the reducer uses when ``reducer_bucket_cap_mb`` is None (MiB).
DEFAULT_BUCKET_CAP_MB = 25.0

ZERO_STAGES = (0, 1, 2, 3)  #: what ``ComputeConfig.zero_stage`` accepts (docs/zero.md)

#: What ``ComputeConfig.reduce_dtype`` accepts (torch dtype names; None: the parameters').
REDUCE_DTYPES = ("float32", "bfloat16", "float16")


def check_zero_stage(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or value not in ZERO_STAGES):
        raise ComputeConfigError(f"ComputeConfig.{name} must be one of {list(ZERO_STAGES)} or "
                                 f"None (follow use_zero), got {value!r}: 0 shards nothing, 1 "
                                 f"the optimizer state, 2 the gradients too, 3 the parameters")


def zero_stage_choices(use_zero: bool | None, reduce_dtype: str | None) -> tuple[int, ...]:
    """The stages ``zero_stage='auto'`` may choose among: every stage, those from 1 up when
    ``use_zero=True`` is given too, those from 2 up with a ``reduce_dtype`` (the dtype of
    stages 2 and 3's reduce-scatter)."""
    low = 2 if reduce_dtype is not None else int(bool(use_zero))
    return tuple(s for s in ZERO_STAGES if s >= low)


def check_zero_units(name: str, value: Any) -> None:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(
            isinstance(u, str) and u for u in value) or len(set(value)) != len(value):
        raise ComputeConfigError(f"ComputeConfig.{name} must be a list of distinct module "
                                 f"paths (strings such as 'gpt.blocks.0'), got {value!r}")


def check_reduce_dtype(name: str, value: Any) -> None:
    if value is not None and value not in REDUCE_DTYPES:
        raise ComputeConfigError(f"ComputeConfig.{name} is the dtype ZeRO stages 2 and 3 "
                                 f"reduce-scatter gradients in, one of {list(REDUCE_DTYPES)} "
                                 f"or None (the parameters' dtype), got {value!r}")


@dataclass(frozen=True)
class ReducerConfig:
    """How gradients are reduced across data-parallel replicas (read by code generation,
    the runtime and ``build_optimizer``).

    Args:
        use_zero: shard over the replicas (ZeRO stage 1 or more; ``zero_stage`` says which).
        zero_ngroups: ZeRO groups the replicas are split into.
        async_op: overlap the reduction with backward.
        bucket_cap_mb: bucket size in MiB (the default when the config says None).
        zero_units: stage 3's gathering units, by module path (empty: the blocks).
        zero_stage: 0 to 3 (``docs/zero.md``); None follows ``use_zero``.
        reduce_dtype: stages 2 and 3: the dtype of the reduce-scatter (`REDUCE_DTYPES`);
            None: the parameters' dtype.
    """

    use_zero: bool = False
    zero_ngroups: int = 1
    async_op: bool = False
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    zero_stage: int | None = None
    zero_units: tuple[str, ...] = ()
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "zero_units", tuple(self.zero_units))
        if self.zero_stage is None:  # follows use_zero, as in ComputeConfig
            object.__setattr__(self, "zero_stage", int(self.use_zero))
        if self.use_zero != (self.zero_stage >= 1):
            raise ComputeConfigError(f"ReducerConfig: use_zero={self.use_zero} disagrees with "
                                     f"zero_stage={self.zero_stage}; set both or one")
        check_reduce_dtype("reduce_dtype", self.reduce_dtype)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ReducerConfig:
        """The inverse of `as_options` (a generated class's ``reducer_config``);
        missing keys and a None bucket size take the defaults."""
        cap, stage = options.get("reducer_bucket_cap_mb"), options.get("zero_stage")
        return cls(use_zero=bool(options.get("use_zero", False)),
                   zero_ngroups=int(options.get("zero_ngroups", 1)),
                   async_op=bool(options.get("use_async_reducer", False)),
                   bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if cap is None else float(cap),
                   zero_stage=None if stage is None else int(stage),
                   zero_units=tuple(options.get("zero_units", ())),
                   reduce_dtype=options.get("reduce_dtype"))

    def as_options(self) -> dict[str, Any]:
        """The reducer options under their ``ComputeConfig`` names (what generated code
        and ``config.json`` spell); ``reduce_dtype`` only when set, so that files
        generated before it existed read the same."""
        out = {"use_zero": self.use_zero, "zero_ngroups": self.zero_ngroups,
               "use_async_reducer": self.async_op, "reducer_bucket_cap_mb": self.bucket_cap_mb,
               "zero_stage": self.zero_stage, "zero_units": list(self.zero_units)}
        if self.reduce_dtype is not None:
            out["reduce_dtype"] = self.reduce_dtype
        return out
