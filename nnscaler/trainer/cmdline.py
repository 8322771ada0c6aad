"""A command line into `TrainerArgs`: the YAML file of
``-f`` and the ``--dotted.key value`` overrides after it.

The YAML file holds the fields of ``TrainerArgs``; it is read with ``yaml.safe_load``
rules (no object is built from a tag; classes and functions are named by import path).
Each ``--dotted.key value`` overrides one entry (``--compute_config.plan_ngpus 2``,
``--log.0.args.root_dir runs``; an index one past a list's end appends to it);
``--dotted.key!`` removes the entry (nnScaler's form; ``-`` in a key reads as ``_``);
values are read as YAML scalars (``1e-3`` is a number, ``true`` a bool, ``null`` None,
``[1, 2]`` a list). Then nnScaler's ``$(dotted.key)`` references are resolved
(`nnscaler.trainer.values.resolve_references`: ``$(vars.dim)``). An unknown key, a
wrong type or a missing required field stops with an error that names the dotted key,
and the closest valid key for a typo.

The ``nnscaler-train`` command (`nnscaler.cli.train`) calls `parse_args`;
so does ``Trainer(argv)``, nnScaler's other way in, without going through the command.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from nnscaler.trainer.args import TrainerArgs
from nnscaler.trainer.errors import ConfigError
from nnscaler.trainer.values import resolve_references

__all__ = ["ConfigLoader", "apply_overrides", "load_yaml", "parse_args", "parse_value"]

_MODES = ("run", "compile")


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e-3`` (no dot) as a float, as YAML 1.2 does."""


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+][0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file (safe loading; an empty file is an empty mapping)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"-f: the configuration file {str(p)!r} does not exist.", "-f")
    try:
        data = yaml.load(p.read_text(), Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}", "-f") from e
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{p}: the top level must be a mapping of TrainerArgs fields, got "
                          f"{type(data).__name__}.", "-f")
    return dict(data)


def parse_value(text: str) -> Any:
    """A command-line value read as a YAML scalar or flow collection."""
    try:
        return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return text


_REMOVE = object()


def _set(config: MutableMapping[str, Any], dotted: str, value: Any) -> None:
    node: Any = config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) > len(node) or (
                    value is _REMOVE and int(part) == len(node)):
                raise ConfigError(f"--{dotted}: {where} indexes a list of {len(node)} "
                                  f"entries; use 0..{len(node) - 1} (or {len(node)} to "
                                  f"append).", dotted)
            if int(part) == len(node):
                node.append(None if last else {})
            if last and value is _REMOVE:
                node.pop(int(part))
            elif last:
                node[int(part)] = value
            else:
                if node[int(part)] is None:
                    node[int(part)] = {}
                node = node[int(part)]
            continue
        if not isinstance(node, MutableMapping):
            raise ConfigError(f"--{dotted}: {'.'.join(parts[:i])} is {node!r}, not a mapping; "
                              f"set it as a whole instead.", dotted)
        if last and value is _REMOVE:
            node.pop(part, None)
        elif last:
            node[part] = value
        else:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]


def apply_overrides(config: MutableMapping[str, Any], overrides: Sequence[str]) -> None:
    """Apply ``--dotted.key value`` / ``--dotted.key=value`` pairs to ``config``."""
    i = 0
    while i < len(overrides):
        token = overrides[i]
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(f"expected --dotted.key value, got {token!r}. Fix: write "
                              f"overrides as `--optimizer.args.lr 1e-3`.", token)
        key = token[2:]
        if "=" in key:
            key, text = key.split("=", 1)
            i += 1
        elif key.endswith("!"):
            _set(config, key[:-1].replace("-", "_"), _REMOVE)
            i += 1
            continue
        else:
            if i + 1 >= len(overrides):
                raise ConfigError(f"--{key} has no value. Fix: `--{key} VALUE`.", key)
            text = overrides[i + 1]
            i += 2
        _set(config, key.replace("-", "_"), parse_value(text))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nnscaler-train",
        description="Train (or compile) a model with the nnscaler Trainer from a YAML "
                    "configuration. Any --dotted.key VALUE after the options overrides "
                    "that entry of the configuration.",
    )
    parser.usage = "nnscaler-train [run|compile] -f CONFIG [--dotted.key VALUE ...]"
    parser.epilog = ("run (default: the file's run_mode) trains, under torchrun; compile only "
                     "generates the code, without a process group")
    parser.add_argument("-f", "--config", dest="config", required=False,
                        help="the YAML file of TrainerArgs fields")
    return parser


def parse_args(argv: Sequence[str]) -> TrainerArgs:
    """The `TrainerArgs` of a command line (without the program name)."""
    argv = list(argv)
    mode = argv.pop(0) if argv and argv[0] in _MODES else None
    ns, rest = _parser().parse_known_args(argv)
    config: dict[str, Any] = load_yaml(ns.config) if ns.config else {}
    apply_overrides(config, rest)
    if mode is not None:
        config["run_mode"] = mode
    return TrainerArgs.from_dict(resolve_references(config))
