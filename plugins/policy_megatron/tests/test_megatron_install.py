"""``pip install ./plugins/policy_megatron`` into a fresh virtual environment that holds
only nnscaler (and torch): ``pas_policy='megatron'`` then works with no other step.

Slow (a venv and two package builds, ~1 min): runs when ``NNSCALER_SLOW_TESTS=1``.
torch is not downloaded again: the fresh venv sees the project's torch (and only its
own dependencies) through a ``.pth`` file pointing at a folder of links.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PLUGIN = ROOT / "plugins" / "policy_megatron"
TORCH_DISTS = ("torch", "filelock", "typing_extensions", "sympy", "mpmath", "networkx",
               "jinja2", "MarkupSafe", "fsspec", "numpy", "setuptools")

SCRIPT = textwrap.dedent("""
    import importlib.metadata, warnings
    from types import SimpleNamespace
    import torch
    import nnscaler
    from nnscaler.graph import IRGraph, run_plan
    from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
    from nnscaler.trace import trace

    assert "nnscaler-policy-megatron" in {d.metadata["Name"] for d in importlib.metadata.distributions()}
    policy = nnscaler.get_plugin_manager().policies.get("megatron")
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, seq_len=8)
    model = GPTWithLoss(config)
    batch = make_batch(config, 2)
    cfg = SimpleNamespace(plan_ngpus=2, runtime_ngpus=2, use_zero=False,
                          pas_config={"tensor_model_parallel_size": 2, "sequence_parallel": True})
    graph = policy(IRGraph.from_graph(trace(model, {"batch": batch})), cfg)
    torch.testing.assert_close(run_plan(graph, model, {"batch": batch}), model(batch))
    print("megatron OK")
""")


def _link_torch(into: Path) -> None:
    """Links to torch and its runtime dependencies (packages and dist-info), found from
    their installed file lists."""
    into.mkdir()
    for name in TORCH_DISTS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or ()
                if not str(f).startswith("..") and "bin" not in Path(str(f)).parts[:1]}
        for top in tops:
            src = Path(dist.locate_file(top))
            if src.exists() and not (into / top).exists():
                (into / top).symlink_to(src)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("NNSCALER_SLOW_TESTS") != "1",
                    reason="slow: set NNSCALER_SLOW_TESTS=1 (a fresh venv and pip installs)")
def test_pip_install_into_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    links = tmp_path / "torch_links"
    _link_torch(links)
    Path(site, "torch_links.pth").write_text(str(links) + "\n")
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, str(ROOT)], check=True, timeout=600)
    before = subprocess.run([py, "-c", "import nnscaler; print(sorted(nnscaler.get_plugin_manager().policies.names()))"],
                            capture_output=True, text=True)
    assert before.returncode == 0 and "'tp'" in before.stdout, before.stderr
    assert "megatron" not in before.stdout
    subprocess.run([*pip, str(PLUGIN)], check=True, timeout=600)
    out = subprocess.run([py, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    assert "megatron OK" in out.stdout
