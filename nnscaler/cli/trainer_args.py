"""The Trainer's configuration: :class:`TrainerArgs` and the config classes it holds.

Every class here is a keyword-only dataclass that checks its fields when it is built,
from Python or from a YAML mapping (:meth:`TrainerArgs.from_dict`): an unknown key, a
value of the wrong type or a missing required field raises :class:`ConfigError` naming
the dotted key (``optimizer.args.lr``) and, for a typo, the closest valid key. Classes
and functions (``model.type``, ``optimizer.type``, ...) are given as objects or as
import paths (``'torch.optim.AdamW'``); a path that does not import is an error naming
the key. Names and meanings follow nnScaler's ``nnscaler.cli.trainer_args``.

``from nnscaler.cli.trainer_args import *`` gives every config class and
:class:`~nnscaler.ComputeConfig`, as nnScaler's quickstart expects.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

import attrs

from nnscaler.errors import NNScalerError
from nnscaler.parallel.config import ComputeConfig, ComputeConfigError

__all__ = [
    "AggregatedOutputs",
    "CheckpointConfig",
    "ComputeConfig",
    "ConfigError",
    "DataloaderConfig",
    "DatasetConfig",
    "DatasetSamplerConfig",
    "HookConfig",
    "HookMapConfig",
    "LRSchedulerConfig",
    "LogConfig",
    "ModelConfig",
    "OptimizerConfig",
    "TrainerArgs",
    "resolve_object",
]

#: A class or function: the object itself, or its import path.
TypeRef = Union[str, Callable[..., Any]]

_PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(NNScalerError, ValueError):
    """A Trainer configuration that cannot be used; ``key`` is the dotted key at fault."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


# -- import paths ----------------------------------------------------------------------

def resolve_object(ref: Any, key: str) -> Any:
    """The object ``ref`` names: ``ref`` itself when it is not a string, else the object
    at its import path (``'package.module.Name'``, attributes after the module allowed).

    Raises :class:`ConfigError` naming ``key`` when the path does not import.
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
    config class, an int into a float); raises :class:`ConfigError` naming ``key``."""
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
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, Mapping):
            return _from_mapping(hint, value, key)
        raise ConfigError(
            f"{key} must be a {hint.__name__} or a mapping of its fields, got "
            f"{type(value).__name__} {value!r}.",
            key,
        )
    if hint is ComputeConfig:
        return _compute_config(value, key)
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
    valid = [f.name for f in attrs.fields(ComputeConfig)]
    for k in value:
        if k not in valid:
            raise ConfigError(f"{key}.{k} is not a field of ComputeConfig."
                              f"{_closest(str(k), valid)}",
                              f"{key}.{k}")
    for req in ("plan_ngpus", "runtime_ngpus"):
        if req not in value:
            raise ConfigError(f"{key}.{req} is required (missing).", f"{key}.{req}")
    try:
        return ComputeConfig(**value)
    except (ComputeConfigError, TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {e}", key) from e


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, globalns=globals())


def _from_mapping(cls: type, data: Mapping[str, Any], key: str) -> Any:
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


class _Checked:
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
    if isinstance(value, _Checked):
        return value.to_dict()
    if isinstance(value, ComputeConfig):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return import_path(value)


def _choice(value: Any, choices: tuple[str, ...], key: str) -> None:
    if value not in choices:
        raise ConfigError(
            f"{key} must be one of {list(choices)}, got {value!r}."
            + (_closest(str(value), list(choices)).split(" Valid")[0]
               if isinstance(value, str) else ""),
            key,
        )


def _positive(value: int | None, key: str, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{key} must be a positive int, got {value!r}.", key)


def _key_field() -> Any:
    """The hidden ``_key`` field: the dotted key of a config built inside another."""
    return field(default="", repr=False, compare=False)


# -- the config classes ----------------------------------------------------------------

@dataclass(kw_only=True)
class ModelConfig(_Checked):
    """The model: ``type(**args)`` builds it (an ``nn.Module`` subclass; its ``forward``
    takes one batch and returns the loss first).

    ``pretrained``: a Hugging Face Hub-format folder (``model.safetensors`` or shards with
    their index) the parallel model starts from, each rank reading only its slices
    (:func:`nnscaler.load_pretrained`; a checkpoint to resume from still wins). With
    ``compute_config.trace_strategy='meta'`` the model is built with its parameters on the
    meta device (:func:`nnscaler.meta_parameters`), so no process ever holds all of it."""

    type: TypeRef
    args: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None
    _key: str = _key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "model")


@dataclass(kw_only=True)
class OptimizerConfig(_Checked):
    """The optimizer: ``type(params, **args)``; gradients clipped to ``clip_gnorm`` (0 or
    None: no clipping) and reduced over micro-batches and data-parallel units by
    ``grad_reduction``: ``'mean'`` (the mean of the batches' losses), ``'sum'``, or
    ``'per-token-mean'`` (the sum over all tokens divided by their number; ``forward``
    returns ``(loss_sum, num_tokens, ...)``, or give ``aggregate_outputs_fn``)."""

    type: TypeRef
    args: dict[str, Any] = field(default_factory=dict)
    clip_gnorm: float | None = 0.0
    loss_reduction: str = "mean"
    grad_reduction: str = "mean"
    aggregate_outputs_fn: TypeRef | None = None
    _key: str = _key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "optimizer")

    def _validate(self, prefix: str) -> None:
        _choice(self.grad_reduction, ("mean", "sum", "per-token-mean"),
                f"{prefix}grad_reduction")
        _choice(self.loss_reduction, ("mean", "sum"), f"{prefix}loss_reduction")
        if self.clip_gnorm is not None and self.clip_gnorm < 0:
            raise ConfigError(f"{prefix}clip_gnorm must be >= 0 (0 or null: no clipping), got "
                              f"{self.clip_gnorm!r}.", f"{prefix}clip_gnorm")


@dataclass(kw_only=True)
class DatasetConfig(_Checked):
    """The datasets: ``type(**train_args)`` for training and, when ``val_args`` is not
    empty, ``type(**val_args)`` for validation (map-style: ``__getitem__``, ``__len__``)."""

    type: TypeRef
    train_args: dict[str, Any] = field(default_factory=dict)
    val_args: dict[str, Any] = field(default_factory=dict)
    _key: str = _key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "dataset")


@dataclass(kw_only=True)
class DataloaderConfig(_Checked):
    """The data loader: ``type(dataset, batch_size=micro_batch_size, sampler=..., **args)``
    (``dataset``, ``batch_size`` and ``sampler`` are set by the Trainer). ``val_args``
    defaults to ``train_args``."""

    type: TypeRef = "torch.utils.data.DataLoader"
    train_args: dict[str, Any] = field(default_factory=dict)
    val_args: dict[str, Any] = field(default_factory=dict)
    test_args: dict[str, Any] = field(default_factory=dict)
    _key: str = _key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "dataloader")

    def _validate(self, prefix: str) -> None:
        for name in ("train_args", "val_args", "test_args"):
            for reserved in ("dataset", "batch_size", "sampler"):
                if reserved in getattr(self, name):
                    raise ConfigError(
                        f"{prefix}{name}.{reserved} is set by the Trainer (dataset, "
                        f"micro_batch_size, the sampler); remove it.",
                        f"{prefix}{name}.{reserved}",
                    )


@dataclass(kw_only=True)
class DatasetSamplerConfig(_Checked):
    """The sampler: ``type(dataset, num_replicas=scale units, rank=this unit, **args)``
    (``dataset``, ``num_replicas`` and ``rank`` are set by the Trainer)."""

    type: TypeRef = "torch.utils.data.DistributedSampler"
    train_args: dict[str, Any] = field(default_factory=dict)
    val_args: dict[str, Any] = field(default_factory=dict)
    test_args: dict[str, Any] = field(default_factory=dict)
    _key: str = _key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "dataset_sampler")

    def _validate(self, prefix: str) -> None:
        for name in ("train_args", "val_args", "test_args"):
            for reserved in ("dataset", "num_replicas", "rank"):
                if reserved in getattr(self, name):
                    raise ConfigError(
                        f"{prefix}{name}.{reserved} is set by the Trainer (the dataset, the "
                        f"number of scale units, this unit); remove it.",
                        f"{prefix}{name}.{reserved}",
                    )


@dataclass(kw_only=True)
class LRSchedulerConfig(_Checked):
    """The learning-rate scheduler: ``type(optimizer, **args)``, stepped after every
    optimizer step (``interval='step'``) or every epoch (``'epoch'``)."""

    type: TypeRef
    args: dict[str, Any] = field(default_factory=dict)
    interval: str = "epoch"
    _key: str = _key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "lr_scheduler")

    def _validate(self, prefix: str) -> None:
        _choice(self.interval, ("step", "epoch"), f"{prefix}interval")


@dataclass(kw_only=True)
class CheckpointConfig(_Checked):
    """Where and when checkpoints are written, and where a run resumes from.

    Checkpoints are folders ``save_dir/EEEE-SSSS`` (epoch, global step) with one file per
    rank (``save_type`` ``'sharded'`` or ``'deduped'``) or one merged file
    (``'merged'``), plus ``last`` and ``best`` (links, or copies with
    ``symlink_best_and_last=False``). ``resume_from`` is ``'last'``, ``'best'``, a
    checkpoint folder or merged file, or None; ``'last'``/``'best'`` that do not exist yet
    start from scratch.
    """

    save_dir: str = "./checkpoints"
    no_save: bool = False
    save_type: str = "sharded"
    save_last: bool = True
    save_best: bool = True
    symlink_best_and_last: bool = True
    every_n_train_steps: int | None = None
    every_n_epochs: int | None = None
    keep_last_n_checkpoints: int | None = None
    resume_from: str | None = None
    _key: str = _key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "checkpoint")

    def _validate(self, prefix: str) -> None:
        _choice(self.save_type, ("sharded", "deduped", "merged"), f"{prefix}save_type")
        for name in ("every_n_train_steps", "every_n_epochs", "keep_last_n_checkpoints"):
            _positive(getattr(self, name), f"{prefix}{name}")


@dataclass(kw_only=True)
class LogConfig(_Checked):
    """A logger: a registered logger name (``'tensorboard'``; plugins add more through
    ``nnscaler_register_loggers``) or a class / import path, built as ``type(**args)``."""

    type: TypeRef
    args: dict[str, Any] = field(default_factory=dict)
    _key: str = _key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "log")


@dataclass(kw_only=True)
class HookConfig(_Checked):
    """Hooks as an object: ``type(**args)`` whose methods named like the Trainer hooks
    (``on_train_step_end``, ...; see :class:`HookMapConfig`) are called."""

    type: TypeRef
    args: dict[str, Any] = field(default_factory=dict)
    _key: str = _key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "hook")


@dataclass(kw_only=True)
class HookMapConfig(_Checked):
    """Hooks as functions (objects or import paths), each called with the Trainer first."""

    after_setup: TypeRef | None = None
    on_finalize: TypeRef | None = None
    on_train_start: TypeRef | None = None
    on_train_end: TypeRef | None = None
    on_val_start: TypeRef | None = None
    on_val_end: TypeRef | None = None
    on_epoch_start: TypeRef | None = None
    on_epoch_end: TypeRef | None = None
    on_train_step_start: TypeRef | None = None
    on_train_step_end: TypeRef | None = None
    on_val_step_start: TypeRef | None = None
    on_val_step_end: TypeRef | None = None
    on_step_start: TypeRef | None = None
    on_step_end: TypeRef | None = None
    after_aggregate_train_step_outputs: TypeRef | None = None
    after_aggregate_val_step_outputs: TypeRef | None = None
    before_zero_grad: TypeRef | None = None
    after_zero_grad: TypeRef | None = None
    before_sync_grad: TypeRef | None = None
    after_sync_grad: TypeRef | None = None
    before_gnorm_clip: TypeRef | None = None
    after_gnorm_clip: TypeRef | None = None
    before_optimizer_step: TypeRef | None = None
    after_optimizer_step: TypeRef | None = None
    before_log_train_metrics: TypeRef | None = None
    before_log_val_metrics: TypeRef | None = None
    on_load_checkpoint: TypeRef | None = None
    on_save_checkpoint: TypeRef | None = None
    _key: str = _key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "hook")


HOOK_NAMES: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(HookMapConfig) if f.name != "_key"
)


@dataclass
class AggregatedOutputs:
    """What ``aggregate_outputs_fn(outputs, sync_group)`` returns for one step: the loss
    summed over this step's batches (all units), their number, and the number of tokens
    (``grad_reduction='per-token-mean'``)."""

    loss_sum: float | None = None
    num_batches: int | None = None
    num_tokens: int | None = None
    aggregated_outputs: Any = None


@dataclass(kw_only=True)
class TrainerArgs(_Checked):
    """Everything the :class:`~nnscaler.cli.trainer.Trainer` needs (nnScaler's names).

    Required: ``compute_config`` (with ``use_end2end=True``), ``model``, ``optimizer``,
    ``dataset``. See ``docs/trainer.md`` for every field.
    """

    compute_config: ComputeConfig
    model: ModelConfig
    optimizer: OptimizerConfig
    dataset: DatasetConfig

    gen_savedir: str = "./.nnscaler"
    gen_reuse: str = "auto"
    pas_policy: str | Callable[..., Any] = "autodist"
    broadcast_strategy: str = "all"
    instance_name: str | None = None
    run_mode: str = "run"
    tracing_from_weights: str | None = None

    dataloader: DataloaderConfig = field(default_factory=DataloaderConfig)
    dataset_sampler: DatasetSamplerConfig = field(default_factory=DatasetSamplerConfig)
    lr_scheduler: LRSchedulerConfig | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: list[LogConfig] = field(default_factory=list)
    hook: HookConfig | HookMapConfig | None = None

    precision: str | None = None

    micro_batch_size: int = 1
    global_batch_size: int | None = None
    grad_accumulation_steps: int | None = None

    max_epochs: int | None = None
    max_train_steps: int | None = None
    max_val_steps: int | None = None

    val_every_n_train_steps: int | None = None
    val_every_n_epochs: int | None = 1

    enable_progress_bar: bool = True
    log_every_n_steps: int = 10

    seed: int | None = None
    init_env_fn: TypeRef | None = None
    collective_timeout: float = 300.0
    _key: str = _key_field()

    def __post_init__(self) -> None:
        self._check(self._key)

    def _validate(self, prefix: str) -> None:
        if not self.compute_config.use_end2end:
            raise ConfigError(
                f"{prefix}compute_config.use_end2end must be true: the Trainer runs "
                f"train_step on modules whose forward takes one batch and returns the loss "
                f"first. Fix: ComputeConfig(..., use_end2end=True).",
                f"{prefix}compute_config.use_end2end",
            )
        _choice(self.run_mode, ("run", "compile"), f"{prefix}run_mode")
        _choice(self.gen_reuse, ("auto", "match", "override", "moo", "graph"),
                f"{prefix}gen_reuse")
        _choice(self.broadcast_strategy, ("none", "all", "no_weights", "code"),
                f"{prefix}broadcast_strategy")
        if self.precision is not None:
            _choice(self.precision, _PRECISIONS, f"{prefix}precision")
        for name in ("micro_batch_size", "log_every_n_steps"):
            _positive(getattr(self, name), f"{prefix}{name}", allow_none=False)
        for name in ("global_batch_size", "grad_accumulation_steps", "max_epochs",
                     "max_train_steps", "max_val_steps", "val_every_n_train_steps",
                     "val_every_n_epochs"):
            _positive(getattr(self, name), f"{prefix}{name}")
        if self.collective_timeout <= 0:
            raise ConfigError(f"{prefix}collective_timeout must be > 0 seconds, got "
                              f"{self.collective_timeout!r}.", f"{prefix}collective_timeout")
        self.grad_accumulation_steps = self._accumulation(prefix)
        # every class path must import now, not three layers later
        refs = [("model.type", self.model.type), ("optimizer.type", self.optimizer.type),
                ("dataset.type", self.dataset.type), ("dataloader.type", self.dataloader.type),
                ("dataset_sampler.type", self.dataset_sampler.type),
                ("optimizer.aggregate_outputs_fn", self.optimizer.aggregate_outputs_fn),
                ("init_env_fn", self.init_env_fn)]
        if self.lr_scheduler is not None:
            refs.append(("lr_scheduler.type", self.lr_scheduler.type))
        if isinstance(self.hook, HookConfig):
            refs.append(("hook.type", self.hook.type))
        elif isinstance(self.hook, HookMapConfig):
            refs += [(f"hook.{n}", getattr(self.hook, n)) for n in HOOK_NAMES]
        for key, ref in refs:
            if ref is not None:
                resolve_object(ref, prefix + key)
        if not isinstance(self.pas_policy, str):
            return
        if "." in self.pas_policy:
            resolve_object(self.pas_policy, prefix + "pas_policy")

    def _accumulation(self, prefix: str) -> int:
        units = self.compute_config.scale_units
        per_step = self.micro_batch_size * units
        accum = self.grad_accumulation_steps
        if self.global_batch_size is None:
            return accum or 1
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"{prefix}global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size x scale units ({self.micro_batch_size} x {units} = "
                f"{per_step}). Fix: use a multiple of {per_step}, or set "
                f"grad_accumulation_steps instead.",
                f"{prefix}global_batch_size",
            )
        derived = self.global_batch_size // per_step
        if accum is not None and accum != derived:
            raise ConfigError(
                f"{prefix}grad_accumulation_steps ({accum}) disagrees with global_batch_size "
                f"{self.global_batch_size} = micro_batch_size {self.micro_batch_size} x "
                f"{units} units x {derived}. Fix: set only one of the two.",
                f"{prefix}grad_accumulation_steps",
            )
        return derived

    # -- derived --------------------------------------------------------------------
    @property
    def scaling_factor(self) -> int:
        """The number of data-parallel units (``runtime_ngpus // plan_ngpus``)."""
        return self.compute_config.scale_units

    @property
    def update_freq(self) -> int:
        """Micro-batches per optimizer step on each unit (gradient accumulation)."""
        return int(self.grad_accumulation_steps or 1)

    @property
    def effective_global_batch_size(self) -> int:
        """Samples per optimizer step over all units."""
        return self.micro_batch_size * self.update_freq * self.scaling_factor

    @property
    def resolved_precision(self) -> str:
        """``'fp32'``, ``'bf16'`` or ``'fp16'`` (None means fp32)."""
        return self.precision or "fp32"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainerArgs:
        """Build from a plain mapping (a loaded YAML file); see :mod:`nnscaler.cli.train`."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"the configuration must be a mapping of TrainerArgs fields, "
                              f"got {type(data).__name__}.")
        return _from_mapping(cls, data, "")
