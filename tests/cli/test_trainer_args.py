"""TrainerArgs and its config classes, from Python and from YAML; every bad config
names its dotted key (and the closest valid key for a typo)."""

from __future__ import annotations

import copy
import math
import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nnscaler.cli.train import apply_overrides, load_yaml, parse_args, parse_value
from nnscaler.cli.trainer_args import (
    CheckpointConfig,
    ComputeConfig,
    ConfigError,
    DataloaderConfig,
    DatasetConfig,
    DatasetSamplerConfig,
    HookConfig,
    HookMapConfig,
    LogConfig,
    LRSchedulerConfig,
    ModelConfig,
    OptimizerConfig,
    TrainerArgs,
)

FULL_YAML = """
compute_config:
  plan_ngpus: 1
  runtime_ngpus: 2
  use_end2end: true
  pas_config: {seed: 1}
pas_policy: dp
run_mode: run
micro_batch_size: 2
global_batch_size: 8
max_epochs: 2
max_train_steps: 10
precision: bf16
seed: 3
model:
  type: cli.common.MLP
  args: {dim: 8, hidden: 16}
optimizer:
  type: torch.optim.AdamW
  args: {lr: 1e-3, betas: [0.9, 0.95]}
  clip_gnorm: 1.0
  grad_reduction: sum
dataset:
  type: cli.common.FixedDataset
  train_args: {size: 32}
  val_args: {size: 8}
dataloader:
  train_args: {drop_last: true}
dataset_sampler:
  train_args: {shuffle: false}
lr_scheduler:
  type: torch.optim.lr_scheduler.StepLR
  args: {step_size: 2}
  interval: step
checkpoint:
  save_dir: ./ck
  every_n_train_steps: 2
  keep_last_n_checkpoints: 3
  save_type: deduped
  resume_from: last
log:
  - type: tensorboard
    args: {root_dir: ./tb}
hook:
  on_train_step_end: cli.common.run_trainer
"""


def _write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_every_config_class_from_yaml(tmp_path):
    args = TrainerArgs.from_dict(load_yaml(_write(tmp_path, FULL_YAML)))
    assert args.compute_config == ComputeConfig(plan_ngpus=1, runtime_ngpus=2, use_end2end=True,
                                                pas_config={"seed": 1})
    assert isinstance(args.model, ModelConfig) and args.model.args == {"dim": 8, "hidden": 16}
    assert isinstance(args.optimizer, OptimizerConfig)
    assert args.optimizer.args["lr"] == 1e-3          # '1e-3' is a float, as in YAML 1.2
    assert args.optimizer.grad_reduction == "sum" and args.optimizer.clip_gnorm == 1.0
    assert isinstance(args.dataset, DatasetConfig) and args.dataset.val_args == {"size": 8}
    assert isinstance(args.dataloader, DataloaderConfig)
    assert args.dataloader.type == "torch.utils.data.DataLoader"
    assert isinstance(args.dataset_sampler, DatasetSamplerConfig)
    assert isinstance(args.lr_scheduler, LRSchedulerConfig) and args.lr_scheduler.interval == "step"
    assert isinstance(args.checkpoint, CheckpointConfig) and args.checkpoint.save_type == "deduped"
    assert isinstance(args.log[0], LogConfig) and args.log[0].type == "tensorboard"
    assert isinstance(args.hook, HookMapConfig)
    assert args.grad_accumulation_steps == 2          # 8 = 2 per batch x 2 units x 2
    assert args.precision == "bf16"
    # the plain form goes back to the same config
    again = TrainerArgs.from_dict(copy.deepcopy(args.to_dict()))
    assert again.to_dict() == args.to_dict()


def test_every_config_class_from_python():
    from cli.common import MLP, FixedDataset

    args = TrainerArgs(
        compute_config=ComputeConfig(plan_ngpus=1, runtime_ngpus=1, use_end2end=True),
        model=ModelConfig(type=MLP, args={"dim": 8}),
        optimizer=OptimizerConfig(type=torch.optim.SGD, args={"lr": 0.1}),
        dataset=DatasetConfig(type=FixedDataset),
        dataloader=DataloaderConfig(train_args={"drop_last": True}),
        dataset_sampler=DatasetSamplerConfig(train_args={"shuffle": False}),
        lr_scheduler=LRSchedulerConfig(type=torch.optim.lr_scheduler.StepLR,
                                       args={"step_size": 1}),
        checkpoint=CheckpointConfig(save_type="merged", keep_last_n_checkpoints=1),
        log=[LogConfig(type="tensorboard")],
        hook=HookConfig(type="cli.common.MLP"),
        max_train_steps=1,
    )
    assert args.to_dict()["model"]["type"] == "cli.common.MLP"
    assert args.to_dict()["optimizer"]["type"] == "torch.optim.sgd.SGD"
    assert TrainerArgs.from_dict(args.to_dict()).to_dict() == args.to_dict()
    # the defaults are nnScaler's
    assert args.pas_policy == "autodist" and args.gen_reuse == "auto"
    assert args.micro_batch_size == 1 and args.val_every_n_epochs == 1
    assert args.dataset_sampler.type == "torch.utils.data.DistributedSampler"
    assert args.lr_scheduler.interval == "epoch"
    assert args.checkpoint.save_dir == "./checkpoints" and args.checkpoint.resume_from is None


def _base():
    return load_yaml_text(FULL_YAML)


def load_yaml_text(text):
    import yaml

    from nnscaler.cli.train import _Loader

    return yaml.load(textwrap.dedent(text), Loader=_Loader)  # noqa: S506


def _set(d, dotted, value):
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d[int(k)] if isinstance(d, list) else d[k]
    if value is _DELETE:
        del d[keys[-1]]
    else:
        d[keys[-1]] = value


_DELETE = object()

BAD = [
    # (dotted key to set, value, the key the error names, text it holds)
    ("max_train_step", 5, "max_train_step", "Did you mean 'max_train_steps'"),
    ("optimizer.clip_gnrom", 1.0, "optimizer.clip_gnrom", "Did you mean 'clip_gnorm'"),
    ("compute_config.plan_gpus", 1, "compute_config.plan_gpus", "Did you mean 'plan_ngpus'"),
    ("checkpoint.every_n_train_step", 1, "checkpoint.every_n_train_step",
     "Did you mean 'every_n_train_steps'"),
    ("hook.on_train_stepend", "x.y", "hook.on_train_stepend", "Did you mean 'on_train_step_end'"),
    ("micro_batch_size", "four", "micro_batch_size", "must be an int, got str 'four'"),
    ("enable_progress_bar", "yes please", "enable_progress_bar", "must be true or false"),
    ("optimizer.args", [1], "optimizer.args", "must be a mapping"),
    ("log", {"type": "tensorboard"}, "log", "must be a list"),
    ("checkpoint.save_type", "shard", "checkpoint.save_type", "Did you mean 'sharded'"),
    ("optimizer.grad_reduction", "avg", "optimizer.grad_reduction", "must be one of"),
    ("lr_scheduler.interval", "steps", "lr_scheduler.interval", "Did you mean 'step'"),
    ("dataset", _DELETE, "dataset", "dataset is required"),
    ("model.type", _DELETE, "model.type", "model.type is required"),
    ("compute_config.runtime_ngpus", _DELETE, "compute_config.runtime_ngpus", "WORLD_SIZE"),
    ("model.type", "cli.common.MPL", "model.type", "cannot import 'cli.common.MPL'"),
    ("dataset.type", "no_such_package.Data", "dataset.type", "cannot import"),
    ("optimizer.type", "torch.optim.AdamWW", "optimizer.type", "has no attribute 'AdamWW'"),
    ("lr_scheduler.type", "not a path", "lr_scheduler.type", "is not an import path"),
    ("hook.on_train_step_end", "cli.common.nothing", "hook.on_train_step_end",
     "cannot import"),
    ("compute_config.use_end2end", False, "compute_config.use_end2end", "must be true"),
    ("compute_config.plan_ngpus", 4, "compute_config", "multiple of plan_ngpus"),
    ("global_batch_size", 6, "global_batch_size", "multiple of micro_batch_size"),
    ("precision", "fp8", "precision", "must be one of ['fp32', 'bf16', 'fp16', 'none']"),
    ("dataloader.train_args.batch_size", 4, "dataloader.train_args.batch_size",
     "set by the Trainer"),
]


@pytest.mark.parametrize("dotted,value,key,text", BAD, ids=[b[0] + "-" + str(i)
                                                            for i, b in enumerate(BAD)])
def test_bad_config_names_the_key(dotted, value, key, text):
    data = _base()
    _set(data, dotted, value)
    with pytest.raises(ConfigError) as info:
        TrainerArgs.from_dict(data)
    assert info.value.key == key
    assert key in str(info.value) and text in str(info.value)


def test_bad_python_config_names_the_key():
    with pytest.raises(ConfigError, match="optimizer.clip_gnorm must be a number") as info:
        OptimizerConfig(type="torch.optim.SGD", clip_gnorm="high")
    assert info.value.key == "optimizer.clip_gnorm"
    with pytest.raises(TypeError, match="dataset"):
        TrainerArgs(compute_config=ComputeConfig(plan_ngpus=1, runtime_ngpus=1,
                                                 use_end2end=True),
                    model=ModelConfig(type="cli.common.MLP"),
                    optimizer=OptimizerConfig(type="torch.optim.SGD"))


def test_yaml_is_loaded_safely(tmp_path):
    path = _write(tmp_path, """
        model: !!python/object/apply:os.system ["echo pwned > pwned.txt"]
    """)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(path)
    assert not (tmp_path / "pwned.txt").exists()


def test_command_line_overrides(tmp_path):
    path = _write(tmp_path, FULL_YAML)
    args = parse_args(["compile", "-f", str(path), "--optimizer.args.lr", "1e-3", "--max_train_steps=4",
                       "--compute_config.use_zero", "true", "--log.0.args.root_dir", "runs",
                       "--model.args.hidden", "32", "--checkpoint.resume_from", "null"])
    assert args.optimizer.args["lr"] == 1e-3 and args.max_train_steps == 4
    assert args.compute_config.use_zero and args.log[0].args["root_dir"] == "runs"
    assert args.model.args["hidden"] == 32 and args.checkpoint.resume_from is None
    assert args.run_mode == "compile"
    with pytest.raises(ConfigError, match="Did you mean 'lr_scheduler'") as info:
        parse_args(["-f", str(path), "--lr_sheduler.interval", "step"])
    assert info.value.key == "lr_sheduler"
    with pytest.raises(ConfigError, match="--log.3.type"):
        parse_args(["-f", str(path), "--log.3.type", "x"])
    with pytest.raises(ConfigError, match="has no value"):
        parse_args(["-f", str(path), "--max_epochs"])


finite = st.floats(allow_nan=False, allow_infinity=False)


@given(st.one_of(st.integers(), finite, st.booleans(), st.none(),
                 st.text(alphabet="abcxyz_/", min_size=1)))
def test_override_values_read_back(value):
    text = "null" if value is None else (str(value).lower() if isinstance(value, bool)
                                         else repr(value) if isinstance(value, float)
                                         else str(value))
    parsed = parse_value(text)
    if isinstance(value, float):
        assert isinstance(parsed, float) and (parsed == value or math.isclose(parsed, value))
    else:
        assert parsed == value
    config = {"a": {"b": 1}}
    apply_overrides(config, [f"--a.c={text}"])
    assert config["a"]["b"] == 1 and config["a"]["c"] == parsed
