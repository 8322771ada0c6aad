"""The Trainer lives in ``nnscaler.trainer``, in parts; nnScaler's import paths
(``nnscaler.cli.trainer``, ``nnscaler.cli.trainer_args``) give the very same classes, and
only the command imports the command: the Trainer reads ``argv`` without it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import nnscaler.cli.trainer as cli_trainer
import nnscaler.cli.trainer_args as cli_args
from nnscaler.trainer import args, errors, hooks, trainer

# the names ``from nnscaler.cli.trainer_args import *`` gave before the move
STAR_NAMES = [
    "AggregatedOutputs", "CheckpointConfig", "ComputeConfig", "ConfigError",
    "DataloaderConfig", "DatasetConfig", "DatasetSamplerConfig", "HookConfig",
    "HookMapConfig", "LRSchedulerConfig", "LogConfig", "ModelConfig", "OptimizerConfig",
    "TrainerArgs", "resolve_object",
    # nnScaler 0.8's (docs/migrating.md)
    "DebugConfig", "ModuleParallelizeConfig", "OptionalComputeConfig", "ResumeOptions",
    "load_type",
]


def test_the_known_import_paths_give_the_same_classes():
    assert cli_trainer.Trainer is trainer.Trainer
    assert cli_trainer.TrainHook is hooks.TrainHook
    assert cli_trainer.TrainerError is errors.TrainerError
    assert sorted(cli_args.__all__) == sorted(STAR_NAMES)
    for name in STAR_NAMES:
        home = errors if name == "ConfigError" else args
        assert getattr(cli_args, name) is getattr(home, name), name
    namespace: dict[str, object] = {}
    exec("from nnscaler.cli.trainer_args import *", namespace)
    assert set(STAR_NAMES) <= set(namespace)


def test_the_trainer_reads_argv_without_the_command(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent("""\
        compute_config: {plan_ngpus: 1, runtime_ngpus: 1, use_end2end: true}
        model: {type: torch.nn.Linear, args: {in_features: 2, out_features: 1}}
        optimizer: {type: torch.optim.SGD, args: {lr: 0.1}}
        dataset: {type: torch.utils.data.TensorDataset}
        pas_policy: dp
    """))
    code = textwrap.dedent(f"""\
        import sys
        from nnscaler.cli.trainer import Trainer
        t = Trainer(["compile", "-f", {str(config)!r}, "--optimizer.args.lr", "0.5"])
        assert t.args.run_mode == "compile" and t.args.optimizer.args == {{"lr": 0.5}}
        assert "nnscaler.cli.train" not in sys.modules, "the Trainer imported the command"
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_parts_work_on_the_trainers_state():
    t = trainer.Trainer(train_args=args.TrainerArgs(
        compute_config=args.ComputeConfig(plan_ngpus=1, runtime_ngpus=1, use_end2end=True),
        model=args.ModelConfig(type="torch.nn.Linear"),
        optimizer=args.OptimizerConfig(type="torch.optim.SGD"),
        dataset=args.DatasetConfig(type="torch.utils.data.TensorDataset"),
        pas_policy="dp"))
    for part in (t.builder, t.loop, t.progress, t.checkpointer):
        assert part.trainer is t
    assert t.precision.args is t.args and t.precision.module_dtype is None
    t.global_step, t.epoch = 7, 2
    assert t.checkpointer.status()["step"] == 7 and t.checkpointer.status()["epoch"] == 2
