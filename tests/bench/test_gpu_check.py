"""bench/gpu/check.sh, the one-GPU check, kept working between GPU lendings: its CPU mode
runs every check's code path here, and its driver fails a run whose check fails."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# bench/gpu/check.py, under a name no other module of the suite can take
_spec = importlib.util.spec_from_file_location("nnscaler_gpu_check",
                                               REPO / "bench" / "gpu" / "check.py")
check = sys.modules["nnscaler_gpu_check"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)  # puts bench/gpu on sys.path for its gpu_* modules
Result = check.Result

NAMES = ["cuda-tests", "parity-gpt-fp32", "parity-gpt-bf16", "parity-llama-fp32",
         "parity-llama-bf16", "quickstart", "autodist-estimate", "measure-peak",
         "compiled-codegen", "ring-flash", "throughput"]
LINE = re.compile(r"^(PASS|FAIL|SKIP) ([\w-]+): (.+)$")


@pytest.mark.slow
def test_cpu_mode_passes_every_check_or_skips_with_a_reason(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "NNSCALER_DEVICE")}
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "figures.json"
    proc = subprocess.run(["bash", "bench/gpu/check.sh", "--device", "cpu", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    lines = [m.groups() for m in map(LINE.match, proc.stdout.splitlines()) if m]
    assert [name for _, name, _ in lines] == NAMES, proc.stdout + proc.stderr[-3000:]
    failed = [(name, text) for status, name, text in lines if status == "FAIL"]
    assert not failed, proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    statuses = dict((name, status) for status, name, _ in lines)
    # nothing here is skipped but the CUDA tests and flash-attention's ring, for want of
    # a GPU
    assert [n for n, s in statuses.items() if s == "SKIP"] == ["cuda-tests", "ring-flash"]
    assert "no CUDA device" in dict((n, t) for _, n, t in lines)["cuda-tests"]
    assert re.search(r"^summary: 9 passed, 0 failed, 2 skipped in [\d.]+ s on cpu$",
                     proc.stdout, re.M), proc.stdout
    figures = json.loads(out.read_text())
    assert [(c["name"], c["status"]) for c in figures["checks"]] == list(statuses.items())
    by_name = {c["name"]: c["figures"] for c in figures["checks"]}
    assert by_name["cuda-tests"]["counts"]["skipped"] >= 1
    for name in NAMES[1:5]:  # on CPU the generated code runs eager's kernels: bitwise
        assert by_name[name]["bitwise_grads"] == by_name[name]["grads"] > 0, by_name[name]
    assert by_name["quickstart"]["checkpoint"] == ["0.ckpt", "meta.json"]
    assert by_name["autodist-estimate"]["profiled_ops"] > 0
    assert by_name["measure-peak"]["known_transient"] == by_name["measure-peak"]["known_bytes"]
    compiled = by_name["compiled-codegen"]
    assert compiled["max_grad_rel_err"] <= compiled["tolerance"] and compiled["grads"] > 0
    assert compiled["compiled_over_eager"] > 0
    rows = by_name["throughput"]["rows"]
    assert [r["mode"] for r in rows] == ["trainer", "eager", "compiled"]
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in rows)
    first = by_name["throughput"]["first_loss"]
    assert first["trainer"] == first["eager"]  # the same weights, batch and kernels
    assert figures["environment"]["device"] == "cpu"


def _fake(status: str):
    def run(ctx):
        if status == "raise":
            raise RuntimeError("planted failure")
        if status == "hang":
            import time

            time.sleep(30)
        return [Result(status, "fake", "figures")]
    return run


@pytest.mark.parametrize(("kind", "expected"), [
    ("PASS", "PASS fake: figures"),
    ("SKIP", "SKIP fake: figures"),
    ("FAIL", "FAIL fake: figures"),
    ("raise", "FAIL fake: RuntimeError: planted failure"),
    ("hang", "FAIL fake: CheckTimeout: ran past its limit of 1 s"),
])
def test_the_exit_status_says_whether_a_check_failed(kind, expected, monkeypatch, capsys,
                                                     tmp_path):
    for var in ("NNSCALER_DEVICE", "NNSCALER_CACHE_DIR", "PYTHONPATH"):
        monkeypatch.setenv(var, os.environ.get(var, ""))
    monkeypatch.setattr(check, "all_checks", lambda: [
        check.Check("fake", _fake(kind), limit_cpu=1, limit_cuda=1)])
    out = tmp_path / "f.json"
    rc = check.main(["--device", "cpu", "--json", str(out)])
    printed = capsys.readouterr().out
    assert expected in printed.splitlines()
    assert rc == (1 if expected.startswith("FAIL") else 0)
    assert json.loads(out.read_text())["checks"][0]["line"] == expected.split(": ", 1)[1]


def test_a_check_that_needs_a_missing_package_is_skipped_with_the_fix(monkeypatch, capsys):
    for var in ("NNSCALER_DEVICE", "NNSCALER_CACHE_DIR", "PYTHONPATH"):
        monkeypatch.setenv(var, os.environ.get(var, ""))
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(check, "missing_packages", lambda: {"pulp": "why"})
    monkeypatch.setattr(check, "all_checks", lambda: [
        check.Check("fake", _fake("PASS"), 1, 1, needs=("pulp",))])
    assert check.main(["--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "missing package pulp: why" in printed
    assert "SKIP fake: needs pulp, not installed (carry its wheel" in printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_refused(capsys):
    assert check.main(["--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_unknown_check_names_are_refused(capsys):
    assert check.main(["--only", "parity,bogus"]) == 2
    assert "['bogus'], which are not checks; the checks are ['cuda-tests'" in \
        capsys.readouterr().err


def test_plugins_of_the_source_tree_get_their_entry_points(tmp_path, monkeypatch):
    """Where the plugins are only on PYTHONPATH (a bare GPU machine), their entry points
    are written so that nnscaler finds them as if they were installed."""
    real = importlib.metadata.distribution

    def not_installed(name):
        if name.startswith("nnscaler-"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    how = check.register_plugins(tmp_path)
    site = tmp_path / "entry-points"
    assert how.startswith("from the source tree (nnscaler-ops-flash-attn, "
                          "nnscaler-policy-autodist, nnscaler-policy-megatron")
    assert sys.path[0] == str(site)
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(site)
    points = {ep.name: ep.value for d in importlib.metadata.distributions(path=[str(site)])
              for ep in d.entry_points if ep.group == "nnscaler"}
    assert points == {"ops_flash_attn": "nnscaler_ops_flash_attn.plugin",
                      "policy_autodist": "nnscaler_policy_autodist.plugin",
                      "megatron": "nnscaler_policy_megatron.plugin"}


def test_a_check_that_the_budget_cannot_fit_does_not_start(monkeypatch, capsys, tmp_path):
    for var in ("NNSCALER_DEVICE", "NNSCALER_CACHE_DIR", "PYTHONPATH"):
        monkeypatch.setenv(var, os.environ.get(var, ""))
    monkeypatch.setattr(check, "all_checks", lambda: [
        check.Check("first", _fake("PASS"), 60, 60), check.Check("second", _fake("PASS"), 60, 60)])
    out = tmp_path / "f.json"
    assert check.main(["--device", "cpu", "--budget", "5", "--json", str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"FAIL first: not run: [\d.]+ s of the run's budget \(--budget\) left",
                    lines[1]), lines
    assert json.loads(out.read_text())["summary"] == {"PASS": 0, "FAIL": 2, "SKIP": 0}
