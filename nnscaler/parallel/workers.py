"""Work a policy hands to every rank while rank 0 plans.

Under ``torch.distributed``, ``parallelize`` traces and plans on rank 0 only; the other
ranks wait for the outcome. A policy that measures (op times, collectives) can put them to
work meanwhile:

- `map_over_ranks` runs ``fn(item)`` for a list of items spread over every rank
  (rank ``r`` takes items ``r, r + world, ...``) and returns the results in the items'
  order: profiling that takes minutes on one device is divided by the world size, and
  each time is measured while every device of the machine computes, as in training;
- `call_on_every_rank` has every rank call ``fn(*args)`` at once (a function that
  runs collectives, e.g. measuring an all-reduce on the present group) and returns each
  rank's result, in rank order.

Outside the planning of a distributed ``parallelize`` (no other rank listens: one
process, ``load_module=False`` compiles, a policy called directly) both run here alone:
the results are the same, only slower. ``fn`` must be picklable (a module-level
function) and so must the items and results; a failure on any rank is raised on rank 0
as a `WorkerError` naming the rank, and the other ranks keep serving.

The protocol (internal): while rank 0 plans, the other ranks loop in `serve`, each
message a ``broadcast_object_list`` from rank 0: ``("map", fn, items)`` or ``("call", fn,
args)``, answered by ``gather_object`` to rank 0, until ``("done", outcome)``.
"""

from __future__ import annotations

import contextlib
import pickle
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from nnscaler.errors import WorkerError

__all__ = ["WorkerError", "call_on_every_rank", "map_over_ranks"]

T = TypeVar("T")
R = TypeVar("R")

_listening = False  # True on rank 0 while the other ranks serve


@contextlib.contextmanager
def _ranks_listening() -> Iterator[None]:
    """On rank 0, around planning: the other ranks are in `serve`."""
    global _listening
    before, _listening = _listening, True
    try:
        yield
    finally:
        _listening = before


def _distributed() -> bool:
    return _listening and dist.is_available() and dist.is_initialized() \
        and dist.get_world_size() > 1


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _picklable(what: str, obj: Any, fn: Callable[..., Any]) -> None:
    try:
        pickle.dumps(obj)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the same mistake
        raise WorkerError(
            f"{what} for {_name(fn)} cannot be sent to the other ranks ({type(e).__name__}: "
            f"{e}); pass a module-level function and picklable values") from e


def _run_share(fn: Callable[[Any], Any], items: Sequence[Any], rank: int,
               world: int) -> tuple[str, Any]:
    try:
        return "ok", [fn(x) for x in items[rank::world]]
    except Exception as e:  # noqa: BLE001 - reported to rank 0 with the traceback
        return "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


def _run_call(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as e:  # noqa: BLE001 - reported to rank 0 with the traceback
        return "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


def _gather(mine: tuple[str, Any], fn: Callable[..., Any]) -> list[Any]:
    world = dist.get_world_size()
    box: list[Any] = [None] * world
    dist.gather_object(mine, box, dst=0)
    out = []
    for rank, (status, value) in enumerate(box):
        if status != "ok":
            raise WorkerError(f"{_name(fn)} failed on rank {rank}: {value}")
        out.append(value)
    return out


def map_over_ranks(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]``, the items spread over every rank while rank 0 plans
    (here alone otherwise). See the module's docstring."""
    items = list(items)
    if not _distributed() or not items:
        return [fn(x) for x in items]
    _picklable("the items", items, fn)
    _picklable("the function", fn, fn)
    world = dist.get_world_size()
    dist.broadcast_object_list([("map", fn, items)], src=0)
    shares = _gather(_run_share(fn, items, 0, world), fn)
    out: list[Any] = [None] * len(items)
    for rank, share in enumerate(shares):
        out[rank::world] = share
    return out


def call_on_every_rank(fn: Callable[..., R], *args: Any) -> list[R]:
    """Every rank calls ``fn(*args)`` at once (it may run collectives on the default
    group); the results in rank order. Here alone (a list of one) outside planning."""
    if not _distributed():
        return [fn(*args)]
    _picklable("the arguments", args, fn)
    _picklable("the function", fn, fn)
    dist.broadcast_object_list([("call", fn, args)], src=0)
    return _gather(_run_call(fn, args), fn)


def serve() -> Any:
    """On a rank other than 0 while rank 0 plans: run what it hands out until it sends
    the outcome of generation, and return that outcome."""
    rank, world = dist.get_rank(), dist.get_world_size()
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        kind, *rest = box[0]
        if kind == "done":
            return rest[0]
        if kind == "map":
            fn, items = rest
            dist.gather_object(_run_share(fn, items, rank, world), None, dst=0)
        elif kind == "call":
            fn, args = rest
            dist.gather_object(_run_call(fn, args), None, dst=0)
        else:  # a message of a newer protocol: nothing this rank can do but say so
            dist.gather_object(("error", f"unknown message {kind!r}"), None, dst=0)


def finish(outcome: Any) -> None:
    """On rank 0: end the other ranks' `serve` with the outcome."""
    dist.broadcast_object_list([("done", outcome)], src=0)
