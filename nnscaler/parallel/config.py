"""``ReuseType`` and ``BroadcastGenFilesStrategy``: how
[`nnscaler.parallelize`][nnscaler.parallelize] treats the files it generated before.
``ComputeConfig`` and its parts live on the ground floor, in `nnscaler.config` (every layer reads
them); they are re-exported here, where nnScaler users import them from.
"""

from __future__ import annotations

import enum
from typing import Any

from nnscaler.config import (
    DEFAULT_BUCKET_CAP_MB,
    TRACE_STRATEGIES,
    ComputeConfig,
    ComputeConfigError,
    FrozenDict,
    PipelineConfig,
    ReducerConfig,
    TracingConfig,
    jsonable,
)

__all__ = [
    "BroadcastGenFilesStrategy",
    "ComputeConfig",
    "ComputeConfigError",
    "DEFAULT_BUCKET_CAP_MB",
    "FrozenDict",
    "PipelineConfig",
    "ReducerConfig",
    "ReuseType",
    "TRACE_STRATEGIES",
    "TracingConfig",
    "jsonable",
]


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
      [`nnscaler.broadcast_weights`][nnscaler.broadcast_weights].
    - ``CODE``: the generated code only (``gencode*.py``).
    """

    NONE = "none"
    ALL = "all"
    NO_WEIGHTS = "no_weights"
    CODE = "code"
