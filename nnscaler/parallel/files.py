"""The files ``parallelize`` keeps under ``gen_savedir`` and how they are compared.

Layout (``docs/internals/parallel-runtime.md``)::

    {gen_savedir}/_parallel_modules/{module class, dots as /}/{instance_name or _}/
        gencode{rank}.py   one per runtime rank   (written by nnscaler.codegen)
        fullmodel.pt       the traced module's state   (written by nnscaler.codegen)
        graph.pkl          the traced graph, for ReuseType.GRAPH
        config.json        written LAST: a directory without it is incomplete

``config.json`` holds a ``match`` section (compute config, policy, module and input
fingerprints, nnscaler version): ``ReuseType.MATCH`` reuses the directory only when it
equals the one of the current call (``match.module.parameters`` / ``buffers``, rows
``[name, shape, dtype, requires_grad | persistent]``, are also read by
:mod:`nnscaler.checkpoint`: change them together). Generation writes into a temporary sibling directory
and renames it into place, so a failure never leaves a directory that looks complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import os
import pickle
import platform
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from nnscaler.errors import NNScalerError
from nnscaler.parallel.config import ComputeConfig, jsonable

CONFIG_FILE = "config.json"
GRAPH_FILE = "graph.pkl"
WEIGHTS_FILE = "fullmodel.pt"
PARALLEL_MODULES_DIR = "_parallel_modules"
DEFAULT_INSTANCE = "_"
FORMAT_VERSION = 1

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class GenFilesError(NNScalerError, OSError):
    """``gen_savedir`` cannot be used (not writable, not a directory, ...)."""


def gencode_name(rank: int) -> str:
    return f"gencode{rank}.py"


def class_path(cls: type) -> str:
    """``module.Qualname`` of a class (what the output directory is named after)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def outdir_for(gen_savedir: str | os.PathLike[str], module_class: type,
               instance_name: str | None) -> Path:
    """Where the files of ``module_class`` (instance ``instance_name``) live."""
    parts = [_UNSAFE.sub("_", p) or "_" for p in class_path(module_class).split(".")]
    return Path(gen_savedir) / PARALLEL_MODULES_DIR / Path(*parts) / (
        instance_name or DEFAULT_INSTANCE)


def check_instance_name(instance_name: Any) -> None:
    if instance_name is None:
        return
    if (not isinstance(instance_name, str) or not instance_name or instance_name in (".", "..")
            or instance_name.startswith(".") or _UNSAFE.search(instance_name)):
        raise ValueError(
            f"instance_name names a directory under gen_savedir: a non-empty string of "
            f"letters, digits, '_', '-' and '.' that does not start with '.', got "
            f"{instance_name!r}; e.g. instance_name='tp2'"
        )


def check_writable(gen_savedir: str | os.PathLike[str]) -> None:
    """Raise :class:`GenFilesError` unless files can be created under ``gen_savedir``."""
    path = Path(gen_savedir)
    if path.exists() and not path.is_dir():
        raise GenFilesError(
            f"gen_savedir {str(path)!r} is not a directory; generated code is written there: "
            f"pass a gen_savedir= directory you can write to"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GenFilesError(
            f"gen_savedir {str(path)!r} cannot be created ({type(e).__name__}: {e}); "
            f"generated code is written there: pass a gen_savedir= you can write to"
        ) from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        what = "is not a directory" if not path.is_dir() else "is not writable"
        raise GenFilesError(
            f"gen_savedir {str(path)!r} {what}; generated code is written there: pass a "
            f"gen_savedir= directory you can write to"
        )
    probe = path / f".nnscaler-probe-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise GenFilesError(
            f"gen_savedir {str(path)!r} is not writable ({type(e).__name__}: {e}); "
            f"generated code is written there: pass a gen_savedir= you can write to"
        ) from None


# -- fingerprints ------------------------------------------------------------------------
def _source_digest(classes: list[type]) -> str:
    h = hashlib.sha256()
    for cls in classes:
        h.update(class_path(cls).encode())
        try:
            h.update(inspect.getsource(cls).encode())
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


# -- config.json -------------------------------------------------------------------------
def read_config(outdir: Path) -> dict[str, Any] | None:
    """The saved ``config.json`` if ``outdir`` holds a complete generation, else None."""
    path = outdir / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
        return None
    files = data.get("files")
    if not isinstance(files, list) or not all((outdir / f).is_file() for f in files):
        return None
    return data


def write_config(outdir: Path, match: Mapping[str, Any], *, module_class: str,
                 instance_name: str | None, extra: Mapping[str, Any] | None = None) -> None:
    """Write ``config.json`` (last), listing every file now in ``outdir``."""
    files = sorted(p.name for p in outdir.iterdir() if p.is_file() and p.name != CONFIG_FILE)
    data = {
        "format": FORMAT_VERSION,
        "match": dict(match),
        "module_class": module_class,
        "instance_name": instance_name,
        "files": files,
        "versions": {"nnscaler": nnscaler_version(), "torch": torch.__version__,
                     "python": platform.python_version()},
        **dict(extra or {}),
    }
    tmp = outdir / f".{CONFIG_FILE}.tmp"
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, outdir / CONFIG_FILE)


# -- the traced graph --------------------------------------------------------------------
def _opdef_by_name(name: str) -> Any:
    from nnscaler.plugins import get_plugin_manager

    return get_plugin_manager().ops.get(name)


class _GraphPickler(pickle.Pickler):
    """Pickles registered ops by name (their definitions hold local functions)."""

    def reducer_override(self, obj: Any) -> Any:
        from nnscaler.ops.registry import OpDef

        if isinstance(obj, OpDef):
            return (_opdef_by_name, (obj.name,))
        return NotImplemented


def save_graph(graph: Any, path: Path) -> None:
    buf = io.BytesIO()
    _GraphPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(graph)
    path.write_bytes(buf.getvalue())


def load_graph(path: Path) -> Any:
    with open(path, "rb") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's pytree specs, unpickled
        return pickle.load(f)  # noqa: S301 - our own file, written by save_graph


# -- directories -------------------------------------------------------------------------
def remove_dir(path: Path) -> None:
    """Remove ``path`` so that no later call sees a partial directory: rename it aside
    first (one atomic step), then delete it."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    trash = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def staging_dir(outdir: Path) -> Iterator[Path]:
    """A temporary sibling of ``outdir`` to write into; on success it replaces ``outdir``
    (renamed into place), on failure it is removed and ``outdir`` is left absent."""
    outdir.parent.mkdir(parents=True, exist_ok=True)
    tmp = outdir.with_name(f".{outdir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    remove_dir(outdir)
    os.replace(tmp, outdir)


def leftover_dirs(outdir: Path) -> list[Path]:
    """Temporary siblings of ``outdir`` (for tests: a failure must leave none)."""
    if not outdir.parent.exists():
        return []
    return sorted(p for p in outdir.parent.iterdir() if p.name.startswith(f".{outdir.name}."))
