"""What the one-GPU check's driver (``check.py``) and its checks share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class CheckTimeout(Exception):
    """A check ran past its time limit."""


def timeout_in(error: BaseException) -> CheckTimeout | None:
    """The :class:`CheckTimeout` that ``error`` is or wraps (torch.compile wraps what its
    traced code raises), else None."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, CheckTimeout):
        cause = cause.__cause__ or cause.__context__
    return cause


@dataclass
class Result:
    """One line of the report."""

    status: str  # PASS, FAIL or SKIP
    name: str
    line: str  # the figures, as printed after "<status> <name>: "
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def text(self) -> str:
        return f"{self.status} {self.name}: {self.line}"


@dataclass
class Context:
    """What every check gets: the device, the sizes to use there, a work folder."""

    device: str  # 'cpu' or 'cuda'
    workdir: Path
    missing: dict[str, str]
    peak_tflops: float | None
    steps: int | None  # --steps: timed steps of the throughput and autodist checks
    compile_backend: str  # torch.compile's backend in the throughput check

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"
