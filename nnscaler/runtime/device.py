"""Device selection and process-group start-up.

The same generated code runs on CUDA with NCCL and on CPU with gloo. The device type is
chosen, in order of precedence, by

1. an explicit ``device`` argument (``"cpu"`` or ``"cuda"``);
2. the environment variable ``NNSCALER_DEVICE`` (``cpu`` or ``cuda``), read at each
   call, not at import;
3. ``"cuda"`` when ``torch.cuda.is_available()``, else ``"cpu"``.

:func:`init_distributed` starts the default process group from the variables that
``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) unless
one is already running, with the backend that fits the device (NCCL for CUDA, gloo for
CPU).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from nnscaler.errors import NNScalerError

__all__ = [
    "DEVICE_ENV",
    "DeviceError",
    "backend_for",
    "current_device",
    "device_type",
    "init_distributed",
    "local_rank",
]

#: The environment variable that overrides the automatic device choice.
DEVICE_ENV = "NNSCALER_DEVICE"

_DEVICE_TYPES = ("cpu", "cuda")
_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DeviceError(NNScalerError, RuntimeError):
    """A device choice or a process-group start-up that cannot work."""


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


def init_distributed(
    device: str | None = None, *, timeout: timedelta | None = None
) -> torch.device:
    """Start the default process group from torchrun's variables, unless one is running.

    The backend follows the device type (see :func:`device_type`). On CUDA the current
    device is set to ``cuda:<local_rank>``. Returns the device to compute on. Calling it
    again, or after someone else started the default group, only returns the device.
    """
    dev = current_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return dev
    missing = [name for name in _TORCHRUN_VARS if not os.environ.get(name)]
    if missing:
        raise DeviceError(
            f"init_distributed() needs the variables {list(_TORCHRUN_VARS)} that torchrun "
            f"sets; missing: {missing}. Fix: launch with `torchrun --nproc-per-node N "
            f"script.py`, set them yourself, or call torch.distributed.init_process_group "
            f"before nnscaler."
        )
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(_BACKENDS[dev.type], init_method="env://", **kwargs)
    return dev
