"""Generated files are safe to share: one process at a time per instance directory (a file
lock held from the reuse decision to the end of loading), a sha256 of every file in
config.json (a changed file is never reused or run), and what killed processes left
behind is removed by the next run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch import nn

from nnscaler import ComputeConfig, gendir, parallelize
from nnscaler.parallel import files, locks, paths, staging

pytestmark = pytest.mark.filterwarnings("ignore::nnscaler.trace.OpaqueOpWarning")

ONE = ComputeConfig(plan_ngpus=1, runtime_ngpus=1)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu()


def _make(tmp_path, **kwargs):
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(2, 4)
    pm = parallelize(model, {"x": x}, "dp", ONE, gen_savedir=tmp_path, **kwargs)
    return model, pm, x


# -- hashes ------------------------------------------------------------------------------
def test_config_records_the_sha256_of_every_file(tmp_path):
    _make(tmp_path, load_module=False)
    out = paths.outdir_for(tmp_path, Tiny, None)
    saved = gendir.read_config(out)
    assert sorted(saved["sha256"]) == saved["files"] == sorted(
        p.name for p in out.iterdir() if p.name != gendir.CONFIG_FILE)
    for name, digest in saved["sha256"].items():
        assert gendir.file_digest(out / name) == digest
    assert gendir.changed_files(out, saved) == []


def test_code_appended_to_a_generated_file_never_runs(tmp_path):
    """The issue's case: code appended to gencode0.py ran on the next reuse='match'."""
    model, pm, x = _make(tmp_path)
    out = paths.outdir_for(tmp_path, Tiny, None)
    marker = tmp_path / "ran"
    with open(out / "gencode0.py", "a") as f:
        f.write(f"\nopen({str(marker)!r}, 'w').write('x')\n")
    with pytest.raises(files.GenFilesChangedError,
                       match=r"gencode0\.py differ\(s\) from what nnscaler generated .* "
                             r"reuse='override' .*accept_edited_files"):
        _make(tmp_path)
    assert not marker.exists()
    # 'moo' regenerates it (with a warning), and the new file is clean
    with pytest.warns(UserWarning, match="regenerating"):
        _, pm, x = _make(tmp_path, reuse="moo")
    assert not marker.exists()
    assert "open(" not in (out / "gencode0.py").read_text()
    torch.testing.assert_close(pm(x), model(x))


def test_an_edit_accepted_on_purpose_is_reused(tmp_path):
    _make(tmp_path, load_module=False)
    out = paths.outdir_for(tmp_path, Tiny, None)
    with open(out / "gencode0.py", "a") as f:
        f.write("\n# reviewed by hand\n")
    assert files.accept_edited_files(out) == ["gencode0.py"]
    model, pm, x = _make(tmp_path)
    torch.testing.assert_close(pm(x), model(x))


def test_each_rank_checks_its_file_before_running_it(tmp_path):
    """_load compares the file with the digest rank 0 sends (the file could change after
    the reuse decision, or be another node's copy)."""
    from nnscaler.parallel.api import _load

    _make(tmp_path, load_module=False)
    out = paths.outdir_for(tmp_path, Tiny, None)
    digests = {"gencode0.py": "0" * 64}
    with pytest.raises(files.GenFilesChangedError, match=r"rank\(s\) \[0\] will not run"):
        _load(out, 0, False, True, digests)


def test_graph_reuse_refuses_a_changed_graph_file(tmp_path):
    _make(tmp_path, load_module=False)
    out = paths.outdir_for(tmp_path, Tiny, None)
    with open(out / gendir.GRAPH_FILE, "ab") as f:
        f.write(b"junk")
    with pytest.warns(UserWarning, match=r"graph\.pkl differ.*tracing again"):
        _make(tmp_path, reuse="graph", load_module=False)
    assert gendir.changed_files(out, gendir.read_config(out)) == []


# -- stale leftovers ---------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_killed_processes_are_removed_by_the_next_run(tmp_path):
    _make(tmp_path, load_module=False)
    out = paths.outdir_for(tmp_path, Tiny, None)
    dead = _dead_pid()
    stale = [out.with_name(f".{out.name}.tmp-{dead}-0123abcd"),
             out.with_name(f".{out.name}.old-{dead}-4567abcd")]
    live = out.with_name(f".{out.name}.tmp-{os.getppid()}-89abcdef")  # a live process's
    for d in (*stale, live):
        d.mkdir()
        (d / "gencode0.py").write_text("partial")
    (out / ".gencode0.py.tmp").write_text("partial")
    _make(tmp_path, reuse="override", load_module=False)
    assert staging.leftover_dirs(out) == [live]
    assert not (out / ".gencode0.py.tmp").exists()


# -- the lock ----------------------------------------------------------------------------
def test_a_held_lock_makes_parallelize_wait_and_say_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(locks, "LOCK_NOTICE_S", 0.1)
    monkeypatch.setattr(locks, "LOCK_TIMEOUT_S", 0.5)
    out = paths.outdir_for(tmp_path, Tiny, None)
    with locks.instance_lock(out):  # another job, as far as the lock can tell
        with pytest.raises(locks.GenFilesLockedError,
                           match=rf"locked by process {os.getpid()} on host .* waited 0 s .* "
                                 rf"instance_name="):
            _make(tmp_path)
    assert "waiting for the lock" in caplog.text and "another job" in caplog.text
    # released a moment later: the waiter goes on
    monkeypatch.setattr(locks, "LOCK_TIMEOUT_S", 60.0)
    held = threading.Event()

    def hold_briefly() -> None:
        with locks.instance_lock(out):
            held.set()
            time.sleep(0.5)

    holder = threading.Thread(target=hold_briefly)
    holder.start()
    held.wait(10)
    model, pm, x = _make(tmp_path)
    holder.join()
    torch.testing.assert_close(pm(x), model(x))


JOB = """
import json, sys, time, warnings
import torch
from torch import nn
from nnscaler import ComputeConfig, parallelize
from nnscaler.plugins import get_plugin_manager

warnings.simplefilter("ignore")
calls = []

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu()

def slow_dp(graph, config):
    start = time.time()
    time.sleep(0.5)  # long enough for the other job to try the directory meanwhile
    graph = get_plugin_manager().policies.get("dp")(graph, config)
    calls.append(start)
    return graph

gen_savedir, go = sys.argv[1], sys.argv[2]
while not __import__("os").path.exists(go):
    time.sleep(0.01)
out = []
for reuse in ("override", "match"):
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 4)
    before = len(calls)
    pm = parallelize(model, {"x": x}, slow_dp, ComputeConfig(plan_ngpus=1, runtime_ngpus=1),
                     gen_savedir=gen_savedir, reuse=reuse)
    done = time.time()
    out.append({"reuse": reuse, "start": calls[before] if len(calls) > before else None,
                "loaded": done, "same": bool(torch.allclose(pm(x), model(x)))})
print(json.dumps(out))
"""


def test_two_jobs_sharing_gen_savedir_take_turns(tmp_path):
    """Two processes parallelize the same module into one gen_savedir at the same time,
    regenerating ('override') then reusing ('match'): both succeed, each one's
    generate-and-load interval excludes the other's, the files are consistent."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    go = tmp_path / "go"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "gen"), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    time.sleep(0.5)
    go.write_text("")
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    generated = sorted((r[0]["start"], r[0]["loaded"]) for r in results)
    assert all(start is not None for start, _ in generated)  # override: both generate
    (s0, e0), (s1, e1) = generated
    assert e0 <= s1, f"the two generations overlapped: {generated}"
    for r in results:
        assert r[1]["start"] is None  # match: reused, not generated again
        assert r[0]["same"] and r[1]["same"]
    out = next((tmp_path / "gen").rglob(gendir.CONFIG_FILE)).parent
    assert gendir.changed_files(out, gendir.read_config(out)) == []
    assert staging.leftover_dirs(out) == []
