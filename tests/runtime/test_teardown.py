"""A clean exit: after a training script returns, nnscaler's exit hook leaves no gloo thread
running into interpreter finalization (what aborted about one run in 10 to 25 with
"terminate called without an active exception"). The 50-run check is
bench/runtime/exit_loop.py; here one fresh 2-process job shows the mechanism."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import types

from nnscaler.runtime import teardown

JOB = """
import atexit, json

def report(when):
    from nnscaler.runtime.teardown import live_gloo_threads
    print(f"THREADS {when} " + json.dumps(live_gloo_threads()), flush=True)

atexit.register(report, "after")  # registered before nnscaler's hook: runs after it
import torch
from nnscaler.runtime import Reducer, init_distributed

atexit.register(report, "before")  # registered after it: runs before it
init_distributed("cpu")
# the first optimizer imports torch._dynamo, which imports fsdp's ShardedGradScaler, whose
# default argument then holds the world group for good
params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
optimizer = torch.optim.Adam(params, lr=0.1)
reducer = Reducer(params, [0, 1], async_op=True, bucket_cap_mb=1e-5)
(params[0].sum() + params[1].sum()).backward()  # reductions launched, never synced
torch.distributed.destroy_process_group()  # what a careful script does; not enough
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_exit_hook_leaves_no_gloo_thread(tmp_path):
    """A 2-process job that builds an optimizer and leaves async reductions in flight,
    then returns: before nnscaler's exit hook its gloo threads still run (even after
    destroy_process_group), after it none does, and the processes exit 0."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        seen = dict(ln.split(" ", 2)[1:] for ln in stdout.splitlines()
                    if ln.startswith("THREADS "))
        assert p.returncode == 0, stderr[-2000:]
        assert "pt_gloo_runloop" in json.loads(seen["before"])
        assert json.loads(seen["after"]) == []


def test_process_groups_held_as_default_arguments_are_released(monkeypatch):
    class Group:
        pass

    group = Group()
    module = types.ModuleType("torch.distributed._nnscaler_teardown_probe")

    def collect(process_group=group, *, other=group, keep=3):
        return process_group, other, keep

    class Scaler:
        def __init__(self, process_group=group):
            self.process_group = process_group

    collect.__module__ = Scaler.__module__ = module.__name__
    module.collect, module.Scaler = collect, Scaler
    monkeypatch.setitem(sys.modules, module.__name__, module)
    changed = teardown._release_stale_defaults(Group)
    assert sorted(changed) == sorted([f"{module.__name__}.collect"] * 2
                                     + [f"{module.__name__}.Scaler.__init__"])
    assert collect() == (None, None, 3)
    assert Scaler().process_group is None
