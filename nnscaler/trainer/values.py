"""nnScaler's value forms in a Trainer configuration: references between entries, the
``vars`` section, and objects built from mappings.

Two passes, as in nnScaler:

1. `resolve_references` runs on the loaded YAML mapping (after the command-line
   overrides), before the `TrainerArgs` are built. ``$(dotted.key)`` or
   ``${dotted.key}`` stands for the value at that key of the same configuration
   (``$(vars.dim)``, ``$(model.args.dim)``, ``$(log.0.type)``) or, when no key has that
   name, the environment variable of that name (read as a YAML scalar). A string that is only a reference keeps
   the value's type (``dim: $(vars.dim)`` is an int); references inside a longer string
   are formatted into it (``run-$(vars.dim)`` is ``'run-16'``). ``$\\(`` writes a
   literal ``$(``. A reference to itself, directly or not, is an error naming the cycle.
2. `create_kwarg` runs on each ``args`` mapping when the Trainer builds an object (the
   model, optimizer, datasets, loaders, sampler, scheduler, loggers, hooks). A mapping
   with ``__type: pkg.Class`` becomes ``pkg.Class(**rest)``; a mapping
   ``{__value_type: T, value: v}`` becomes ``T(v)`` (``__value_type: function`` gives
   the function at the import path ``v``); ``$!(vars.x.y)`` is the built value of
   ``vars.x.y`` (so one object in ``vars`` can be handed to several places) and
   ``$!(self)`` the `TrainerArgs` themselves.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Mapping
from typing import Any

from nnscaler.trainer.errors import ConfigError

__all__ = ["TYPE_KEY", "VALUE_KEY", "VALUE_TYPE_KEY", "create_kwarg", "resolve_references"]

TYPE_KEY = "__type"
VALUE_TYPE_KEY = "__value_type"
VALUE_KEY = "value"

_REF = re.compile(r"(?<!\\)\$(\([^)]+\)|\{[^}]+\})")
_ESCAPED = re.compile(r"\\\$([({])")
_BUILT_REF = re.compile(r"^\$!(\(([^)]+)\)|\{([^}]+)\})$")


# -- pass 1: references between entries ---------------------------------------------------
_MISSING = object()


def _lookup(config: Any, path: list[str]) -> Any:
    """The value at ``path`` in ``config``, or `_MISSING`."""
    node = config
    for part in path:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            return _MISSING
    return node


def resolve_references(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with every ``$(key)`` / ``${key}`` replaced (see the module doc); the
    mapping is changed in place and returned."""
    done: dict[str, Any] = {}

    def value_of(key: str, where: str, chain: tuple[str, ...]) -> Any:
        if key in chain:
            cycle = " -> ".join((*chain[chain.index(key):], key))
            raise ConfigError(f"{where}: the reference $({key}) refers back to itself "
                              f"({cycle}). Fix: give one of them a plain value.", where)
        if key in done:
            return done[key]
        raw = _lookup(config, key.split("."))
        if raw is _MISSING:
            if key in os.environ:
                import yaml

                from nnscaler.trainer.cmdline import ConfigLoader

                try:  # read as a YAML scalar, like a command-line value ("0.5" is a number)
                    return yaml.load(os.environ[key], Loader=ConfigLoader)  # noqa: S506
                except yaml.YAMLError:
                    return os.environ[key]
            raise ConfigError(
                f"{where}: $({key}) names no entry of the configuration and no environment "
                f"variable. Fix: add it (e.g. under vars:), or write a literal $( as $\\(.",
                where)
        value = resolve(raw, key, (*chain, key))
        done[key] = value
        return value

    def resolve(value: Any, where: str, chain: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            for k in list(value):
                value[k] = resolve(value[k], f"{where}.{k}" if where else str(k), chain)
            return value
        if isinstance(value, list):
            for i, v in enumerate(value):
                value[i] = resolve(v, f"{where}.{i}", chain)
            return value
        if not isinstance(value, str):
            return value
        whole = _REF.fullmatch(value)
        if whole:
            return copy.deepcopy(value_of(whole.group(1)[1:-1], where, chain))
        text = _REF.sub(lambda m: str(value_of(m.group(1)[1:-1], where, chain)), value)
        return _ESCAPED.sub(r"$\1", text)

    return resolve(config, "", ())


# -- pass 2: objects built from args -------------------------------------------------------
def _import(path: Any, key: str) -> Any:
    from nnscaler.trainer.fields import resolve_object

    return resolve_object(path, key)


def create_kwarg(value: Any, trainer_args: Any = None, key: str = "args") -> Any:
    """``value`` (an ``args`` mapping, or any value in one) with nnScaler's object forms
    built: ``__type``, ``__value_type`` / ``value`` and ``$!(vars.x)`` / ``$!(self)``
    (see the module doc). ``trainer_args``: the `TrainerArgs` that ``$!(...)`` reads."""
    if isinstance(value, Mapping):
        built = {k: create_kwarg(v, trainer_args, f"{key}.{k}") for k, v in value.items()
                 if k != VALUE_KEY or VALUE_TYPE_KEY not in value}
        if TYPE_KEY in built:
            cls = _import(built.pop(TYPE_KEY), f"{key}.{TYPE_KEY}")
            try:
                return cls(**built)
            except TypeError as e:
                raise ConfigError(f"{key}: {TYPE_KEY} {cls!r} cannot be built with "
                                  f"{sorted(built)}: {e}", key) from e
        if VALUE_TYPE_KEY in value:
            if VALUE_KEY not in value:
                raise ConfigError(f"{key}: a {VALUE_TYPE_KEY} mapping needs its '{VALUE_KEY}' "
                                  f"(e.g. {{{VALUE_TYPE_KEY}: str, {VALUE_KEY}: '1'}}).", key)
            kind, raw = value[VALUE_TYPE_KEY], value[VALUE_KEY]
            if kind == "function":
                return _import(raw, f"{key}.{VALUE_KEY}")
            cls = _import(kind if "." in str(kind) else f"builtins.{kind}",
                          f"{key}.{VALUE_TYPE_KEY}")
            return cls(raw)
        return built
    if isinstance(value, list):
        return [create_kwarg(v, trainer_args, f"{key}.{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(create_kwarg(v, trainer_args, f"{key}.{i}") for i, v in enumerate(value))
    if isinstance(value, str):
        m = _BUILT_REF.match(value)
        if m:
            return _built_reference(m.group(2) or m.group(3), trainer_args, key)
    return value


def _built_reference(path: str, trainer_args: Any, key: str) -> Any:
    if trainer_args is None:
        raise ConfigError(f"{key}: $!({path}) reads the TrainerArgs, which this value has "
                          f"none of here.", key)
    if path == "self":
        return trainer_args
    parts = path.split(".")
    if parts[0] != "vars":
        raise ConfigError(f"{key}: $!({path}) must be $!(self) or name an entry of vars "
                          f"($!(vars.x)). Fix: move the value under vars:.", key)
    value = _lookup(trainer_args.resolved_vars, parts[1:])
    if value is _MISSING:
        raise ConfigError(f"{key}: $!({path}): vars has no entry {'.'.join(parts[1:])!r}; "
                          f"it has {sorted(trainer_args.vars)}.", key)
    return value
