"""The package installs alone: a fresh virtual environment with ``pip install .`` runs the
main job's code (a 2-process compile and 2 training steps), and the metadata says what
the README promises (license, version, typed, dependencies).

Installing torch into a fresh environment unpacks about 750 MB (over a minute here), so
the fresh environment gets torch, and only torch and what torch itself requires, from
this environment's copy: a ``.pth`` file points at a folder of links to those
distributions. Everything nnscaler needs beyond torch (numpy, pluggy, attrs) must come
from its own declared dependencies, which is what this test checks.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

import nnscaler

REPO = Path(__file__).resolve().parents[1]

MAIN_JOB = """
import os
import torch
import torch.distributed as dist
import nnscaler
from nnscaler import ComputeConfig, build_optimizer, parallelize
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.runtime import init_distributed

device = init_distributed()
torch.manual_seed(0)
config = GPTConfig(vocab_size=64, n_layer=1, n_head=2, d_model=16, seq_len=8)
model = parallelize(GPTWithLoss(config), {"batch": make_batch(config, 2, seed=0)}, "tp",
                    ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_end2end=True),
                    gen_savedir=os.environ["GEN_DIR"])
optimizer = build_optimizer(model, torch.optim.Adam, lr=1e-2)
for step in range(2):
    (loss,) = model.train_step([make_batch(config, 2, seed=step)])
    optimizer.step()
if dist.get_rank() == 0:
    print(f"nnscaler from {nnscaler.__file__}: 2 steps, loss {float(loss):.4f}")
dist.destroy_process_group()
"""


def _closure(name: str) -> list[metadata.Distribution]:
    """``name``'s distribution and every one it requires (not extras), transitively."""
    env = default_environment()
    seen: dict[str, metadata.Distribution] = {}
    todo = [name]
    while todo:
        req = Requirement(todo.pop())
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in seen or (req.marker is not None and not req.marker.evaluate({**env, "extra": ""})):
            continue
        dist = metadata.distribution(req.name)
        seen[key] = dist
        todo += dist.requires or []
    return list(seen.values())


def _link_torch(into: Path) -> None:
    """Links to torch and its requirements, as installed here, in the folder ``into``."""
    into.mkdir()
    for dist in _closure("torch"):
        for top in {Path(str(f)).parts[0] for f in dist.files or ()}:
            source = Path(str(dist.locate_file(top)))
            if top not in ("..", "bin") and source.exists() and not (into / top).exists():
                (into / top).symlink_to(source)


@pytest.mark.slow
def test_a_fresh_environment_with_pip_install_runs_the_main_job(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path"
                              "('purelib'))"], capture_output=True, text=True, check=True)
    site = Path(purelib.stdout.strip())
    _link_torch(tmp_path / "torch-site")
    (site / "torch_from_cache.pth").write_text(str(tmp_path / "torch-site") + "\n")

    # `pip install .`, run by this environment's pip into the fresh one
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--disable-pip-version-check", str(REPO)], check=True, timeout=300)
    (tmp_path / "job.py").write_text(textwrap.dedent(MAIN_JOB))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(OMP_NUM_THREADS="1", NNSCALER_DEVICE="cpu", GEN_DIR=str(tmp_path / "gen"),
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    done = subprocess.run([str(python), "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "job.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"nnscaler from {site}" in done.stdout  # the installed copy, not the source tree
    assert "2 steps, loss" in done.stdout

    listed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "list",
                             "--format=freeze", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout
    names = {line.split("==")[0].lower() for line in listed.split()}
    assert {"nnscaler", "numpy", "pluggy", "attrs", "filelock", "pyyaml", "tqdm"} <= names
    assert "pytest" not in names and "pulp" not in names


def test_the_kernel_declares_what_it_imports_and_nothing_else():
    requires = [Requirement(r) for r in metadata.requires("nnscaler") or ()]
    # the Trainer (nnscaler.cli) reads YAML configs and shows a tqdm progress bar;
    # gen_savedir and checkpoint temporary files are locked with filelock
    assert {r.name for r in requires if r.marker is None} == {
        "torch", "numpy", "pluggy", "attrs", "filelock", "pyyaml", "tqdm"}
    assert {"test", "docs"} <= set(metadata.metadata("nnscaler").get_all("Provides-Extra"))


def test_version_license_and_typing_ship_with_the_package(capsys):
    from nnscaler.__main__ import main

    assert nnscaler.__version__ == metadata.version("nnscaler")
    assert (Path(nnscaler.__file__).parent / "py.typed").is_file()
    assert "MIT License" in (REPO / "LICENSE").read_text()
    assert f"## {nnscaler.__version__}" in (REPO / "CHANGELOG.md").read_text()
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"nnscaler {nnscaler.__version__}"


def test_setup_script_installs_again_only_when_a_pyproject_changes(tmp_path):
    """A venv whose stamp matches is left alone (no pip run: instant); a changed
    pyproject.toml, or extras not installed yet, make it install."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"  # records each call instead of installing
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\n")
    fake.chmod(0o755)
    script = REPO / "scripts" / "setup_venv.sh"
    env = {**os.environ, "VENV": str(venv)}

    def run(*extras: str) -> list[str]:
        log = tmp_path / "calls"
        log.unlink(missing_ok=True)
        subprocess.run(["bash", str(script), *extras], env=env, check=True, cwd=REPO)
        return log.read_text().splitlines() if log.exists() else []

    first = run("test,docs")
    assert any("install" in c and "-e .[docs,test]" in c for c in first), first
    assert run("test,docs") == []  # warm: nothing runs
    assert run() == []  # the main job's set is part of it
    assert run("test") == []
    stamp = next((venv / ".nnscaler-installed").iterdir())
    stamp.write_text("an older hash\n")  # as if a pyproject.toml had changed
    again = run()
    assert any("install" in c and "-e . " in c + " " for c in again), again
    assert run("test,docs") != []  # the stale test stamp was dropped: installs the extras
