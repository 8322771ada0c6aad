"""Where ``parallelize`` keeps a module's generated folder, and whether it can::

    {gen_savedir}/_parallel_modules/{module class, dots as /}/{instance_name or _}/

The folder's own format (file names, ``config.json``) is `nnscaler.gendir`; the lock
beside it is `nnscaler.parallel.locks`.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

from nnscaler.errors import GenFilesError

__all__ = ["DEFAULT_INSTANCE", "PARALLEL_MODULES_DIR", "GenFilesError", "check_instance_name",
           "check_writable", "class_path", "outdir_for"]

PARALLEL_MODULES_DIR = "_parallel_modules"
DEFAULT_INSTANCE = "_"

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


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
    """Raise `GenFilesError` unless files can be created under ``gen_savedir``."""
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
