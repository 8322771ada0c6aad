"""What identifies a ``parallelize`` call, for reuse: fingerprints of the module, its
inputs and the policy, the ``match`` section of ``config.json`` they make
(`match_key`; its schema is in `nnscaler.gendir`), the part of it that decides
whether a saved graph is reused (`graph_key`), and a readable `diff` of two.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import platform
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from nnscaler.config import ComputeConfig, jsonable
from nnscaler.parallel.paths import class_path

__all__ = ["diff", "graph_key", "inputs_fingerprint", "match_key", "module_fingerprint",
           "nnscaler_version", "policy_identity", "versions", "weights_digest"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@functools.lru_cache(maxsize=4096)
def _source_of_file_version(cls: type, path: str, mtime_ns: int, size: int) -> str:
    return inspect.getsource(cls)


def _class_source(cls: type) -> str:
    """``inspect.getsource(cls)``, remembered while the class's file is unchanged (same
    modification time and size): finding a class parses its whole file again, 0.01 s to
    0.03 s a class for a Hugging Face modeling file, on every ``parallelize`` call."""
    try:
        path = inspect.getsourcefile(cls)
        stat = os.stat(path) if path else None
    except (OSError, TypeError):
        stat = None
    if stat is None:
        return inspect.getsource(cls)
    return _source_of_file_version(cls, path, stat.st_mtime_ns, stat.st_size)


def _source_digest(classes: list[type]) -> str:
    h = hashlib.sha256()
    for cls in classes:
        h.update(class_path(cls).encode())
        try:
            h.update(_class_source(cls).encode())
        except (OSError, TypeError):  # defined in exec'd code, a C class, ...
            pass
    return h.hexdigest()


def module_fingerprint(module: torch.nn.Module) -> dict[str, Any]:
    """What identifies a module for reuse: its class, the code of its module classes,
    the names, shapes and dtypes of its state, and its training flag (not the values)."""
    classes = sorted({type(m) for m in module.modules()}, key=class_path)
    params = [
        [name, list(p.shape), str(p.dtype), bool(p.requires_grad)]
        for name, p in module.named_parameters(remove_duplicate=False)
    ]
    owners = dict(module.named_modules(remove_duplicate=False))
    buffers = []
    for name, b in module.named_buffers(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        persistent = attr not in owners[owner]._non_persistent_buffers_set
        buffers.append([name, list(b.shape), str(b.dtype), persistent])
    return {
        "class": class_path(type(module)),
        "source_sha256": _source_digest(classes),
        "parameters": params,
        "buffers": buffers,
        "training": bool(module.training),
    }


def weights_digest(module: torch.nn.Module) -> str | None:
    """A cheap digest of the module's values (sums and sums of squares of its parameters
    and buffers), or None for a module on the meta device. Not part of the match: it
    tells whether reused files hold the weights the module has now."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_meta:
                return None
            x = t.detach()
            x = (x.abs() if x.is_complex() else x).double()
            h.update(f"{name}:{x.sum().item():.12g}:{x.square().sum().item():.12g};".encode())
    return h.hexdigest()


def _leaf_fingerprint(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype),
                "requires_grad": bool(value.requires_grad)}
    if isinstance(value, Mapping):
        return {str(k): _leaf_fingerprint(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [_leaf_fingerprint(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _ADDRESS.sub("", repr(jsonable(value)))


def inputs_fingerprint(dummy_forward_args: Mapping[str, Any]) -> dict[str, Any]:
    """The structure of the dummy inputs: tensors by shape, dtype and requires_grad;
    other values as they are (their ``repr`` when JSON cannot hold them)."""
    return {str(k): _leaf_fingerprint(v) for k, v in dummy_forward_args.items()}


def policy_identity(pas_policy: str | Callable[..., Any]) -> dict[str, Any]:
    """A policy by name, or a callable by qualified name and source digest."""
    if isinstance(pas_policy, str):
        return {"name": pas_policy}
    fn = pas_policy
    target = getattr(fn, "func", fn)  # functools.partial
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__qualname__)}"
    ident: dict[str, Any] = {"callable": name}
    try:
        ident["source_sha256"] = hashlib.sha256(inspect.getsource(target).encode()).hexdigest()
    except (OSError, TypeError):
        pass
    if fn is not target:
        ident["partial"] = _ADDRESS.sub("", repr(jsonable(
            {"args": list(getattr(fn, "args", ())), "keywords": dict(getattr(fn, "keywords", {}))}
        )))
    return ident


def nnscaler_version() -> str:
    from nnscaler import __version__

    return __version__


def versions() -> dict[str, str]:
    """The versions ``config.json`` records: nnscaler, torch and python."""
    return {"nnscaler": nnscaler_version(), "torch": torch.__version__,
            "python": platform.python_version()}


def match_key(compute_config: ComputeConfig, pas_policy: str | Callable[..., Any],
              module_fp: Mapping[str, Any], inputs_fp: Mapping[str, Any]) -> dict[str, Any]:
    """The ``match`` section of ``config.json``: what must be equal for MATCH to reuse."""
    return jsonable({
        "compute_config": compute_config.to_dict(),
        "policy": policy_identity(pas_policy),
        "module": module_fp,
        "inputs": inputs_fp,
        "nnscaler_version": nnscaler_version(),
    })


def graph_key(match: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a match key that decides whether a saved graph can be reused."""
    cc = match.get("compute_config", {})
    return {
        "module": match.get("module"),
        "inputs": match.get("inputs"),
        "trace_strategy": cc.get("trace_strategy"),
        "constant_folding": cc.get("constant_folding"),
        "nnscaler_version": match.get("nnscaler_version"),
    }


def diff(saved: Any, current: Any, path: str = "", limit: int = 8) -> list[str]:
    """Human-readable differences between two JSON values (at most ``limit``)."""
    out: list[str] = []

    def short(v: Any) -> str:
        text = json.dumps(v, sort_keys=True)
        return text if len(text) <= 80 else text[:77] + "..."

    def walk(a: Any, b: Any, at: str) -> None:
        if len(out) >= limit or a == b:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                key = f"{at}.{k}" if at else k
                if k not in a:
                    out.append(f"{key}: not in the saved config, now {short(b[k])}")
                elif k not in b:
                    out.append(f"{key}: saved {short(a[k])}, now absent")
                else:
                    walk(a[k], b[k], key)
                if len(out) >= limit:
                    return
            return
        if (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
                and at.endswith(("parameters", "buffers"))):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{at}[{i}]")
            return
        out.append(f"{at or '<root>'}: saved {short(a)}, now {short(b)}")

    walk(saved, current, path)
    return out
