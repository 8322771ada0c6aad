"""`nnscaler-train`: compile without a process group, then run on 2 processes reusing the
generated code (ReuseType.MATCH); configuration errors exit with the key named."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch.distributed as dist
from dist_utils import run_distributed

from nnscaler.cli.train import main

CONFIG = """
compute_config: {plan_ngpus: 1, runtime_ngpus: 2, use_end2end: true}
pas_policy: dp
micro_batch_size: 4
global_batch_size: 8
max_train_steps: 3
enable_progress_bar: false
seed: 0
model: {type: cli.common.MLP}
optimizer: {type: torch.optim.AdamW, args: {lr: 1e-2}}
dataset: {type: cli.common.FixedDataset, train_args: {size: 32}}
"""


def _write(tmp: Path) -> Path:
    path = tmp / "config.yaml"
    path.write_text(textwrap.dedent(CONFIG) + f"gen_savedir: {tmp / 'gen'}\n"
                    f"checkpoint: {{save_dir: {tmp / 'ckpt'}}}\n")
    return path


def _run(rank, world, config):
    return main(["-f", config, "--optimizer.args.lr", "1e-3"])


def test_compile_then_run(tmp_path):
    config = _write(tmp_path)
    assert main(["compile", "-f", str(config)]) == 0
    assert not dist.is_initialized()
    outdir = next((tmp_path / "gen").rglob("config.json")).parent
    assert {p.name for p in outdir.glob("gencode*.py")} == {"gencode0.py", "gencode1.py"}
    stamps = {p.name: p.stat().st_mtime_ns for p in outdir.iterdir()}
    assert run_distributed(_run, 2, str(config)) == [0, 0]
    # run (reuse 'match') used the compiled files as they were
    assert {p.name: p.stat().st_mtime_ns for p in outdir.iterdir()} == stamps
    assert (tmp_path / "ckpt" / "0000-0003" / "1.ckpt").is_file()


def test_configuration_errors_exit_2_naming_the_key(tmp_path, capsys):
    config = _write(tmp_path)
    assert main(["-f", str(config), "--optimizer.args.lr", "1e-3", "--max_train_stesp", "3"]) == 2
    err = capsys.readouterr().err
    assert "max_train_stesp is not a field of TrainerArgs" in err
    assert "Did you mean 'max_train_steps'" in err
