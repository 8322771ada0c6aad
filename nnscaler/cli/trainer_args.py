"""nnScaler's import path of the Trainer's configuration:
``from nnscaler.cli.trainer_args import *`` gives `TrainerArgs`, every config
class and [`ComputeConfig`][nnscaler.ComputeConfig], as nnScaler's quickstart expects. They live
in `nnscaler.trainer.args`."""

from __future__ import annotations

from nnscaler.trainer.args import (  # noqa: F401 - HOOK_NAMES: importable as before
    HOOK_NAMES,
    AggregatedOutputs,
    CheckpointConfig,
    ComputeConfig,
    DataloaderConfig,
    DatasetConfig,
    DatasetSamplerConfig,
    DebugConfig,
    HookConfig,
    HookMapConfig,
    LogConfig,
    LRSchedulerConfig,
    ModelConfig,
    ModuleParallelizeConfig,
    OptimizerConfig,
    OptionalComputeConfig,
    ResumeOptions,
    TrainerArgs,
    load_type,
)
from nnscaler.trainer.errors import ConfigError
from nnscaler.trainer.fields import TypeRef, import_path, resolve_object  # noqa: F401

__all__ = [
    "AggregatedOutputs",
    "CheckpointConfig",
    "ComputeConfig",
    "ConfigError",
    "DataloaderConfig",
    "DatasetConfig",
    "DatasetSamplerConfig",
    "DebugConfig",
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
    "load_type",
    "resolve_object",
]
