"""Jobs under torchrun: the seed quickstart unchanged, a self-healing run after a rank is
SIGKILLed, and a SIGSTOPped rank that ends the job within collective_timeout."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from nnscaler.cli.trainer_args import CheckpointConfig

from .common import (
    REPO,
    NoisyDataset,
    assert_same_weights,
    merged_weights,
    run_trainer,
    trainer_args,
)

JOB = Path(__file__).with_name("torchrun_job.py")


def _torchrun(args: list[str], cwd: Path, env: dict[str, str] | None = None,
              timeout: float = 240) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--monitor-interval=0.2", *args]
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


# "kernel only" with NNSCALER_SLOW_TESTS=1: the quickstart falling back to 'dp' without the
# plugins is tests/trainer/test_default_policy.py::test_quickstart_runs_without_the_autodist_plugin,
# and the quickstart unchanged under torchrun on 2 ranks is "installed" here
@pytest.mark.slow
@pytest.mark.parametrize("plugins", ["installed", pytest.param("kernel only", marks=pytest.mark.skipif(
    os.environ.get("NNSCALER_SLOW_TESTS") != "1", reason="slow: set NNSCALER_SLOW_TESTS=1"))])
def test_quickstart_unchanged_under_torchrun(tmp_path, plugins):
    # "kernel only": no entry-point plugin loads, as after `pip install nnscaler` alone; the
    # default policy 'autodist' then falls back to 'dp' (plan_ngpus=1, docs/trainer.md)
    env = {"NNSCALER_DISABLE_PLUGIN_AUTOLOAD": "1"} if plugins == "kernel only" else None
    shutil.copy(REPO / "examples" / "quickstart" / "model.py", tmp_path / "model.py")
    proc = _torchrun(["model.py"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Reached max train steps(10): Training is done." in proc.stderr
    folder = tmp_path / "checkpoints" / "0000-0010"
    assert sorted(p.name for p in folder.iterdir()) == ["0.ckpt", "1.ckpt", "meta.json"]
    assert os.readlink(tmp_path / "checkpoints" / "last") == "0000-0010"


def _uninterrupted(rank, world, out):
    out = Path(out)
    return run_trainer(trainer_args(out, world=2, dataset=NoisyDataset, max_train_steps=10,
                                    checkpoint=CheckpointConfig(save_dir=str(out / "ckpt"),
                                                                every_n_train_steps=1)))


@pytest.mark.slow
def test_self_healing_run_after_a_rank_is_killed(tmp_path):
    kill_step = random.Random().randint(2, 9)
    proc = _torchrun(["--max-restarts=1", str(JOB), str(tmp_path / "job")], tmp_path,
                     env={"JOB_KILL_STEP": str(kill_step)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Restart 1 of this job: resuming from the last checkpoint." in proc.stderr
    healed = [torch.load(tmp_path / "job" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert healed[0]["step"] == 10
    reference = run_distributed(_uninterrupted, 2, str(tmp_path / "ref"))
    assert_same_weights(merged_weights(healed), merged_weights(reference))


@pytest.mark.slow
def test_stopped_rank_ends_the_job_within_the_collective_timeout(tmp_path):
    # the bound covers the rendezvous too: more than one reverse DNS lookup that c10d makes
    # for each new socket can cost where the resolver drops it (2 tries of 5 s)
    timeout = 15
    stop_file = tmp_path / "stopped_at"
    proc = _torchrun([str(JOB), str(tmp_path / "job")], tmp_path,
                     env={"JOB_STOP_STEP": "3", "JOB_TIMEOUT": str(timeout),
                          "JOB_STOP_FILE": str(stop_file)}, timeout=120)
    ended = time.time()
    assert proc.returncode != 0
    stopped = float(stop_file.read_text())
    # the other rank waits `timeout` in its collective, fails, wakes the stopped rank so
    # that torchrun's SIGTERM ends it; a few seconds on top for torchrun and teardown
    assert ended - stopped < timeout + 10, (ended - stopped, proc.stderr[-3000:])
    assert "timed out" in proc.stderr or "Timed out" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "job" / "rank0.pt").exists()
