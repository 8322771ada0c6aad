"""The parts of one split that talk to each other: `PartGroup`.

Most splits are local: each part computes its piece and the layout algebra moves pieces
between ops. A few ops can only be split if the parts exchange a little data *inside*
the op: a cross-entropy over classes split in parts needs the maximum and the sum of
exponentials over all classes. Such an op's split names a *part op* registered with
``collective=True`` (see [`TransformRule`][nnscaler.TransformRule]); every call of it gets
``group``, a `PartGroup` of the parts of that split, in part order.

Three implementations stand behind the one interface:

- in generated code, a group over the ranks that run the parts (``torch.distributed``,
  `nnscaler.runtime.partgroup.ProcessPartGroup`);
- in one process, for the plan simulator and the annotation checks, `run_parts`
  runs the parts in threads joined by a `ThreadPartGroup`;
- `SINGLE`, a group of one part (the op unsplit).

Gradients follow the exact-adjoint convention of the runtime
(``docs/internals/parallel-runtime.md``): ``all_reduce(x, "sum")`` gives every part the
sum, so each part's ``x`` receives the sum of the gradients of every part's result;
``send_recv`` (point to point: a ring shift, a permutation of pieces) sends each gradient
back the way its value came.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nnscaler.errors import PartGroupError

__all__ = [
    "REDUCE_OPS",
    "SINGLE",
    "PartGroup",
    "PartGroupError",
    "ThreadPartGroup",
    "check_peers",
    "check_reduce_op",
    "check_splits",
    "run_parts",
]

REDUCE_OPS = ("sum", "max")


class PartGroup:
    """The ``size`` parts of one split; this call is part ``index``."""

    size: int = 1
    index: int = 0

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Every part's ``x`` combined: ``"sum"`` (differentiable: each ``x`` gets the sum
        of the gradients of every part's result) or ``"max"`` (no gradient). Every part
        calls it, with tensors of one shape, in the same order."""
        check_reduce_op(op)
        return x if op == "sum" else x.detach()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every part's ``x``, stacked in part order (a new dim 0 of size `size`);
        differentiable: each ``x`` gets the sum over parts of the gradients of its slot.
        Every part calls it, with tensors of one shape, in the same order."""
        return x.unsqueeze(0)

    def send_recv(self, x: torch.Tensor, dst: int, src: int) -> torch.Tensor:
        """Send ``x`` to part ``dst`` and return the tensor part ``src`` sent here.

        Every part calls it at once, with tensors of one shape, and the ``dst`` of the
        parts are a permutation of them (``dst = (index + 1) % size`` shifts a ring).
        Differentiable: the gradient of the result goes back to ``src``, and ``x`` gets
        the gradient of what ``dst`` received."""
        check_peers(self, dst, src)
        return x

    def all_to_all(self, x: torch.Tensor, send_splits: Sequence[int],
                   recv_splits: Sequence[int]) -> torch.Tensor:
        """An all-to-all of uneven sizes along dim 0: this part sends the ``send_splits[q]``
        rows of ``x`` that follow the first ``sum(send_splits[:q])`` to part ``q``, and
        returns what it receives, ``recv_splits[q]`` rows from each part ``q`` in part
        order (the parts learn each other's sizes first, e.g. with `all_gather`).
        Differentiable: the backward is the all-to-all the other way."""
        check_splits(self, x, send_splits, recv_splits)
        return x

    def __repr__(self) -> str:
        return f"{type(self).__name__}(index={self.index}, size={self.size})"


def check_splits(group: PartGroup, x: torch.Tensor, send_splits: Sequence[int],
                 recv_splits: Sequence[int]) -> None:
    """The split sizes of `PartGroup.all_to_all` fit the group and ``x``."""
    if len(send_splits) != group.size or len(recv_splits) != group.size:
        raise PartGroupError(
            f"PartGroup.all_to_all: give one send and one receive size per part ({group.size}"
            f" parts); got {len(send_splits)} send and {len(recv_splits)} receive sizes")
    if sum(send_splits) != x.size(0):
        raise PartGroupError(
            f"PartGroup.all_to_all: the send sizes {list(send_splits)} add up to "
            f"{sum(send_splits)} rows but x has {x.size(0)}; they must add up to x.size(0)")
    if group.size == 1 and list(send_splits) != list(recv_splits):
        raise PartGroupError(
            f"PartGroup.all_to_all: a group of one part receives what it sends; got send "
            f"sizes {list(send_splits)} and receive sizes {list(recv_splits)}")


def check_reduce_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise PartGroupError(f"PartGroup.all_reduce: op must be one of {REDUCE_OPS}, got {op!r}")


def check_peers(group: PartGroup, dst: int, src: int) -> None:
    for what, peer in (("dst", dst), ("src", src)):
        if not isinstance(peer, int) or not 0 <= peer < group.size:
            raise PartGroupError(f"PartGroup.send_recv: {what} is a part index in "
                                 f"[0, {group.size}); got {peer!r}")


#: The group of an op that is not split.
SINGLE = PartGroup()


class _Exchange:
    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size)


class ThreadPartGroup(PartGroup):
    """The parts of a split run as threads of one process (`run_parts`).

    ``all_reduce`` adds the parts' tensors in part order, so every part gets the very same
    result, and the sum stays in one autograd graph: a backward from the main thread
    sends each part the sum of the gradients, as the distributed all-reduce's adjoint
    does.
    """

    def __init__(self, exchange: _Exchange, index: int) -> None:
        self._exchange = exchange
        self.size = exchange.size
        self.index = index

    def _exchange_values(self, x: torch.Tensor, what: str) -> list[torch.Tensor]:
        return [v for v, _ in self._post((x, None), what)]

    def _post(self, item: tuple[torch.Tensor, Any], what: str) -> list[tuple[torch.Tensor, Any]]:
        x = item[0]
        ex = self._exchange
        ex.slots[self.index] = item
        try:
            ex.barrier.wait()
            values = list(ex.slots)
            ex.barrier.wait()  # everyone has read before the slots are reused
        except threading.BrokenBarrierError:
            raise PartGroupError("another part of the split failed") from None
        if any(tuple(v.shape) != tuple(x.shape) for v, _ in values):
            raise PartGroupError(f"PartGroup.{what}: the parts passed tensors of shapes "
                                 f"{[tuple(v.shape) for v, _ in values]}; they must agree")
        return values

    def send_recv(self, x: torch.Tensor, dst: int, src: int) -> torch.Tensor:
        check_peers(self, dst, src)
        values = self._post((x, dst), "send_recv")
        if sorted(d for _, d in values) != list(range(self.size)):
            raise PartGroupError(f"PartGroup.send_recv: the parts sent to parts "
                                 f"{[d for _, d in values]}; each part must receive exactly "
                                 f"one tensor (the dst of the parts a permutation)")
        value, to = values[src]
        if to != self.index:
            raise PartGroupError(f"PartGroup.send_recv: part {self.index} receives from part "
                                 f"{src}, which sent to part {to}")
        return value  # one autograd graph: the gradient flows back to part src

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange_values(x, "all_gather"))

    def all_to_all(self, x: torch.Tensor, send_splits: Sequence[int],
                   recv_splits: Sequence[int]) -> torch.Tensor:
        check_splits(self, x, send_splits, recv_splits)
        ex = self._exchange
        ex.slots[self.index] = torch.split(x, list(send_splits))
        try:
            ex.barrier.wait()
            pieces = [ex.slots[q][self.index] for q in range(self.size)]
            ex.barrier.wait()
        except threading.BrokenBarrierError:
            raise PartGroupError("another part of the split failed") from None
        got = [p.size(0) for p in pieces]
        if got != list(recv_splits):
            raise PartGroupError(f"PartGroup.all_to_all: part {self.index} expected "
                                 f"{list(recv_splits)} rows from the parts but they sent {got}")
        return torch.cat(pieces)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        check_reduce_op(op)
        values = self._exchange_values(x, "all_reduce")
        if op == "max":
            return torch.stack([v.detach() for v in values]).amax(0)
        total = values[0]
        for v in values[1:]:
            total = total + v
        return total


def run_parts(calls: Sequence[Callable[[PartGroup], Any]]) -> list[Any]:
    """Run ``calls[p](group_p)`` for every part ``p`` at once, each in its own thread, the
    groups joined (`ThreadPartGroup`); return the results in part order. Grad mode
    is the caller's. A part that raises breaks the others' collectives, and the first
    failure is raised here."""
    n = len(calls)
    if n == 1:
        return [calls[0](SINGLE)]
    exchange = _Exchange(n)
    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException]] = []
    grad = torch.is_grad_enabled()

    def work(p: int) -> None:
        try:
            with torch.set_grad_enabled(grad):
                results[p] = calls[p](ThreadPartGroup(exchange, p))
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors.append((p, e))
            exchange.barrier.abort()

    threads = [threading.Thread(target=work, args=(p,), name=f"nnscaler-part-{p}")
               for p in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = [e for _, e in errors if not isinstance(e, PartGroupError)] or [errors[0][1]]
        raise first[0]
    return results
