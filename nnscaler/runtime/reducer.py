"""Gradient synchronization of data-parallel replicas, with optional ZeRO stage 1 or 2.

A `Reducer` owns parameters that are replicated on every rank of ``ranks``. Their
gradients live in flat per-bucket buffers (``param.grad`` is a view into the buffer), so a
bucket is reduced with one collective and no copy. Gradients are **summed** over replicas
(nnScaler semantics: data-parallel replicas and micro-batches behave like gradient
accumulation over all samples on one device; nothing is averaged).

Typical step::

    reducer.zero_grad()
    for i, mb in enumerate(micro_batches):
        with reducer.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            loss(mb).backward()
    reducer.sync_grads()
    optimizer.step()          # optimizer built over reducer.parameters_for_optimizer()
    reducer.gather_params()   # no-op without zero

ZeRO stage 2 (``zero_stage=2``) keeps no gradient buffer: as soon as backward has
produced every gradient of a bucket, the bucket is packed into a transient flat tensor,
reduce-scattered (asynchronously) and added to this rank's fp32 shard gradient; the
parameters' ``.grad`` go back to None. It reduces after every backward, ``no_sync`` or
not (holding the micro-batches' sum would hold the full gradient). See docs/reducer.md
and docs/zero.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.config import DEFAULT_BUCKET_CAP_MB
from nnscaler.runtime.bucket import Bucket
from nnscaler.runtime.teardown import track_reducer
from nnscaler.runtime.zero import new_group, zero_groups
from nnscaler.runtime.zero3 import free_unit

__all__ = ["Bucket", "Reducer", "ReducerHook", "sync_grad_when"]

ReducerHook = Callable[[torch.Tensor], Any]
"""``fn(grad_buffer)``; may modify the buffer in place, the return value is ignored."""

_MB = 1024 * 1024

# sync_grad_when(False) depth: while above 0, backward passes only accumulate
_skip_sync = [0]


@contextlib.contextmanager
def sync_grad_when(cond: bool) -> Iterator[None]:
    """nnScaler's gradient-accumulation switch: inside ``sync_grad_when(False)`` the
    backward passes of every reducer only accumulate (no reduction is launched, as in
    `Reducer.no_sync`); with True it does nothing. The reduction then runs once,
    at ``optimizer.step()`` (or the first backward outside the block, for the async
    reducer)::

        for i, batch in enumerate(micro_batches):
            with nnscaler.sync_grad_when(i == len(micro_batches) - 1):
                model(batch).backward()
        optimizer.step()
    """
    if cond:
        yield
        return
    _skip_sync[0] += 1
    try:
        yield
    finally:
        _skip_sync[0] -= 1


class Reducer:
    """Sums gradients of parameters replicated over ``ranks``; optional ZeRO stage 1.

    Args:
        params: the replicated parameters (duplicates and ``requires_grad=False`` ones are
            skipped). All ranks must pass the same parameters in the same order.
        ranks: global ranks of the data-parallel replicas (any order; used sorted); this
            rank must be one of them.
        bucket_cap_mb: maximum bucket size in MiB (a larger single parameter gets its own
            bucket). Buckets are filled in reverse registration order, close to the order
            in which backward produces gradients.
        async_op: launch a bucket's reduction from gradient hooks as soon as all its
            parameters' gradients are accumulated (overlaps communication with backward).
            With gradient accumulation, run all but the last micro-batch's backward inside
            `no_sync`.
        zero: shard the optimizer state (ZeRO stage 1): use `parameters_for_optimizer`
            to build the optimizer and call `gather_params` after ``step()``.
        zero_stage: with ``zero``, 1 (the default) or 2: the gradients are sharded too,
            reduce-scattered as each bucket's gradients are produced (the module
            docstring); 3: the parameters too, one bucket per unit of ``units``, gathered
            by `nnscaler.runtime.zero3.Zero3Runner`.
        units: stage 3: ``(name, params)`` per gathering unit, in forward order (the
            parameters of ``params`` not listed fall into the rest unit, ``''``).
        reduce_dtype: stages 2 and 3: the dtype gradients are packed and reduce-scattered
            in (None: the parameters'); the shards add them up in fp32 either way.
        zero_ngroups: split ``ranks`` into this many groups; state is sharded within a group
            and replicated across groups.
        process_group: group over ``ranks`` (created when None).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        ranks: Iterable[int],
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        async_op: bool = False,
        zero: bool = False,
        zero_ngroups: int = 1,
        process_group: dist.ProcessGroup | None = None,
        zero_stage: int | None = None,
        units: Sequence[tuple[str, Sequence[torch.nn.Parameter]]] = (),
        reduce_dtype: torch.dtype | None = None,
    ):
        self.ranks = tuple(sorted(ranks))
        self.rank = self._check_ranks(self.ranks, bucket_cap_mb)
        self.bucket_cap_mb = float(bucket_cap_mb)
        stage = (1 if zero else 0) if zero_stage is None else int(zero_stage)
        if stage not in (0, 1, 2, 3) or (stage >= 1) != bool(zero):
            raise ValueError(
                f"zero_stage must be 0 without zero and 1, 2 or 3 with it, got zero={zero}, "
                f"zero_stage={zero_stage}; pass zero=True, zero_stage=2 for stage 2"
            )
        self.stage = stage
        if reduce_dtype is not None and stage < 2:
            raise ValueError(f"reduce_dtype={reduce_dtype} applies to zero_stage 2 and 3 (the "
                             f"reduce-scattered gradients), got zero_stage={stage}")
        self.reduce_dtype = reduce_dtype
        #: stage 3 in a pipeline: inside no_sync, gradients accumulate whole and the
        #: reduce-scatter waits for a backward outside it (`syncing`) or `sync_grads`
        self.hold_in_no_sync = False
        self._used: dict[int, set[int]] = {}  # held backward: bucket -> params done
        #: how a stage-3 unit is freed (`nnscaler.runtime.zero3.Zero3Runner` sets it)
        self.release_unit: Callable[[Bucket], None] = free_unit
        self.async_op = async_op or stage >= 2  # stage 2 launches from gradient hooks
        self.zero = zero
        self.zero_ngroups = zero_ngroups
        self._pre_hooks: list[ReducerHook] = []
        self._post_hooks: list[ReducerHook] = []
        self._no_sync = False
        self._next_launch = 0

        groups = zero_groups(self.ranks, zero_ngroups if zero else 1, self.rank)
        self._groups = groups
        if len(self.ranks) == 1:
            self._group: dist.ProcessGroup | None = None
        else:
            self._group = process_group if process_group is not None else new_group(self.ranks)
        if zero:
            if zero_ngroups == 1:
                self._zero_group = self._group
                self._cross_group = None
            else:
                self._zero_group = new_group(groups.zero_ranks)
                self._cross_group = new_group(groups.cross_ranks)

        seen: set[int] = set()
        self.params: list[torch.nn.Parameter] = []
        for p in params:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            self.params.append(p)
        if stage >= 3:
            self.buckets = self._unit_buckets(units, groups.zero_size, groups.shard_index)
        else:
            self.buckets = self._build_buckets(groups.zero_size, groups.shard_index)
        self._where: dict[int, tuple[int, int]] = {}
        for bi, b in enumerate(self.buckets):
            for pi, p in enumerate(b.params):
                self._where[id(p)] = (bi, pi)
        self._handles = []
        self._in_flight: list[Bucket] = []  # stage 2: launched, not finished, in order
        self._round_open = False  # stage 2: a backward produced gradients not all launched
        track_reducer(self)  # finished and released at interpreter exit
        if self.async_op:
            for p in self.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    @staticmethod
    def _check_ranks(ranks: tuple[int, ...], bucket_cap_mb: float) -> int:
        """This process's rank, after checking ``ranks`` and the bucket size."""
        if not ranks:
            raise ValueError("ranks must name at least one rank, got an empty list")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks must be distinct, got {list(ranks)}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}; the default is "
                             f"{DEFAULT_BUCKET_CAP_MB}")
        rank = dist.get_rank() if dist.is_initialized() else ranks[0]
        if rank not in ranks:
            raise ValueError(
                f"this process (rank {rank}) is not in the reducer's ranks {list(ranks)}; "
                "create a Reducer only on its member ranks"
            )
        return rank

    # ------------------------------------------------------------------ layout
    def _build_buckets(self, nshards: int, shard_index: int) -> list[Bucket]:
        cap = self.bucket_cap_mb * _MB
        buckets: list[Bucket] = []
        open_: dict[tuple[torch.dtype, torch.device], tuple[list[torch.nn.Parameter], int]] = {}

        def close(key: tuple[torch.dtype, torch.device]) -> None:
            ps, _ = open_.pop(key)
            buckets.append(Bucket(ps, nshards, shard_index, self.zero, self.stage))

        for p in reversed(self.params):
            key = (p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            if key in open_ and open_[key][1] + nbytes > cap:
                close(key)
            ps, size = open_.get(key, ([], 0))
            ps.append(p)
            open_[key] = (ps, size + nbytes)
        for key in list(open_):
            close(key)
        return buckets

    def _unit_buckets(self, units: Sequence[tuple[str, Sequence[torch.nn.Parameter]]],
                      nshards: int, shard_index: int) -> list[Bucket]:
        """Stage 3: one bucket per unit and dtype, the blocks in reverse forward order
        (the order backward completes them), the rest unit last."""
        mine = {id(p) for p in self.params}
        listed: set[int] = set()
        named: list[tuple[str, list[torch.nn.Parameter]]] = []
        for name, ps in units:
            keep = [p for p in ps if id(p) in mine and id(p) not in listed]
            listed.update(id(p) for p in keep)
            if keep:
                named.append((name, keep))
        rest = [p for p in self.params if id(p) not in listed]
        ordered = [u for u in reversed(named) if u[0]] + [u for u in named if not u[0]]
        if rest:
            ordered.append(("", rest))
        buckets = []
        for name, ps in ordered:
            by_key: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
            for p in ps:
                by_key.setdefault((p.dtype, p.device), []).append(p)
            for group in by_key.values():
                buckets.append(Bucket(group, nshards, shard_index, True, 3, unit=name))
        return buckets

    # ------------------------------------------------------------------ hooks
    def register_pre_hook(self, fn: ReducerHook) -> None:
        """``fn(grad_buffer)`` runs on each bucket's flat gradient buffer before its reduction."""
        self._pre_hooks.append(fn)

    def register_post_hook(self, fn: ReducerHook) -> None:
        """``fn(grad)`` runs after each bucket's reduction on the reduced gradient: the full
        buffer without zero, this rank's fp32 gradient shard with zero."""
        self._post_hooks.append(fn)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (no async communication).

        Only matters with ``async_op=True``; the blocking path never communicates before
        `sync_grads`.
        """
        prev, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = prev

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bi, pi = self._where[id(p)]
        bucket = self.buckets[bi]
        if self.stage >= 2:
            self._stage2_ready(bucket, pi)
            return
        if bucket.launched:
            raise RuntimeError(
                "a gradient was accumulated into a bucket whose reduction was already launched "
                "(several backward passes outside no_sync() before sync_grads()); run all but "
                "the last micro-batch's backward inside `with reducer.no_sync():`"
            )
        bucket.adopt_grad(pi)
        if self._no_sync or _skip_sync[0]:
            return
        bucket.ready.add(pi)
        # launch in bucket order so every rank issues the collectives in the same order
        while self._next_launch < len(self.buckets) and len(
            self.buckets[self._next_launch].ready
        ) == len(self.buckets[self._next_launch].params):
            self._launch(self.buckets[self._next_launch], async_op=True)
            self._next_launch += 1

    def _stage2_ready(self, bucket: Bucket, pi: int) -> None:
        """Stage 2: a gradient is complete; launch every bucket, in order, whose
        gradients all are (``no_sync`` does not delay it), and finish all but the newest
        launch so that at most two transient buffers live."""
        self._round_open = True
        if self.hold_in_no_sync and self._no_sync:
            self._hold(bucket, pi)
            return
        bucket.ready.add(pi)
        while self._next_launch < len(self.buckets) and len(
            self.buckets[self._next_launch].ready
        ) == len(self.buckets[self._next_launch].params):
            self._launch(self.buckets[self._next_launch], async_op=True)
            if self.stage >= 3:  # its gradients are all out: backward is done with it
                self.release_unit(self.buckets[self._next_launch])
            self._next_launch += 1
            while len(self._in_flight) > 1:
                self._finish(self._in_flight[0])
        if self._next_launch == len(self.buckets):  # the next backward starts a new round
            self._next_launch = 0
            self._round_open = False

    def _hold(self, bucket: Bucket, pi: int) -> None:
        """A held backward produced a gradient: it stays in ``.grad`` (summed over the
        micro-batches); a unit whose gradients are all produced is done for this
        backward and freed."""
        bi, _ = self._where[id(bucket.params[pi])]
        used = self._used.setdefault(bi, set())
        used.add(pi)
        if len(used) == len(bucket.params):
            if self.stage >= 3:
                self.release_unit(bucket)
            used.clear()

    def end_backward(self) -> None:
        """A backward is over: forget which gradients the held backward produced."""
        self._used.clear()

    @contextlib.contextmanager
    def syncing(self) -> Iterator[None]:
        """Inside a `no_sync` block, a backward that launches its reductions (a
        pipeline's last micro-batch of a stage)."""
        prev, self._no_sync = self._no_sync, False
        try:
            yield
        finally:
            self._no_sync = prev

    # ------------------------------------------------------------------ communication
    def _launch(self, bucket: Bucket, async_op: bool) -> None:
        if self.stage >= 2:
            self._launch_stage2(bucket, async_op)
            return
        bucket.adopt_all()
        for fn in self._pre_hooks:
            fn(bucket.grad_buffer)
        bucket.launched = True
        if not self.zero:
            if self._group is not None:
                bucket.work = dist.all_reduce(
                    bucket.grad_buffer, group=self._group, async_op=async_op
                )
            return
        out = torch.empty(
            bucket.shard_numel, dtype=bucket.grad_buffer.dtype, device=bucket.grad_buffer.device
        )
        if self._zero_group is not None:
            bucket.work = dist.reduce_scatter_single(
                out, bucket.grad_buffer, group=self._zero_group, async_op=async_op
            )
        else:
            out.copy_(bucket.grad_buffer)
        bucket.shard_out = out

    def _launch_stage2(self, bucket: Bucket, async_op: bool) -> None:
        if bucket.launched:  # still reducing the previous backward's gradients
            self._finish_stage2(bucket)
        flat = bucket.pack_grads(self.reduce_dtype)
        for fn in self._pre_hooks:
            fn(flat)
        bucket.launched = True
        bucket.ready.clear()
        out = torch.empty(bucket.shard_numel, dtype=flat.dtype, device=flat.device)
        if self._zero_group is not None:
            bucket.work = dist.reduce_scatter_single(
                out, flat, group=self._zero_group, async_op=async_op
            )
        else:
            out.copy_(flat)
        bucket.shard_out = out
        bucket.packed = flat  # kept alive until the collective is done
        self._in_flight.append(bucket)

    def _finish_stage2(self, bucket: Bucket) -> None:
        """Add a launched bucket's reduced shard to the shard gradient (fp32)."""
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        out, bucket.shard_out, bucket.packed = bucket.shard_out, None, None
        if out is None or bucket.shard_param is None:
            raise RuntimeError("internal error: zero bucket finished without a launched shard")
        out = out.float()
        if bucket.shard_param.grad is None:
            bucket.shard_param.grad = out
        else:
            bucket.shard_param.grad.add_(out)
        bucket.launched = False
        self._in_flight.remove(bucket)

    def _sync_stage2(self) -> None:
        """Stage 2's `sync_grads`: launch what backward left (buckets with a gradient
        that was not produced), finish everything, then sum the shards across ZeRO
        groups once and run the post hooks on the shard gradients."""
        while self._in_flight:
            self._finish_stage2(self._in_flight[0])
        if self._round_open:  # the same buckets on every rank: the program is the same
            for bucket in self.buckets[self._next_launch :]:
                self._launch(bucket, async_op=False)
                if self.stage >= 3:
                    self.release_unit(bucket)
        while self._in_flight:
            self._finish_stage2(self._in_flight[0])
        for bucket in self.buckets:
            if bucket.shard_param is None:
                raise RuntimeError("internal error: a stage-2 bucket without a shard")
            if bucket.shard_param.grad is None:
                bucket.shard_param.grad = torch.zeros_like(bucket.shard_param)
            grad = bucket.shard_param.grad
            if self._cross_group is not None:
                dist.all_reduce(grad, group=self._cross_group)
            for fn in self._post_hooks:
                fn(grad)
            bucket.ready.clear()
        self._next_launch = 0
        self._round_open = False

    def _finish(self, bucket: Bucket) -> None:
        if self.stage >= 2:
            self._finish_stage2(bucket)
            return
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        if not self.zero:
            reduced = bucket.grad_buffer
        else:
            out = bucket.shard_out
            bucket.shard_out = None
            if out is None or bucket.shard_param is None:
                raise RuntimeError("internal error: zero bucket finished without a launched shard")
            if self._cross_group is not None:
                dist.all_reduce(out, group=self._cross_group)
            reduced = out if out.dtype == torch.float32 else out.float()
            bucket.shard_param.grad = reduced
        for fn in self._post_hooks:
            fn(reduced)
        bucket.ready.clear()
        bucket.launched = False

    def sync_grads(self) -> None:
        """Sum gradients over the replicas (and wait for reductions launched by hooks).

        Afterwards every ``param.grad`` holds the sum over all ranks and micro-batches since
        the last `zero_grad`; with zero, each shard parameter's ``.grad`` holds this
        rank's shard of that sum (``param.grad`` of the full parameters is then unreduced;
        None with stage 2).
        """
        if self.stage >= 2:
            self._sync_stage2()
            return
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket, async_op=False)
        for bucket in self.buckets:
            self._finish(bucket)
        self._next_launch = 0

    def zero_grad(self) -> None:
        """Zero every gradient buffer and re-attach ``param.grad`` views (and shard grads)."""
        if self.stage >= 2:
            self.wait_pending()  # a launch nobody synced: drop its result
            for bucket in list(self._in_flight):
                bucket.work = None
                self._finish_stage2(bucket)
        for bucket in self.buckets:
            if bucket.launched:
                raise RuntimeError(
                    "zero_grad() called while a bucket's reduction is in flight; call sync_grads() first"
                )
            bucket.grad_buffer.zero_()
            bucket.attach_grads()
            bucket.ready.clear()
            if bucket.shard_param is not None:
                bucket.shard_param.grad = None
        self._next_launch = 0
        self._round_open = False

    # ------------------------------------------------------------------ optimizer API
    def parameters_for_optimizer(self) -> list[torch.nn.Parameter]:
        """The tensors to optimize: the fp32 shards with zero, else the parameters."""
        if not self.zero:
            return list(self.params)
        return [b.shard_param for b in self.buckets if b.shard_param is not None]

    def gather_params(self) -> None:
        """After ``optimizer.step()`` with zero: all-gather the updated shards into the full
        parameters of every rank of the zero group. No-op without zero."""
        if self.stage >= 3:  # gathered when used; a unit kept gathered would be stale
            for bucket in self.buckets:
                free_unit(bucket)
            return
        if not self.zero:
            return
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.shard_param is None or bucket.param_buffer is None:
                    raise RuntimeError("internal error: zero bucket without a shard parameter")
                shard = bucket.shard_param.detach().to(bucket.param_buffer.dtype)
                if self._zero_group is None:
                    bucket.param_buffer.copy_(shard)
                else:
                    dist.all_gather_single(bucket.param_buffer, shard, group=self._zero_group)

    def refresh_shards(self) -> None:
        """After the full parameters changed in place (weights loaded or broadcast): copy
        them into the ZeRO shards (the fp32 tensors the optimizer updates), so the next
        step starts from the new values. No-op without zero."""
        if not self.zero:
            return
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.shard_param is not None and bucket.param_buffer is not None \
                        and bucket.gathered:  # stage 3: a freed unit has no new values
                    bucket.shard_param.copy_(bucket.shard_slice(bucket.param_buffer))

    def wait_pending(self, timeout: Any = None) -> None:
        """Wait for the reductions launched by gradient hooks and not synced yet (async
        mode), e.g. at interpreter exit (`nnscaler.runtime.teardown`); ``timeout`` a
        ``datetime.timedelta`` or None (the group's timeout). The buckets stay launched:
        `sync_grads` finishes them."""
        for bucket in self.buckets:
            if bucket.work is not None:
                if timeout is None:
                    bucket.work.wait()
                else:
                    bucket.work.wait(timeout)

    def release_groups(self) -> None:
        """Drop this reducer's process groups (at the end of a job, after they were
        destroyed: a kept reference would keep their threads alive to the interpreter's
        exit). The reducer cannot communicate afterwards."""
        for bucket in self.buckets:
            bucket.work = None
        self._group = self._zero_group = self._cross_group = None

    def remove_hooks(self) -> None:
        """Detach the gradient-ready hooks (async mode)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __repr__(self) -> str:
        return (
            f"Reducer(ranks={list(self.ranks)}, params={len(self.params)}, buckets={len(self.buckets)}, "
            f"async_op={self.async_op}, zero={self.zero}, zero_ngroups={self.zero_ngroups}, "
            f"zero_stage={self.stage}"
            + (f", reduce_dtype={self.reduce_dtype}" if self.reduce_dtype is not None else "")
            + ")"
        )
