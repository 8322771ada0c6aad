"""The Trainer's default policy without the autodist plugin (``pip install nnscaler``
alone): a one-device plan runs the built-in ``dp``, which is autodist's only choice there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nnscaler import ComputeConfig
from nnscaler.trainer.args import DEFAULT_POLICY, ONE_DEVICE_POLICY, default_policy

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("config, registered, chosen", [
    (ComputeConfig(1, 2, use_end2end=True), {"dp", "tp"}, "dp"),
    (ComputeConfig(1, 2, use_end2end=True), {"dp", "autodist"}, "autodist"),
    (ComputeConfig(2, 2, use_end2end=True), {"dp"}, "autodist"),  # a choice to make
    (ComputeConfig(1, 1, pas_config={"mem_constraint": 4}), {"dp"}, "autodist"),
    (ComputeConfig(1, 2, zero_stage="auto"), {"dp"}, "autodist"),  # the stage to choose
])
def test_default_policy(config, registered, chosen):
    assert DEFAULT_POLICY == "autodist" and ONE_DEVICE_POLICY == "dp"
    assert default_policy(config, registered) == chosen


# The quickstart, unchanged, in a process where the autodist plugin cannot be imported and
# only the built-in plugins load: what `pip install nnscaler` alone gives.
_HIDDEN = """
import runpy, sys
sys.modules["nnscaler_policy_autodist"] = None  # import fails, as if not installed
from nnscaler.trainer.args import TrainerArgs
from nnscaler.plugins import get_plugin_manager
assert "autodist" not in get_plugin_manager().policies
chosen = []
check = TrainerArgs._validate
def spy(self, prefix):
    check(self, prefix)
    chosen.append(self.pas_policy)
TrainerArgs._validate = spy
runpy.run_path("model.py", run_name="__main__")
print("policy:", chosen)
"""


def test_quickstart_runs_without_the_autodist_plugin(tmp_path):
    shutil.copy(REPO / "examples" / "quickstart" / "model.py", tmp_path / "model.py")
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(NNSCALER_DISABLE_PLUGIN_AUTOLOAD="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _HIDDEN], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "policy: ['dp']" in proc.stdout
    assert "'autodist' is not installed" in proc.stderr
    assert "Reached max train steps(10): Training is done." in proc.stderr
