"""init_distributed under torchrun restarts: each attempt rendezvouses under its own store
prefix, and collective_timeout bounds the default group and every group created later."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port

from nnscaler.runtime.device import DeviceError, collective_timeout, init_distributed

# The bound also covers the rendezvous, so it must outlast slow socket set-up: c10d names
# each new socket's peer through a reverse DNS lookup, and where the resolver drops the
# query that costs 5 s per try (seen on CI machines: a 20 s bound ran out).
BOUND = 120


def _attempt(rank: int, world: int, port: int, attempt: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT=str(attempt), NNSCALER_DEVICE="cpu")
    result = None
    try:
        init_distributed(timeout=BOUND)
        seen = []
        real = dist.new_group

        def recording(*args, **kwargs):
            seen.append(kwargs.get("timeout"))
            return real(*args, **kwargs)

        dist.new_group = recording
        from nnscaler.runtime.groups import ensure_groups

        ensure_groups([(0, 1)])
        dist.new_group = real
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        result = (float(t), collective_timeout(), seen)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = repr(e)
    with open(os.path.join(out, f"{attempt}-{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def _agent_store(port: int, ready, stop) -> None:
    """torchrun's agent: hosts the TCP store that outlives the worker attempts."""
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=BOUND))
    ready.set()
    stop.wait(4 * BOUND)
    del store


def test_each_restart_attempt_forms_its_own_group():
    # The store lives in its own process, as under torchrun's agent, and not in this one
    # (whose server thread would be half-copied into every forked worker).
    port = free_port()
    ctx = mp.get_context("fork")
    ready, stop = ctx.Event(), ctx.Event()
    agent = ctx.Process(target=_agent_store, args=(port, ready, stop), daemon=True)
    agent.start()
    procs: list = []
    try:
        assert ready.wait(60), "the agent's store did not start"
        with tempfile.TemporaryDirectory() as out:
            for attempt in (0, 1):
                procs = [ctx.Process(target=_attempt, args=(r, 3, port, attempt, out),
                                     daemon=True) for r in range(3)]
                for p in procs:
                    p.start()
                for p in procs:
                    p.join(BOUND + 60)
                for r in range(3):
                    path = os.path.join(out, f"{attempt}-{r}.pkl")
                    assert os.path.exists(path), f"attempt {attempt} rank {r} hung or died"
                    with open(path, "rb") as f:
                        result = pickle.load(f)
                    assert not isinstance(result, str), result
                    total, bound, seen = result
                    assert total == 6.0 and bound == timedelta(seconds=BOUND)
                    assert seen == [timedelta(seconds=BOUND)]   # the subgroup got it too
    finally:
        # a worker left alive would hang the interpreter's exit (it joins its children)
        stop.set()
        for p in [*procs, agent]:
            p.join(5)
            if p.is_alive():
                p.kill()


def test_timeout_must_be_positive(monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DeviceError, match="timeout must be positive"):
        init_distributed(timeout=0)
