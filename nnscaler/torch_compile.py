"""``CompileConfig``: the typed part of ``ComputeConfig(compile=...)``, ``torch.compile`` of
the generated code (``docs/compile.md``). Below `nnscaler.config`, which reads it; code
generation records it in each ``gencode{rank}.py`` and the runtime compiles with it
(`nnscaler.runtime.compiling`). It imports only ``nnscaler.errors``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nnscaler.errors import CompileConfigError

__all__ = ["COMPILE_KEYS", "CompileConfig", "CompileConfigError"]

#: The keys of ``ComputeConfig(compile={...})``: ``torch.compile``'s keywords that can work
#: on generated code (``fullgraph`` cannot: communication splits the graph).
COMPILE_KEYS = ("backend", "mode", "dynamic", "options")


def _check(value: Any) -> None:
    if not isinstance(value, Mapping):
        raise CompileConfigError(
            f"ComputeConfig.compile must be True, False or a dict of torch.compile options "
            f"with keys from {list(COMPILE_KEYS)}, got {type(value).__name__} {value!r}")
    if "fullgraph" in value:
        raise CompileConfigError(
            "ComputeConfig.compile cannot take 'fullgraph': the generated code communicates "
            "between its compiled regions (adapters, collective part ops), so it is never "
            "one graph. Leave 'fullgraph' out")
    unknown = sorted(set(value) - set(COMPILE_KEYS))
    if unknown:
        raise CompileConfigError(
            f"ComputeConfig.compile has unknown key(s) {unknown}; it takes "
            f"{list(COMPILE_KEYS)} (torch.compile's keywords), e.g. "
            f"{{'backend': 'inductor', 'mode': 'max-autotune'}}")
    backend = value.get("backend", "inductor")
    if not isinstance(backend, str) or not backend:
        raise CompileConfigError(
            f"ComputeConfig.compile['backend'] must be the name of a torch.compile backend "
            f"(a str such as 'inductor'; a callable cannot be stored in config.json), got "
            f"{backend!r}")
    mode, dynamic = value.get("mode"), value.get("dynamic", False)
    if not isinstance(mode, (str, type(None))) or not isinstance(dynamic, (bool, type(None))):
        raise CompileConfigError(
            f"ComputeConfig.compile['mode'] must be a str or None and ['dynamic'] True, False "
            f"or None, got mode={mode!r}, dynamic={dynamic!r}")
    options = value.get("options") or {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise CompileConfigError(
            f"ComputeConfig.compile['options'] must be a dict keyed by strings (the "
            f"backend's options), got {options!r}")


@dataclass(frozen=True)
class CompileConfig:
    """``torch.compile`` of the generated code.

    Args:
        enabled: compile each rank's forward and, through AOTAutograd, its backward, in
            regions between communication (the collectives run eagerly between them).
        backend: a ``torch.compile`` backend (``'inductor'``, ``'aot_eager'``, ...).
        mode: inductor's mode (``'default'``, ``'reduce-overhead'``, ``'max-autotune'``)
            or None.
        dynamic: ``torch.compile``'s ``dynamic``; False by default, since generated code
            is specialised to the traced shapes anyway.
        options: the backend's options (``torch.compile(options=...)``).
    """

    enabled: bool = False
    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = False
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @classmethod
    def from_value(cls, value: bool | Mapping[str, Any]) -> CompileConfig:
        """``ComputeConfig.compile``: False (off), True (inductor, defaults) or a dict of
        `COMPILE_KEYS`, checked."""
        if isinstance(value, bool):
            return cls(enabled=value)
        _check(value)
        return cls(enabled=True, backend=value.get("backend", "inductor"),
                   mode=value.get("mode"), dynamic=value.get("dynamic", False),
                   options=dict(value.get("options") or {}))

    def as_options(self) -> dict[str, Any] | None:
        """``torch.compile``'s keywords (what generated code records as
        ``compile_config``), or None when compile is off."""
        if not self.enabled:
            return None
        out: dict[str, Any] = {"backend": self.backend, "dynamic": self.dynamic}
        if self.mode is not None:
            out["mode"] = self.mode
        if self.options:
            out["options"] = {k: _plain(v) for k, v in self.options.items()}
        return out


def _plain(value: Any) -> Any:
    """A nested value as plain dicts and lists (``ComputeConfig`` freezes them)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
