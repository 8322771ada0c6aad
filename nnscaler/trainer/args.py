"""The Trainer's configuration: `TrainerArgs` and the config classes it holds.

Every class here is a keyword-only dataclass that checks its fields when it is built,
from Python or from a YAML mapping (`TrainerArgs.from_dict`): an unknown key, a
value of the wrong type or a missing required field raises `ConfigError` naming
the dotted key (``optimizer.args.lr``) and, for a typo, the closest valid key (the
checking is `nnscaler.trainer.fields`). Classes and functions (``model.type``,
``optimizer.type``, ...) are given as objects or as import paths
(``'torch.optim.AdamW'``); a path that does not import is an error naming the key. Names
and meanings follow nnScaler's ``nnscaler.cli.trainer_args``, the import path users know
(it re-exports this module).

``from nnscaler.cli.trainer_args import *`` gives every config class and
[`ComputeConfig`][nnscaler.ComputeConfig], as nnScaler's quickstart expects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nnscaler.config import AUTO, ComputeConfig
from nnscaler.trainer.default_policy import DEFAULT_POLICY, ONE_DEVICE_POLICY, default_policy
from nnscaler.trainer.errors import ConfigError
from nnscaler.trainer.fields import (
    Checked,
    TypeRef,
    choice,
    from_mapping,
    key_field,
    positive,
    resolve_object,
)
from nnscaler.trainer.options import (
    DebugConfig,
    ModuleParallelizeConfig,
    OptionalComputeConfig,
    ResumeOptions,
)
from nnscaler.trainer.values import create_kwarg

__all__ = [
    "DEFAULT_POLICY",
    "ONE_DEVICE_POLICY",
    "AggregatedOutputs",
    "CheckpointConfig",
    "ComputeConfig",
    "ConfigError",
    "DataloaderConfig",
    "DatasetConfig",
    "DatasetSamplerConfig",
    "DebugConfig",
    "HOOK_NAMES",
    "HookConfig",
    "HookMapConfig",
    "LRSchedulerConfig",
    "LogConfig",
    "ModelConfig",
    "ModuleParallelizeConfig",
    "OptimizerConfig",
    "OptionalComputeConfig",
    "ResumeOptions",
    "TrainerArgs",
    "TypeRef",
    "default_policy",
    "load_type",
    "resolve_object",
]



def load_type(name: str | Any) -> Any:
    """nnScaler's ``load_type``: the class or function at the import path ``name``
    (``'torch.optim.AdamW'``), or ``name`` itself when it is not a string."""
    return resolve_object(name, "load_type")

_PRECISIONS = ("fp32", "bf16", "fp16", "none")

#: nnScaler ``TrainerArgs`` fields without a counterpart, and what to write instead.
_NNSCALER_ONLY = {
    "dummy_sample_gen_fn": "the Trainer traces with the first micro-batch of the training "
                           "dataset (built without touching any RNG). Fix: remove it.",
    "log_progress_every_n_train_steps": "write log_every_n_steps (it paces the progress "
                                        "line and the metric loggers alike).",
}


@dataclass(kw_only=True)
class ModelConfig(Checked):
    """The model: ``type(**args)`` builds it (an ``nn.Module`` subclass; its ``forward``
    takes one batch and returns the loss first).

    ``pretrained``: a Hugging Face Hub-format folder (``model.safetensors`` or shards with
    their index) the parallel model starts from, each rank reading only its slices
    ([`nnscaler.load_pretrained`][nnscaler.load_pretrained]; a checkpoint to resume from still
    wins). With ``compute_config.trace_strategy='meta'`` the model is built with its parameters on
    the meta device ([`nnscaler.meta_parameters`][nnscaler.meta_parameters]), so no process ever
    holds all of it.

    ``parallel_modules``: nnScaler's submodule form (`ModuleParallelizeConfig`): only
    those submodule types are parallelized, and the model around them runs as written."""

    type: TypeRef
    args: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None
    parallel_modules: list[ModuleParallelizeConfig] = field(default_factory=list)
    _key: str = key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "model")

    def _validate(self, prefix: str) -> None:
        types = [resolve_object(m.type, f"{prefix}parallel_modules.{i}.type")
                 for i, m in enumerate(self.parallel_modules)]
        if len(set(types)) != len(types):
            raise ConfigError(
                f"{prefix}parallel_modules names a type twice: each type is parallelized "
                f"once (all its instances share the plan). Fix: one entry per type; for two "
                f"plans, subclass it (class Alias(Block): pass) and use the alias.",
                f"{prefix}parallel_modules")
        if self.parallel_modules and resolve_object(self.type, f"{prefix}type") in types:
            raise ConfigError(f"{prefix}parallel_modules cannot name the model's own type; "
                              f"parallelize the whole model by leaving parallel_modules "
                              f"empty.", f"{prefix}parallel_modules")


@dataclass(kw_only=True)
class OptimizerConfig(Checked):
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
    _key: str = key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "optimizer")

    def _validate(self, prefix: str) -> None:
        choice(self.grad_reduction, ("mean", "sum", "per-token-mean"),
                f"{prefix}grad_reduction")
        choice(self.loss_reduction, ("mean", "sum"), f"{prefix}loss_reduction")
        if self.clip_gnorm is not None and self.clip_gnorm < 0:
            raise ConfigError(f"{prefix}clip_gnorm must be >= 0 (0 or null: no clipping), got "
                              f"{self.clip_gnorm!r}.", f"{prefix}clip_gnorm")


@dataclass(kw_only=True)
class DatasetConfig(Checked):
    """The datasets: ``type(**train_args)`` for training and, when ``val_args`` is not
    empty, ``type(**val_args)`` for validation (map-style: ``__getitem__``, ``__len__``)."""

    type: TypeRef
    train_args: dict[str, Any] = field(default_factory=dict)
    val_args: dict[str, Any] = field(default_factory=dict)
    test_args: dict[str, Any] = field(default_factory=dict)
    _key: str = key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "dataset")


@dataclass(kw_only=True)
class DataloaderConfig(Checked):
    """The data loader: ``type(dataset, batch_size=micro_batch_size, sampler=..., **args)``
    (``dataset``, ``batch_size`` and ``sampler`` are set by the Trainer). ``val_args``
    defaults to ``train_args``."""

    type: TypeRef = "torch.utils.data.DataLoader"
    train_args: dict[str, Any] = field(default_factory=dict)
    val_args: dict[str, Any] = field(default_factory=dict)
    test_args: dict[str, Any] = field(default_factory=dict)
    _key: str = key_field()

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
class DatasetSamplerConfig(Checked):
    """The sampler: ``type(dataset, num_replicas=scale units, rank=this unit, **args)``
    (``dataset``, ``num_replicas`` and ``rank`` are set by the Trainer)."""

    type: TypeRef = "torch.utils.data.DistributedSampler"
    train_args: dict[str, Any] = field(default_factory=dict)
    val_args: dict[str, Any] = field(default_factory=dict)
    test_args: dict[str, Any] = field(default_factory=dict)
    _key: str = key_field()

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
class LRSchedulerConfig(Checked):
    """The learning-rate scheduler: ``type(optimizer, **args)``, stepped after every
    optimizer step (``interval='step'``) or every epoch (``'epoch'``)."""

    type: TypeRef
    args: dict[str, Any] = field(default_factory=dict)
    interval: str = "epoch"
    _key: str = key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "lr_scheduler")

    def _validate(self, prefix: str) -> None:
        choice(self.interval, ("step", "epoch"), f"{prefix}interval")


@dataclass(kw_only=True)
class CheckpointConfig(Checked):
    """Where and when checkpoints are written, and where a run resumes from.

    Checkpoints are folders ``save_dir/EEEE-SSSS`` (epoch, global step) with one file per
    rank (``save_type`` ``'sharded'`` or ``'deduped'``) or one merged file
    (``'merged'``), plus ``last`` and ``best`` (links, or copies with
    ``symlink_best_and_last=False``). ``resume_from`` is ``'last'``, ``'best'``, a
    checkpoint folder or merged file, or None; ``'last'``/``'best'`` that do not exist yet
    start from scratch. It may also be a `ResumeOptions` mapping (nnScaler's form:
    ``checkpoint``, ``convert_fn``, ``with_merged``).
    """

    @property
    def resume_options(self) -> ResumeOptions | None:
        """``resume_from`` as `ResumeOptions` (None when not resuming)."""
        if self.resume_from is None or isinstance(self.resume_from, ResumeOptions):
            return self.resume_from
        return ResumeOptions(checkpoint=self.resume_from, _key=f"{self._key}.resume_from")

    save_dir: str = "./checkpoints"
    no_save: bool = False
    save_type: str = "sharded"
    save_last: bool = True
    save_best: bool = True
    symlink_best_and_last: bool = True
    every_n_train_steps: int | None = None
    every_n_epochs: int | None = None
    keep_last_n_checkpoints: int | None = None
    resume_from: str | ResumeOptions | None = None
    _key: str = key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "checkpoint")

    def _validate(self, prefix: str) -> None:
        choice(self.save_type, ("sharded", "deduped", "merged"), f"{prefix}save_type")
        for name in ("every_n_train_steps", "every_n_epochs", "keep_last_n_checkpoints"):
            positive(getattr(self, name), f"{prefix}{name}")


@dataclass(kw_only=True)
class LogConfig(Checked):
    """A logger: a registered logger name (``'tensorboard'``; plugins add more through
    ``nnscaler_register_loggers``) or a class / import path, built as ``type(**args)``."""

    type: TypeRef
    args: dict[str, Any] = field(default_factory=dict)
    _key: str = key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "log")


@dataclass(kw_only=True)
class HookConfig(Checked):
    """Hooks as an object: ``type(**args)`` whose methods named like the Trainer hooks
    (``on_train_step_end``, ...; see `HookMapConfig`) are called."""

    type: TypeRef
    args: dict[str, Any] = field(default_factory=dict)
    _key: str = key_field()

    def __post_init__(self) -> None:
        self._check(self._key or "hook")


@dataclass(kw_only=True)
class HookMapConfig(Checked):
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
    _key: str = key_field()

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
class TrainerArgs(Checked):
    """Everything the `Trainer` needs (nnScaler's names).

    Required: ``compute_config`` (with ``use_end2end=True``), ``model``, ``optimizer``,
    ``dataset``. See ``docs/trainer.md`` for every field.
    """

    compute_config: ComputeConfig
    model: ModelConfig
    optimizer: OptimizerConfig
    dataset: DatasetConfig

    vars: dict[str, Any] = field(default_factory=dict)
    init_module: str | None = None
    gen_savedir: str = "./.nnscaler"
    gen_reuse: str = "auto"
    pas_policy: str | Callable[..., Any] = DEFAULT_POLICY
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
    debug: DebugConfig = field(default_factory=DebugConfig)

    precision: str | dict[str, str] | None = None

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
    _key: str = key_field()

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
        choice(self.run_mode, ("run", "compile"), f"{prefix}run_mode")
        choice(self.gen_reuse, ("auto", "match", "override", "moo", "graph"),
                f"{prefix}gen_reuse")
        choice(self.broadcast_strategy, ("none", "all", "no_weights", "code"),
                f"{prefix}broadcast_strategy")
        if isinstance(self.precision, dict):
            raise ConfigError(
                f"{prefix}precision is a mapping {self.precision!r}: nnScaler's per-tensor "
                f"form (param / buffer / input) is not supported here, where the module, its "
                f"buffers and the inputs share one dtype (with fp32 master weights in the "
                f"optimizer). Fix: one of {list(_PRECISIONS)}.", f"{prefix}precision")
        if self.precision is not None:
            choice(self.precision, _PRECISIONS, f"{prefix}precision")
        for name in ("micro_batch_size", "log_every_n_steps"):
            positive(getattr(self, name), f"{prefix}{name}", allow_none=False)
        for name in ("global_batch_size", "grad_accumulation_steps", "max_epochs",
                     "max_train_steps", "max_val_steps", "val_every_n_train_steps",
                     "val_every_n_epochs"):
            positive(getattr(self, name), f"{prefix}{name}")
        if self.collective_timeout <= 0:
            raise ConfigError(f"{prefix}collective_timeout must be > 0 seconds, got "
                              f"{self.collective_timeout!r}.", f"{prefix}collective_timeout")
        if self.compute_config.plan_ngpus != AUTO:  # else once the plan chose the unit
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
        if self.pas_policy == DEFAULT_POLICY:
            self.pas_policy = default_policy(self.compute_config)
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

    def resolve(self, config: ComputeConfig) -> None:
        """Take the config ``parallelize`` made concrete (``plan_ngpus='auto'`` or
        ``zero_stage='auto'`` replaced by the plan's choice), and check the batch sizes
        against its scale units, as a given ``plan_ngpus`` is checked when the arguments
        are built."""
        self.compute_config = config
        self.grad_accumulation_steps = self._accumulation(f"{self._key}." if self._key else "")

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
        """``'fp32'``, ``'bf16'``, ``'fp16'`` or ``'none'`` (no conversion: the module,
        inputs and optimizer as they are); None means fp32."""
        return self.precision or "fp32"

    # -- nnScaler's builders ------------------------------------------------------------
    @property
    def resolved_vars(self) -> dict[str, Any]:
        """``vars`` with its objects built (what ``$!(vars.x)`` reads); built once."""
        built = self.__dict__.get("_resolved_vars")
        if built is None:
            built = create_kwarg(self.vars, None, "vars")
            self.__dict__["_resolved_vars"] = built
        return built

    def create_kwarg(self, value: Any, key: str = "args") -> Any:
        """``value`` with nnScaler's object forms built (``__type``, ``__value_type``,
        ``$!(vars.x)``, ``$!(self)``; see `nnscaler.trainer.values`)."""
        return create_kwarg(value, self, key)

    def create_dataset(self, stage: str = "train") -> Any:
        """The dataset of ``stage`` (``'train'``, ``'val'`` or ``'test'``):
        ``dataset.type(**<stage>_args)``; None for ``'val'`` / ``'test'`` with no arguments
        (the training dataset is built even without any), as in nnScaler."""
        choice(stage, ("train", "val", "test"), "stage")
        stage_args = getattr(self.dataset, f"{stage}_args")
        if not stage_args and stage != "train":
            return None
        cls = resolve_object(self.dataset.type, "dataset.type")
        return cls(**self.create_kwarg(stage_args, f"dataset.{stage}_args"))

    @classmethod
    def from_cli(cls, argv: list[str]) -> TrainerArgs:
        """nnScaler's ``TrainerArgs.from_cli(['-f', 'config.yaml', '--key', 'value', ...])``:
        the YAML file, the overrides, then the ``$(...)`` references resolved."""
        from nnscaler.trainer.cmdline import parse_args

        return parse_args(list(argv))

    @classmethod
    def from_yaml(cls, path: str) -> TrainerArgs:
        """``from_cli(['-f', path])``."""
        return cls.from_cli(["-f", str(path)])

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainerArgs:
        """Build from a plain mapping (a loaded YAML file); see `nnscaler.cli.train`."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"the configuration must be a mapping of TrainerArgs fields, "
                              f"got {type(data).__name__}.")
        for name, why in _NNSCALER_ONLY.items():
            if name in data:
                raise ConfigError(f"{name}: nnScaler's TrainerArgs field is not supported "
                                  f"here: {why}", name)
        init_module = data.get("init_module")
        if init_module:
            import importlib

            try:
                importlib.import_module(init_module)
            except ImportError as e:
                raise ConfigError(f"init_module: cannot import {init_module!r} ({e}). Fix: "
                                  f"check the module path and sys.path.", "init_module") from e
        return from_mapping(cls, data, "")
