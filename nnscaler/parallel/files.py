"""The files ``parallelize`` keeps under ``gen_savedir`` and how they are compared.

Layout (``docs/internals/parallel-runtime.md``)::

    {gen_savedir}/_parallel_modules/{module class, dots as /}/{instance_name or _}/
        gencode{rank}.py   one per runtime rank   (written by nnscaler.codegen)
        fullmodel.pt       the traced module's state   (written by nnscaler.codegen)
        graph.pkl          the traced graph, for ReuseType.GRAPH (nnscaler.parallel.graph_pickle)
        config.json        written LAST: a directory without it is incomplete
    {gen_savedir}/_parallel_modules/{module class, dots as /}/.{instance}.lock
                           the instance's file lock (:func:`instance_lock`), and beside it
                           ``.{instance}.lock.owner``: who holds it

``config.json`` holds a ``match`` section (compute config, policy, module and input
fingerprints, nnscaler version): ``ReuseType.MATCH`` reuses the directory only when it
equals the one of the current call (``match.module.parameters`` / ``buffers``, rows
``[name, shape, dtype, requires_grad | persistent]``, are also read by
:mod:`nnscaler.checkpoint`: change them together). Generation writes into a temporary sibling directory
and renames it into place, so a failure never leaves a directory that looks complete.

``config.json`` also records the sha256 of every file (``sha256``): files that differ are
never reused (:func:`changed_files`), and each rank checks its ``gencode{rank}.py``
before running it. One process at a time works on an instance directory: it holds the
instance's file lock (:func:`instance_lock`) from deciding on reuse to the end of loading,
and cleans up what killed processes left behind (:func:`clean_stale`).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import platform
import re
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import filelock
import torch

from nnscaler.errors import NNScalerError
from nnscaler.parallel import graph_pickle
from nnscaler.parallel.config import ComputeConfig, jsonable

CONFIG_FILE = "config.json"
GRAPH_FILE = "graph.pkl"
WEIGHTS_FILE = "fullmodel.pt"
PARALLEL_MODULES_DIR = "_parallel_modules"
DEFAULT_INSTANCE = "_"
FORMAT_VERSION = 2  # 2: config.json records the sha256 of every file

#: How long ``parallelize`` waits for another process's lock on an instance directory
#: before giving up (seconds), and after how long it says that it is waiting.
LOCK_TIMEOUT_S = 600.0
LOCK_NOTICE_S = 2.0

_log = logging.getLogger("nnscaler.parallel")

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class GenFilesError(NNScalerError, OSError):
    """``gen_savedir`` cannot be used (not writable, not a directory, ...)."""


class GenFilesLockedError(GenFilesError, TimeoutError):
    """Another process held an instance directory's lock for longer than the timeout."""


class GenFilesChangedError(NNScalerError, ValueError):
    """A generated file differs from the one recorded in ``config.json`` (edited after
    generation): nnscaler does not run or reuse it."""


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
    if not isinstance(data.get("sha256"), dict):
        return None
    return data


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes, as hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def changed_files(outdir: Path, saved: Mapping[str, Any],
                  names: Sequence[str] | None = None) -> list[str]:
    """The files of ``outdir`` (all listed ones, or ``names``) whose sha256 is not the
    one ``config.json`` recorded when they were generated (or that are missing)."""
    recorded = saved.get("sha256") or {}
    out = []
    for name in (saved.get("files", []) if names is None else names):
        path = outdir / name
        if recorded.get(name) is None or not path.is_file() or file_digest(path) != recorded[name]:
            out.append(name)
    return out


def changed_message(outdir: Path, names: Sequence[str], *, reuse: str) -> str:
    """The error text for files that changed after generation."""
    listed = ", ".join(str(outdir / n) for n in names)
    return (
        f"reuse={reuse!r}: {listed} differ(s) from what nnscaler generated (the sha256 "
        f"recorded in {CONFIG_FILE} does not match), so it is not reused and its code is "
        f"not run. Fix: regenerate with reuse='override' (your change is lost); or, if you "
        f"edited the file on purpose, record its new hash with "
        f"nnscaler.parallel.files.accept_edited_files({str(outdir)!r})"
    )


def accept_edited_files(outdir: str | os.PathLike[str]) -> list[str]:
    """Record the current sha256 of every file listed in ``outdir``'s ``config.json``
    (for files you edited on purpose); returns the names whose hash changed. Holds the
    instance's lock while it writes."""
    outdir = Path(outdir)
    with instance_lock(outdir):
        path = outdir / CONFIG_FILE
        data = json.loads(path.read_text())
        digests = {n: file_digest(outdir / n) for n in data.get("files", [])}
        changed = sorted(n for n, d in digests.items() if data.get("sha256", {}).get(n) != d)
        data["sha256"] = digests
        _write_json(outdir, data)
    return changed


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
        "sha256": {name: file_digest(outdir / name) for name in files},
        "versions": {"nnscaler": nnscaler_version(), "torch": torch.__version__,
                     "python": platform.python_version()},
        **dict(extra or {}),
    }
    _write_json(outdir, data)


def _write_json(outdir: Path, data: Mapping[str, Any]) -> None:
    tmp = outdir / f".{CONFIG_FILE}.tmp"
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, outdir / CONFIG_FILE)


# -- the traced graph --------------------------------------------------------------------
def save_graph(graph: Any, path: Path) -> None:
    """Pickle the traced graph (:mod:`nnscaler.parallel.graph_pickle`)."""
    graph_pickle.save_graph(graph, path)


def load_graph(path: Path) -> Any:
    """Read a graph written by :func:`save_graph` with the restricted unpickler of
    :mod:`nnscaler.parallel.graph_pickle` (never an unrestricted ``pickle.load``)."""
    return graph_pickle.load_graph(path)


# -- directories -------------------------------------------------------------------------
def remove_dir(path: Path) -> None:
    """Remove ``path`` so that no later call sees a partial directory: rename it aside
    first (one atomic step), then delete it."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    trash = path.with_name(f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
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
    """Temporary siblings of ``outdir`` (for tests: a failure must leave none). The lock
    file and its owner note are not leftovers."""
    if not outdir.parent.exists():
        return []
    keep = {lock_path(outdir).name, _owner_path(outdir).name}
    return sorted(p for p in outdir.parent.iterdir()
                  if p.name.startswith(f".{outdir.name}.") and p.name not in keep)


# -- the instance lock -------------------------------------------------------------------
def lock_path(outdir: Path) -> Path:
    """The lock file of an instance directory (a sibling: the directory itself is
    replaced by a rename when it is regenerated)."""
    return outdir.parent / f".{outdir.name}.lock"


def _owner_path(outdir: Path) -> Path:
    return outdir.parent / f".{outdir.name}.lock.owner"


def _owner_note(outdir: Path) -> str:
    try:
        owner = json.loads(_owner_path(outdir).read_text())
        since = time.strftime("%H:%M:%S", time.localtime(float(owner["since"])))
        return (f"process {owner['pid']} on host {owner['host']} ({owner['argv0']}), "
                f"holding it since {since}")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


@contextlib.contextmanager
def instance_lock(outdir: Path, *, timeout: float | None = None) -> Iterator[None]:
    """Hold the file lock of the instance directory ``outdir`` (a ``filelock.FileLock``
    on :func:`lock_path`), so that two jobs sharing one ``gen_savedir`` never generate,
    delete or load each other's files at the same time. Waits up to ``timeout`` seconds
    (default :data:`LOCK_TIMEOUT_S`), saying after :data:`LOCK_NOTICE_S` seconds that it
    waits and for whom; then raises :class:`GenFilesLockedError`. On entry, removes what
    killed processes left behind (:func:`clean_stale`).

    The lock is an ``flock``: released by the kernel when its holder dies, so a killed
    job never blocks the next one. On a network file system it works where the file
    system supports ``flock`` (NFSv4 does).
    """
    limit = LOCK_TIMEOUT_S if timeout is None else float(timeout)
    outdir.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(lock_path(outdir)))
    start = time.monotonic()
    try:
        lock.acquire(timeout=min(LOCK_NOTICE_S, limit))
    except filelock.Timeout:
        _log.warning("parallelize: waiting for the lock on %s, held by %s (another job "
                     "using the same gen_savedir and instance); waiting up to %.0f s",
                     outdir, _owner_note(outdir), limit)
        try:
            lock.acquire(timeout=max(0.0, limit - (time.monotonic() - start)))
        except filelock.Timeout:
            raise GenFilesLockedError(
                f"the generated files in {str(outdir)!r} are locked by "
                f"{_owner_note(outdir)}; this process waited {limit:.0f} s for it (jobs "
                f"that share a gen_savedir and instance_name take turns). Fix: wait for "
                f"that job to finish, or give this job its own instance_name= or "
                f"gen_savedir=; the lock file is {str(lock_path(outdir))!r}"
            ) from None
    try:
        _owner_path(outdir).write_text(json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
            "argv0": os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python",
        }))
        clean_stale(outdir)
        yield
    finally:
        with contextlib.suppress(OSError):
            _owner_path(outdir).unlink()
        lock.release()


_STALE = re.compile(r"\.(?:tmp|old)-(\d+)-[0-9a-f]+")


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this host (True when it cannot be told)."""
    if os.name != "posix":
        return True  # os.kill(pid, 0) would terminate the process on Windows
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists, owned by someone else
        return True
    return True


def clean_stale(outdir: Path) -> list[Path]:
    """Remove what killed processes left beside and inside ``outdir``: staging
    directories (``.{name}.tmp-{pid}-*``) and renamed-aside old directories
    (``.{name}.old-{pid}-*``) whose process is dead, and half-written ``.*.tmp`` files in
    ``outdir``. Call it holding :func:`instance_lock` (no live process of a job that
    takes the lock is writing them then). Returns what was removed."""
    removed: list[Path] = []
    if outdir.parent.is_dir():
        prefix = f".{outdir.name}"
        for p in outdir.parent.iterdir():
            if not p.name.startswith(prefix):
                continue
            m = _STALE.fullmatch(p.name[len(prefix):])
            if m is None:
                continue
            pid = int(m.group(1))
            if pid == os.getpid() or _pid_alive(pid):
                continue  # in use (or a process that cannot be told dead)
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if outdir.is_dir():
        for p in outdir.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file():
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(p)
    for p in removed:
        _log.info("parallelize: removed %s, left by a process that was killed", p)
    return removed
