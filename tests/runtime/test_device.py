"""Device selection: explicit argument, $NNSCALER_DEVICE read at call time, CPU fallback;
init_distributed from torchrun's variables."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from dist_utils import free_port, run_distributed

from nnscaler.runtime import (
    DEVICE_ENV,
    DeviceError,
    backend_for,
    current_device,
    device_type,
    init_distributed,
    local_rank,
)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(DEVICE_ENV, raising=False)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(DEVICE_ENV, raising=False)


def test_cpu_fallback_without_cuda(no_cuda):
    assert device_type() == "cpu"
    assert backend_for() == "gloo"
    assert current_device() == torch.device("cpu")


def test_cuda_chosen_when_available(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device_type() == "cuda"
    assert backend_for() == "nccl"
    assert current_device() == torch.device("cuda", 3)


def test_env_override_is_read_at_call_time(fake_cuda, monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert device_type() == "cpu"
    monkeypatch.setenv(DEVICE_ENV, " CUDA ")
    assert device_type() == "cuda"


def test_explicit_argument_beats_env(fake_cuda, monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert device_type("cpu") == "cpu"
    assert backend_for("cpu") == "gloo"


def test_cuda_without_cuda_is_an_error(no_cuda, monkeypatch):
    with pytest.raises(DeviceError, match="asks for 'cuda', but torch.cuda.is_available"):
        device_type("cuda")
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(DeviceError, match=r"\$NNSCALER_DEVICE asks for 'cuda'"):
        device_type()


def test_bad_values_are_errors(no_cuda, monkeypatch):
    with pytest.raises(DeviceError, match=r"must be one of \['cpu', 'cuda'\], got 'tpu'"):
        device_type("tpu")
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(DeviceError, match="got 'gpu'"):
        device_type()
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(DeviceError, match=r"\$LOCAL_RANK must be an int >= 0, got 'x'"):
        local_rank()


def test_local_rank_default(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert local_rank() == 0


def test_init_distributed_needs_torchrun_vars(no_cuda, monkeypatch):
    if torch.distributed.is_initialized():
        pytest.skip("a default process group is running in this process")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DeviceError, match=r"missing: \['RANK', 'WORLD_SIZE', 'MASTER_ADDR'"):
        init_distributed()


def test_init_distributed_picks_nccl_on_cuda(fake_cuda, monkeypatch):
    """CUDA mocked (docs/internals/cuda-nccl-audit.md): the device is cuda:LOCAL_RANK, set
    before the group starts, and the group is NCCL's, bounded by the timeout."""
    import torch.distributed as dist

    from nnscaler.runtime import device

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(calls) and calls[-1][0] == "init")
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", str(d))))
    monkeypatch.setattr(device, "_attempt_store", lambda timeout: "store")
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(
        ("init", backend, kw["rank"], kw["world_size"], kw["timeout"].total_seconds())))
    monkeypatch.setattr(dist, "group", type("G", (), {"WORLD": object()}))
    monkeypatch.setenv("LOCAL_RANK", "3")
    for name, value in (("RANK", "7"), ("WORLD_SIZE", "8"), ("MASTER_ADDR", "h"),
                        ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(device, "_timeout", [None, None])
    assert init_distributed(timeout=60) == torch.device("cuda", 3)
    assert calls == [("set_device", "cuda:3"), ("init", "nccl", 7, 8, 60.0)]


def _child(port: int, queue: mp.Queue) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ[DEVICE_ENV] = "cpu"
    try:
        dev = init_distributed()
        queue.put((str(dev), dist.get_backend(), dist.get_world_size(), str(init_distributed())))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report to the parent
        queue.put(repr(e))


def test_init_distributed_starts_gloo_from_env():
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(free_port(), queue))
    proc.start()
    result = queue.get(timeout=60)
    proc.join(60)
    assert result == ("cpu", "gloo", 1, "cpu")


def _already(rank: int, world_size: int) -> str:
    return str(init_distributed("cpu"))


def test_init_distributed_keeps_a_running_group():
    assert run_distributed(_already, 2) == ["cpu", "cpu"]
