"""A clean exit: nothing of ``torch.distributed`` is left running when the interpreter exits.

What was left running. A gloo process group owns C++ threads (two ``pt_gloo_runloop``
workers and a ``gloo_tcp_loop``) that stop only when the group's C++ object is destroyed;
``destroy_process_group`` does not stop them (gloo has no ``shutdown``, pytorch/pytorch
#130345), it only drops torch's own references. Any other reference keeps the object,
and its threads, alive into interpreter finalization and C++ static destruction, where
about one run in 10 to 25 here aborted with "terminate called without an active
exception" after a passing result (the failure mode of pytorch/pytorch#190489 and the
motivation of the unmerged pytorch/pytorch#179291 and #157193, which destroy the groups at
interpreter exit; a torch object is not automatically destroyed at exit,
pytorch/pytorch#109478). Two references survived here:

- nnscaler's own: the group cache (`nnscaler.runtime.groups`), the default group
  whose timeout `nnscaler.runtime.device` remembers, and each
  `Reducer`'s groups (a module object held by a global);
- torch's: ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler.__init__`` has
  ``process_group=dist.group.WORLD`` as a default argument, evaluated when the module is
  imported. ``torch.optim``'s first optimizer imports ``torch._dynamo``, which imports
  that module: in a job that starts its process group and then builds an optimizer, the
  world group can never be freed (seen with torch 2.13: after
  ``destroy_process_group()`` and ``gc.collect()`` its three threads still run).

`shutdown` (registered with `atexit` when the runtime is imported, so it runs
after the user's script returns and before finalization) waits for the reductions still
in flight, destroys the process groups (subgroups first, then the default one, as
``destroy_process_group`` orders them), drops nnscaler's references to them, replaces a
destroyed group held as a default argument in ``torch.distributed``'s modules by ``None``
(what the default means), and collects: the groups' C++ objects are destroyed and their
threads joined while the interpreter is fully alive. A script then needs neither
``destroy_process_group`` nor ``os._exit``. Groups the user keeps in globals of their own
stay alive; destroying them is the user's part (``dist.destroy_process_group`` and
``del``).
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys
import types
import warnings
import weakref
from datetime import timedelta
from typing import Any

__all__ = ["PENDING_WORK_TIMEOUT", "live_gloo_threads", "shutdown", "track_reducer"]

#: How long `shutdown` waits for a reduction still in flight.
PENDING_WORK_TIMEOUT = timedelta(seconds=60)

_log = logging.getLogger("nnscaler.runtime")
_reducers: weakref.WeakSet[Any] = weakref.WeakSet()


def track_reducer(reducer: Any) -> None:
    """Remember ``reducer`` (weakly) so that `shutdown` can finish its work and drop
    its process groups."""
    _reducers.add(reducer)


def _release_stale_defaults(process_group_type: type) -> list[str]:
    """Replace process groups held as default arguments of functions in
    ``torch.distributed``'s modules by ``None`` (the default group). Returns the
    functions changed."""
    changed = []

    def fix(fn: Any, where: str) -> None:
        fn = getattr(fn, "__func__", fn)
        if not isinstance(fn, types.FunctionType):
            return
        defaults = fn.__defaults__ or ()
        if any(isinstance(d, process_group_type) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, process_group_type) else d
                                    for d in defaults)
            changed.append(where)
        kw = fn.__kwdefaults__ or {}
        if any(isinstance(d, process_group_type) for d in kw.values()):
            fn.__kwdefaults__ = {k: None if isinstance(d, process_group_type) else d
                                 for k, d in kw.items()}
            changed.append(where)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated attributes warn when read
        for name, module in list(sys.modules.items()):
            if not name.startswith("torch.distributed") or module is None:
                continue
            for attr, value in list(vars(module).items()):
                if getattr(value, "__module__", None) != name:
                    continue  # imported from elsewhere: fixed where it is defined
                if isinstance(value, type):
                    for meth_name, meth in list(vars(value).items()):
                        fix(meth, f"{name}.{attr}.{meth_name}")
                else:
                    fix(value, f"{name}.{attr}")
    return changed


def live_gloo_threads() -> list[str]:
    """The names of this process's gloo threads (Linux; empty elsewhere): what a clean
    exit must not leave behind."""
    import glob

    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                name = f.read().strip()
        except OSError:
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def shutdown() -> None:
    """Finish and destroy what nnscaler's runtime left in ``torch.distributed``: wait for
    the reducers' reductions in flight (up to `PENDING_WORK_TIMEOUT`), destroy every
    process group (subgroups, then the default group), drop the references that would
    keep their C++ objects alive, and collect. Runs at interpreter exit; call it yourself
    only at the end of a job (the parallel modules cannot communicate afterwards)."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    from nnscaler.runtime.groups import clear_groups

    reducers = list(_reducers)
    for reducer in reducers:
        try:
            reducer.wait_pending(PENDING_WORK_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - at exit: report and go on
            _log.warning("nnscaler: a gradient reduction still in flight at exit did not "
                         "finish (%s: %s)", type(e).__name__, e)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()  # every group, subgroups first
        except Exception as e:  # noqa: BLE001 - at exit: report and go on
            _log.warning("nnscaler: destroying the process groups at exit failed (%s: %s)",
                         type(e).__name__, e)
    clear_groups()
    from nnscaler.runtime import device

    device._timeout[:] = [None, None]  # it names the default group it belongs to
    for reducer in reducers:
        reducer.release_groups()
    _release_stale_defaults(dist.ProcessGroup)
    gc.collect()


atexit.register(shutdown)
