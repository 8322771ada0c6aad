"""nnScaler's Trainer configuration forms, written as its users write them: a YAML file
with ``vars:`` and ``$(vars.x)`` references, ``__type`` / ``__value_type`` markers,
``TrainerArgs.from_cli``, overrides that index, extend or remove entries, and the
quickstart's model trained from such a file."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from nnscaler.cli import trainer_args
from nnscaler.cli.trainer import Trainer
from nnscaler.cli.trainer_args import (
    ComputeConfig,
    ConfigError,
    DebugConfig,
    OptionalComputeConfig,
    ResumeOptions,
    TrainerArgs,
)

# the quickstart's model.py, importable by a dotted path from YAML (tests/examples would
# shadow the repository's examples/ folder as a package)
QUICKSTART = "nnscaler_compat_quickstart"
_spec = importlib.util.spec_from_file_location(
    QUICKSTART, Path(__file__).resolve().parents[2] / "examples" / "quickstart" / "model.py")
sys.modules.setdefault(QUICKSTART, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(sys.modules[QUICKSTART])


class Scaled:
    """An argument built from a ``__type`` mapping."""

    def __init__(self, factor: float) -> None:
        self.factor = factor


class Dataset:
    """A quickstart-like dataset whose arguments come through every marker."""

    def __init__(self, size: int, tag: str, scale: Scaled, fn=None) -> None:
        self.size, self.tag, self.scale, self.fn = size, tag, scale, fn
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(size, 100, generator=g)
        self.y = torch.randint(10, (size,), generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i] * self.scale.factor, "y": self.y[i]}


YAML = """\
vars:
  dim: 100
  steps: 3
  lr: 0.01
  run: quick
compute_config:
  plan_ngpus: 1
  runtime_ngpus: 1
  use_end2end: true
pas_policy: dp
gen_savedir: $(tmp)/gen
instance_name: $(vars.run)-$(vars.dim)
model:
  type: nnscaler_compat_quickstart.Model
optimizer:
  type: torch.optim.AdamW
  args:
    lr: $(vars.lr)
dataset:
  type: $(mod).Dataset
  train_args:
    size: 16
    tag:
      __value_type: str
      value: 1
    scale:
      __type: $(mod).Scaled
      factor: 1.0
    fn:
      __value_type: function
      value: torch.relu
micro_batch_size: 4
max_train_steps: $(vars.steps)
enable_progress_bar: false
seed: 0
checkpoint:
  save_dir: $(tmp)/ckpt
  no_save: true
log:
  - type: tensorboard
    args:
      root_dir: $(tmp)/tb
"""


def _write(tmp_path: Path, text: str = YAML) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(text.replace("$(tmp)", str(tmp_path)).replace("$(mod)", __name__))
    return path


def test_vars_references_and_markers(tmp_path):
    args = TrainerArgs.from_cli(["-f", str(_write(tmp_path))])
    assert args.vars["dim"] == 100
    assert args.optimizer.args["lr"] == 0.01  # a whole reference keeps the type
    assert args.max_train_steps == 3
    assert args.instance_name == "quick-100"  # references inside a string are formatted
    ds = args.create_dataset()
    assert ds.tag == "1" and isinstance(ds.scale, Scaled) and ds.fn is torch.relu
    assert args.create_dataset("val") is None  # no val_args: no dataset, as in nnScaler


def test_yaml_trains_the_quickstart_model(tmp_path):
    # no tensorboard here: the logger entry is removed on the command line
    trainer = Trainer(["-f", str(_write(tmp_path)), "--log!"])
    trainer.run()
    assert trainer.global_step == 3
    assert trainer.total_train_steps_per_epoch == 16 // 4


def test_overrides_index_extend_and_remove(tmp_path):
    path = str(_write(tmp_path))
    args = TrainerArgs.from_cli(["-f", path, "--vars.steps", "2", "--log.0.args.root_dir",
                                 str(tmp_path / "other"), "--checkpoint.no-save", "true",
                                 "--seed!"])
    assert args.max_train_steps == 2  # references see the overridden vars
    assert args.log[0].args["root_dir"] == str(tmp_path / "other")
    assert args.seed is None
    args = TrainerArgs.from_cli(["-f", path, "--log.1.type", "tensorboard",
                                 "--log.1.args.root_dir", str(tmp_path / "tb2")])
    assert [entry.type for entry in args.log] == ["tensorboard", "tensorboard"]
    assert TrainerArgs.from_yaml(path).max_train_steps == 3


def test_environment_variables_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("NNS_COMPAT_LR", "0.5")
    text = YAML.replace("lr: $(vars.lr)", "lr: $(NNS_COMPAT_LR)")
    assert TrainerArgs.from_cli(["-f", str(_write(tmp_path, text))]).optimizer.args["lr"] == 0.5
    with pytest.raises(ConfigError, match=r"\$\(vars.nope\) names no entry"):
        TrainerArgs.from_cli(["-f", str(_write(tmp_path, YAML.replace("vars.lr", "vars.nope")))])
    loop = YAML.replace("  run: quick", "  run: $(vars.again)\n  again: $(vars.run)")
    with pytest.raises(ConfigError, match="refers back to itself"):
        TrainerArgs.from_cli(["-f", str(_write(tmp_path, loop))])
    escaped = YAML.replace("instance_name: $(vars.run)-$(vars.dim)", r"instance_name: a\$(b)")
    assert TrainerArgs.from_cli(["-f", str(_write(tmp_path, escaped))]).instance_name == "a$(b)"


def test_resolved_references_to_vars_objects(tmp_path):
    text = YAML.replace("  run: quick", "  run: quick\n  scale:\n    __type: "
                        "$(mod).Scaled\n    factor: 2.0")
    text = text.replace("    scale:\n      __type: $(mod).Scaled\n"
                        "      factor: 1.0", "    scale: $!(vars.scale)")
    args = TrainerArgs.from_cli(["-f", str(_write(tmp_path, text))])
    ds = args.create_dataset()
    assert ds.scale is args.resolved_vars["scale"] and ds.scale.factor == 2.0
    assert args.create_kwarg("$!(self)") is args


def test_load_type_path_and_world_size(tmp_path, monkeypatch):
    assert trainer_args.load_type("torch.optim.AdamW") is torch.optim.AdamW
    text = YAML.replace("  runtime_ngpus: 1\n", "").replace("gen_savedir: $(tmp)/gen",
                                                            "gen_savedir: gen")
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = TrainerArgs.from_cli(["-f", str(_write(tmp_path, text))])
    assert args.compute_config.runtime_ngpus == 1
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        TrainerArgs.from_cli(["-f", str(_write(tmp_path, text))])
    fields = dict(compute_config=ComputeConfig(1, 1, use_end2end=True),
                  model={"type": f"{QUICKSTART}.Model"},
                  optimizer={"type": "torch.optim.AdamW"},
                  dataset={"type": f"{QUICKSTART}.RandomDataset"},
                  gen_savedir=tmp_path / "gen", precision="none",
                  debug={"check_gradient_sync_cross_devices": False},
                  checkpoint={"resume_from": {"checkpoint": "last", "with_merged": True}})
    args = TrainerArgs(**fields)
    assert args.gen_savedir == str(tmp_path / "gen")
    assert isinstance(args.debug, DebugConfig)
    assert args.checkpoint.resume_options == ResumeOptions(checkpoint="last", with_merged=True)
    assert dataclasses.replace(args.compute_config, use_zero=True).use_zero


def test_optional_compute_config():
    base = ComputeConfig(1, 2, use_end2end=True)
    cfg = OptionalComputeConfig(use_zero=True, reducer_bucket_cap_mb=0).resolve(base)
    assert cfg == ComputeConfig(1, 2, use_zero=True)  # not end2end; 0 is the default bucket
    with pytest.raises(ConfigError, match="zero_ngroups"):
        OptionalComputeConfig(zero_ngroups=2).resolve(base)


def test_refused_nnscaler_forms(tmp_path):
    text = YAML.replace("micro_batch_size: 4", "micro_batch_size: 4\nprecision:\n  param: bf16")
    with pytest.raises(ConfigError, match="per-tensor form"):
        TrainerArgs.from_cli(["-f", str(_write(tmp_path, text))])
    for key, fix in (("dummy_sample_gen_fn: x.y", "first micro-batch"),
                     ("log_progress_every_n_train_steps: 5", "log_every_n_steps")):
        with pytest.raises(ConfigError, match=fix):
            TrainerArgs.from_cli(["-f", str(_write(tmp_path, YAML + key + "\n"))])
    with pytest.raises(ConfigError, match="init_module: cannot import"):
        TrainerArgs.from_cli(["-f", str(_write(tmp_path, YAML + "init_module: no.such\n"))])
    loaded = TrainerArgs.from_cli(["-f", str(_write(tmp_path, YAML + f"init_module: {__name__}\n"))])
    assert loaded.init_module == __name__
