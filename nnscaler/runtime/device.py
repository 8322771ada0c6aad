"""Device selection and process-group start-up.

The same generated code runs on CUDA with NCCL and on CPU with gloo. The device type is
chosen, in order of precedence, by

1. an explicit ``device`` argument (``"cpu"`` or ``"cuda"``);
2. the environment variable ``NNSCALER_DEVICE`` (``cpu`` or ``cuda``), read at each
   call, not at import;
3. ``"cuda"`` when ``torch.cuda.is_available()``, else ``"cpu"``.

`init_distributed` starts the default process group from the variables that
``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) unless
one is already running, with the backend that fits the device (NCCL for CUDA, gloo for
CPU).

Two things make runs under ``torchrun --max-restarts=N`` reliable:

- each restart attempt forms its group under its own key prefix in torchrun's store
  (``TORCHELASTIC_RESTART_COUNT``): without it a new attempt can read the addresses the
  dead attempt published and fail to connect;
- every collective has a bound, ``collective_timeout`` (default
  `DEFAULT_COLLECTIVE_TIMEOUT`, not torch's 30 minutes), applied to the default
  group and to every group `nnscaler.runtime.groups` creates, so a hung rank ends
  the job in bounded time instead of blocking the others forever.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.errors import DeviceError

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "DEVICE_ENV",
    "DeviceError",
    "backend_for",
    "collective_timeout",
    "current_device",
    "device_type",
    "init",
    "init_distributed",
    "uninit",
    "local_rank",
]

#: The environment variable that overrides the automatic device choice.
DEVICE_ENV = "NNSCALER_DEVICE"

_DEVICE_TYPES = ("cpu", "cuda")
_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: How long a collective may wait for the other ranks before it fails (5 minutes).
DEFAULT_COLLECTIVE_TIMEOUT = timedelta(minutes=5)

# the timeout of the default group this module started; None: torch's own default
_timeout: list[Any] = [None, None]  # [timeout, the default group it belongs to]


def _check_type(value: str, where: str) -> str:
    name = value.strip().lower()
    if name not in _DEVICE_TYPES:
        raise DeviceError(
            f"{where} must be one of {list(_DEVICE_TYPES)}, got {value!r}. Fix: use 'cpu' "
            f"(gloo) or 'cuda' (NCCL), or leave it unset to pick CUDA when available."
        )
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            f"{where} asks for 'cuda', but torch.cuda.is_available() is False on this "
            f"machine. Fix: ask for 'cpu', or run on a machine with a CUDA build of torch "
            f"and a visible GPU."
        )
    return name


def device_type(device: str | None = None) -> str:
    """``"cuda"`` or ``"cpu"``: the explicit ``device`` if given, else ``$NNSCALER_DEVICE``
    if set, else ``"cuda"`` when CUDA is available and ``"cpu"`` otherwise."""
    if device is not None:
        return _check_type(str(device), "the device argument")
    env = os.environ.get(DEVICE_ENV, "").strip()
    if env:
        return _check_type(env, f"${DEVICE_ENV}")
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device: str | None = None) -> str:
    """The ``torch.distributed`` backend for the device type: ``"nccl"`` or ``"gloo"``."""
    return _BACKENDS[device_type(device)]


def local_rank() -> int:
    """This process's rank on its node: ``$LOCAL_RANK`` (set by torchrun), else 0."""
    raw = os.environ.get("LOCAL_RANK", "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise DeviceError(
            f"$LOCAL_RANK must be an int >= 0, got {raw!r}. Fix: launch with torchrun, or "
            f"set LOCAL_RANK to this process's index on its node."
        )
    return value


def current_device(device: str | None = None) -> torch.device:
    """The ``torch.device`` this process computes on: ``cuda:<local_rank>`` or ``cpu``."""
    kind = device_type(device)
    if kind == "cuda":
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def collective_timeout() -> timedelta | None:
    """The timeout of the process group `init_distributed` started (None when it
    did not start one: torch's default applies); new groups take the same bound."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return _timeout[0] if _timeout[1] is dist.group.WORLD else None


def _timedelta(value: timedelta | float | int | None) -> timedelta:
    if value is None:
        return DEFAULT_COLLECTIVE_TIMEOUT
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise DeviceError(f"timeout must be a timedelta or a number of seconds, got {value!r}")
    if seconds <= 0:
        raise DeviceError(f"timeout must be positive, got {seconds} s. Fix: give a bound such "
                          f"as 300 (seconds).")
    return timedelta(seconds=seconds)


def _attempt_store(timeout: timedelta) -> Any:
    """torchrun's TCP store, under a prefix of this restart attempt's own."""
    host = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(host, port, world_size, is_master=not agent_store and rank == 0,
                          timeout=timeout, wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip() or "0"
    return dist.PrefixStore(f"nnscaler/attempt{attempt}/", store)


def init_distributed(
    device: str | None = None, *, timeout: timedelta | float | None = None
) -> torch.device:
    """Start the default process group from torchrun's variables, unless one is running.

    The backend follows the device type (see `device_type`). On CUDA the current
    device is set to ``cuda:<local_rank>``. ``timeout`` (a timedelta or seconds; default
    `DEFAULT_COLLECTIVE_TIMEOUT`) bounds every collective of the default group and
    of the groups nnscaler creates later. Each torchrun restart attempt rendezvouses
    under its own store prefix. Returns the device to compute on. Calling it again, or
    after someone else started the default group, only returns the device.
    """
    dev = current_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return dev
    bound = _timedelta(timeout)
    missing = [name for name in _TORCHRUN_VARS if not os.environ.get(name)]
    if missing:
        raise DeviceError(
            f"init_distributed() needs the variables {list(_TORCHRUN_VARS)} that torchrun "
            f"sets; missing: {missing}. Fix: launch with `torchrun --nproc-per-node N "
            f"script.py`, set them yourself, or call torch.distributed.init_process_group "
            f"before nnscaler."
        )
    store = _attempt_store(bound)
    dist.init_process_group(_BACKENDS[dev.type], store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=bound)
    _timeout[:] = [bound, dist.group.WORLD]
    return dev


def init() -> None:
    """nnScaler's ``nnscaler.init()``: join the job's default process group from torchrun's
    variables (NCCL on CUDA, with the current device set to ``cuda:<local_rank>``; gloo on
    CPU), unless one is running. Optional, as in nnScaler: ``parallelize`` and the Trainer
    start it themselves. `init_distributed` is the same with a device and a timeout."""
    init_distributed()


def uninit() -> None:
    """nnScaler's ``nnscaler.uninit()``: destroy the default process group (and every
    group made in it), when one is running."""
    from nnscaler.runtime.groups import clear_groups

    if dist.is_available() and dist.is_initialized():
        clear_groups()
        dist.destroy_process_group()
