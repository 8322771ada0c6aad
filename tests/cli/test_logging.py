"""Progress bar, log lines and logger plugins."""

from __future__ import annotations

import logging

import pytest

from nnscaler import hookimpl
from nnscaler.cli.loggers import LoggerBase, LoggerError, TensorBoardLogger
from nnscaler.cli.trainer_args import LogConfig
from nnscaler.errors import UnknownNameError

from .common import MoEMLP, TokenMLP, run_trainer, trainer_args


class Recorder(LoggerBase):
    records: list = []  # noqa: RUF012 - shared with the test
    values: list = []  # noqa: RUF012 - the metrics logged, with their values

    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    def setup(self, config):
        Recorder.records.append(("setup", config["max_train_steps"]))

    def log_metrics(self, metrics, step, *, tag="train"):
        Recorder.records.append((tag, step, sorted(metrics)))
        Recorder.values.append(dict(metrics))

    def finalize(self):
        Recorder.records.append(("finalize",))


class RecorderPlugin:
    @hookimpl
    def nnscaler_register_loggers(self, registry):
        registry.register("recorder", Recorder)


def test_plain_log_lines_every_n_steps(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="nnscaler.cli.trainer"):
        run_trainer(trainer_args(tmp_path, max_train_steps=5, log_every_n_steps=2))
    lines = [r.getMessage() for r in caplog.records if "train_loss=" in r.getMessage()]
    assert [line.split(":")[1].split()[0] for line in lines] == ["002/005", "004/005",
                                                                 "005/005"]
    assert "samples_per_sec=" in lines[0] and "lr=0.01" in lines[0]


def test_progress_bar_shows_loss_lr_and_speed(tmp_path, capfd):
    run_trainer(trainer_args(tmp_path, max_train_steps=4, log_every_n_steps=1,
                             enable_progress_bar=True, model=TokenMLP))
    err = capfd.readouterr().err
    assert "4/4" in err and "loss=" in err and "lr=0.01" in err
    assert "tok/s" in err            # the loss returns token counts: tokens per second


def test_logger_plugin_gets_the_metrics(tmp_path, fresh_plugins, monkeypatch):
    monkeypatch.setattr(fresh_plugins, "_MANAGER",
                        fresh_plugins.NNScalerPluginManager(plugins=[RecorderPlugin()]))
    Recorder.records = []
    run_trainer(trainer_args(tmp_path, max_train_steps=3, log_every_n_steps=1,
                             log=[LogConfig(type="recorder", args={"tag": "x"})]))
    assert Recorder.records[0] == ("setup", 3)
    # the gradient norm every step, clipped or not (as nnScaler's Trainer logs it)
    assert Recorder.records[1] == ("train", 1, ["gnorm", "loss", "lr", "samples_per_sec"])
    assert Recorder.records[-1] == ("finalize",)
    # a class given by import path works without a plugin
    Recorder.records = []
    run_trainer(trainer_args(tmp_path / "b", max_train_steps=1,
                             log=[LogConfig(type="cli.test_logging.Recorder")]))
    assert ("finalize",) in Recorder.records


def test_moe_routing_is_logged_each_step(tmp_path, fresh_plugins, monkeypatch):
    """Tokens per expert and per device, the imbalance and the drops of every MoE layer
    reach the loggers with the train metrics; the console line leaves them out."""
    monkeypatch.setattr(fresh_plugins, "_MANAGER",
                        fresh_plugins.NNScalerPluginManager(plugins=[RecorderPlugin()]))
    Recorder.records = []
    run_trainer(trainer_args(tmp_path, max_train_steps=2, log_every_n_steps=1, model=MoEMLP,
                             log=[LogConfig(type="recorder")]))
    (first, *_) = [r for r in Recorder.records if r[0] == "train"]
    moe = [k for k in first[2] if k.startswith("moe/")]
    assert moe == sorted([f"moe/moe/expert{e}" for e in range(4)]
                         + ["moe/moe/device0", "moe/moe/dropped", "moe/moe/imbalance"])


def _dp_recomputing_every_op(graph, config):
    from nnscaler.policies import dp

    graph = dp(graph, config)
    graph.recompute(list(graph.nodes()))
    return graph


def test_a_recomputed_moe_layer_is_logged_once_per_call(tmp_path, fresh_plugins, monkeypatch):
    """Recomputation replays the experts in backward; the step's counts are those of the
    forward alone."""
    monkeypatch.setattr(fresh_plugins, "_MANAGER",
                        fresh_plugins.NNScalerPluginManager(plugins=[RecorderPlugin()]))
    Recorder.values = []
    run_trainer(trainer_args(tmp_path, max_train_steps=1, log_every_n_steps=1, model=MoEMLP,
                             pas_policy=_dp_recomputing_every_op, instance_name="recomputed",
                             log=[LogConfig(type="recorder")]))
    gencode = next((tmp_path / "gen").rglob("gencode0.py")).read_text()
    assert "torch.utils.checkpoint.checkpoint(" in gencode
    pairs = sum(v for k, v in Recorder.values[0].items() if k.startswith("moe/moe/expert"))
    assert pairs == 8 * 2  # a step of 8 samples (2 micro-batches of 4), top-2


def test_routing_metrics_sum_micro_batches_per_layer():
    from nnscaler.ops.builtin.moe import RoutingRecord, routing_metrics

    records = [RoutingRecord("a", [3, 1], [4]), RoutingRecord("", [0, 2], [2], 1),
               RoutingRecord("a", [1, 3], [4])]
    metrics = routing_metrics(records)
    assert metrics["moe/a/expert0"] == 4.0 and metrics["moe/a/device0"] == 8.0
    assert metrics["moe/moe0/dropped"] == 1.0 and metrics["moe/a/imbalance"] == 1.0


def test_unknown_logger_lists_the_registered_ones(tmp_path):
    with pytest.raises(UnknownNameError, match="tensorboard"):
        run_trainer(trainer_args(tmp_path, max_train_steps=1, log=[LogConfig(type="wandb")]))


def test_tensorboard_missing_is_a_clear_error(monkeypatch):
    from nnscaler.cli import loggers

    def no_tensorboard(name):
        raise ImportError("TensorBoard logging requires TensorBoard")

    monkeypatch.setattr(loggers.importlib, "import_module", no_tensorboard)
    with pytest.raises(LoggerError, match=r"pip install 'nnscaler\[tensorboard\]'"):
        TensorBoardLogger(root_dir="tb")
