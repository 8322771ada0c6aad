"""The machinery under the Trainer's config classes: import paths, and values checked
against the field annotations.

`resolve_object` turns an import path (``'torch.optim.AdamW'``) into the object;
`Checked` is the base of every config class in `nnscaler.trainer.args`: its
fields are checked (and converted: a mapping into a config class, an int into a float)
when it is built, and a bad value raises `ConfigError`
naming the dotted key and, for a typo, the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any, Union

from nnscaler.config import ComputeConfig, ComputeConfigError
from nnscaler.trainer.errors import ConfigError

__all__ = [
    "Checked",
    "TypeRef",
    "choice",
    "from_mapping",
    "import_path",
    "key_field",
    "positive",
    "resolve_object",
]

#: A class or function: the object itself, or its import path.
TypeRef = Union[str, Callable[..., Any]]

# -- import paths ----------------------------------------------------------------------

def resolve_object(ref: Any, key: str) -> Any:
    """The object ``ref`` names: ``ref`` itself when it is not a string, else the object
    at its import path (``'package.module.Name'``, attributes after the module allowed).

    Raises `ConfigError` naming ``key`` when the path does not import.
    """
    if not isinstance(ref, str):
        return ref
    path = ref.strip()
    parts = path.split(".")
    if not path or any(not p.isidentifier() for p in parts):
        raise ConfigError(
            f"{key}: {ref!r} is not an import path. Fix: write the full dotted path of the "
            f"class or function, e.g. 'torch.optim.AdamW' or 'mypackage.models.MyModel'.",
            key,
        )
    error: Exception | None = None
    for cut in range(len(parts), 0, -1):
        modname = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name is not None and not modname.startswith(e.name):
                error = e  # the module exists but one of its own imports failed
                break
            continue
        except Exception as e:  # noqa: BLE001 - reported with the key below
            error = e
            break
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError as e:
            error = e
            break
        return obj
    why = f"{type(error).__name__}: {error}" if error is not None else "no such module"
    raise ConfigError(
        f"{key}: cannot import {ref!r} ({why}). Fix: check the spelling, that its package "
        f"is installed and on sys.path (run from the directory that holds your module), or "
        f"pass the object itself from Python.",
        key,
    )


def import_path(obj: Any) -> Any:
    """The import path of a class or function (for saving configs), or ``obj`` itself."""
    if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
        return f"{obj.__module__}.{obj.__qualname__}"
    return obj


# -- checking and converting values ----------------------------------------------------

def _closest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{hint} Valid keys: {', '.join(valid)}."


def _type_name(hint: Any) -> str:
    if hint is Any:
        return "any value"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def _is_callable_ref(value: Any) -> bool:
    return isinstance(value, str) or callable(value)


def _convert_union(value: Any, options: tuple, key: str) -> Any:
    """``value`` converted to the first option it fits (config classes tried first);
    the error of the option that best explains a failure."""
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{key} is required and cannot be None (null).", key)
    errors = []
    # config classes first, so a mapping becomes the class it fits
    for option in sorted(options, key=lambda o: not dataclasses.is_dataclass(o)):
        if option is type(None):
            continue
        try:
            return _convert(value, option, key)
        except ConfigError as e:
            errors.append(e)
    if isinstance(value, Mapping) and errors:
        # the config class whose fields the mapping names best explains the failure
        classes = [o for o in options if dataclasses.is_dataclass(o)]

        def fit(i: int) -> int:
            names = [f.name for f in dataclasses.fields(classes[i])]
            return sum(k in names or bool(difflib.get_close_matches(str(k), names, 1, 0.6))
                       for k in value)

        if classes and len(classes) == len(errors):
            raise errors[max(range(len(classes)), key=fit)]
        raise errors[0]
    if len(errors) == 1:
        raise errors[0]
    raise ConfigError(
        f"{key} must be {' or '.join(_type_name(o) for o in options)}, got "
        f"{type(value).__name__} {value!r}.",
        key,
    )


def _convert(value: Any, hint: Any, key: str) -> Any:
    """``value`` checked against the type ``hint`` (and converted: a mapping into a
    config class, an int into a float); raises `ConfigError` naming ``key``."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(value, typing.get_args(hint), key)
    if hint is TypeRef or (origin is None and hint is Callable) or origin is Callable:
        if not _is_callable_ref(value):
            raise ConfigError(
                f"{key} must be a class or function, or its import path as a string, got "
                f"{type(value).__name__} {value!r}.",
                key,
            )
        return value
    if hint is ComputeConfig:
        return _compute_config(value, key)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, Mapping):
            return from_mapping(hint, value, key)
        raise ConfigError(
            f"{key} must be a {hint.__name__} or a mapping of its fields, got "
            f"{type(value).__name__} {value!r}.",
            key,
        )
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {type(value).__name__} {value!r}.",
                              key)
        args = typing.get_args(hint)
        vhint = args[1] if len(args) == 2 else Any
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{key}: keys must be strings, got {k!r}.", key)
            out[k] = _convert(v, vhint, f"{key}.{k}")
        return out
    if origin is list or hint is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {type(value).__name__} {value!r}.",
                              key)
        args = typing.get_args(hint)
        ihint = args[0] if args else Any
        return [_convert(v, ihint, f"{key}.{i}") for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {type(value).__name__} "
                              f"{value!r}.", key)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an int, got {type(value).__name__} {value!r}.",
                              key)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {type(value).__name__} "
                              f"{value!r}.", key)
        return float(value)
    if hint is str:
        if isinstance(value, os.PathLike):  # a Path, as nnScaler's users pass gen_savedir
            return os.fspath(value)
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {type(value).__name__} "
                              f"{value!r}.", key)
        return value
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ConfigError(f"{key} must be a {hint.__name__}, got {type(value).__name__} "
                          f"{value!r}.", key)
    return value


def _compute_config(value: Any, key: str) -> ComputeConfig:
    if isinstance(value, ComputeConfig):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{key} must be a ComputeConfig or a mapping of its fields, got "
            f"{type(value).__name__} {value!r}.",
            key,
        )
    valid = list(ComputeConfig.field_names())
    for k in value:
        if k not in valid:
            raise ConfigError(f"{key}.{k} is not a field of ComputeConfig."
                              f"{_closest(str(k), valid)}",
                              f"{key}.{k}")
    if "plan_ngpus" not in value:
        raise ConfigError(f"{key}.plan_ngpus is required (missing).", f"{key}.plan_ngpus")
    if "runtime_ngpus" not in value and not os.environ.get("WORLD_SIZE", "").strip():
        # nnScaler's default: the job's $WORLD_SIZE (ComputeConfig takes it when left out)
        raise ConfigError(
            f"{key}.runtime_ngpus is missing and $WORLD_SIZE is not set (torchrun sets it; "
            f"a YAML without runtime_ngpus means the job's world size). Fix: launch with "
            f"torchrun, or set {key}.runtime_ngpus.", f"{key}.runtime_ngpus")
    try:
        return ComputeConfig(**value)
    except (ComputeConfigError, TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {e}", key) from e


def _hints(cls: type) -> dict[str, Any]:
    # each class's annotations are read in its own module (the config classes live in
    # nnscaler.trainer.args)
    return typing.get_type_hints(cls)


def from_mapping(cls: type, data: Mapping[str, Any], key: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name != "_key"}
    valid = list(fields)
    prefix = f"{key}." if key else ""
    for k in data:
        if k not in fields:
            raise ConfigError(f"{prefix}{k} is not a field of {cls.__name__}."
                              f"{_closest(str(k), valid)}",
                              f"{prefix}{k}")
    for name, f in fields.items():
        if (name not in data and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING):
            raise ConfigError(f"{prefix}{name} is required (missing from the {cls.__name__} "
                              f"config).", f"{prefix}{name}")
    hints = _hints(cls)
    kwargs = {k: _convert(v, hints[k], f"{prefix}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs, _key=key)
    except ConfigError:
        raise


class Checked:
    """Base of the config classes: fields checked against their annotations when built."""

    def _check(self, key: str) -> None:
        prefix = f"{key}." if key else ""
        hints = _hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if not f.init or f.name == "_key":
                continue
            value = getattr(self, f.name)
            setattr(self, f.name, _convert(value, hints[f.name], f"{prefix}{f.name}"))
        self._validate(prefix)

    def _validate(self, prefix: str) -> None:
        """Checks across fields; ``prefix`` is the dotted key of this config plus '.'."""

    def to_dict(self) -> dict[str, Any]:
        """The plain form (classes and functions as import paths), as YAML would hold it."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name == "_key":
                continue
            out[f.name] = _plain(getattr(self, f.name))
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, Checked):
        return value.to_dict()
    if isinstance(value, ComputeConfig):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return import_path(value)


def choice(value: Any, choices: tuple[str, ...], key: str) -> None:
    if value not in choices:
        raise ConfigError(
            f"{key} must be one of {list(choices)}, got {value!r}."
            + (_closest(str(value), list(choices)).split(" Valid")[0]
               if isinstance(value, str) else ""),
            key,
        )


def positive(value: int | None, key: str, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{key} must be a positive int, got {value!r}.", key)


def key_field() -> Any:
    """The hidden ``_key`` field: the dotted key of a config built inside another."""
    return field(default="", repr=False, compare=False)


# -- the config classes ----------------------------------------------------------------
