"""ZeRO stage 3: parameters sharded over their replicas, gathered one unit at a time.

With ``zero_stage=3`` each reducer keeps, per *gathering unit*, one flat parameter
buffer whose storage is empty except while the unit is in use; this rank holds only its
fp32 shard (the tensor the optimizer steps). A unit is a repeated block (the parameters
under one layer path, ``gpt.blocks.3``: what `nnscaler.graph.blocks.layer_path` calls a
layer) or, for every other parameter, the *rest* unit; ``ComputeConfig.zero_units`` names
the units by module path instead.

Forward is driven by the generated code itself: around the statements that read a unit's
parameters it calls `gather` (all-gather the unit, wait for it), `prefetch` (start the
gather of the unit it reads next, an async handle) and `free` (drop the unit's values once
its last statement ran), which `nnscaler.codegen.gathers` writes from the parameters each
statement reads. `Zero3Runner.forward` adds one hook around it,
`torch.autograd.graph.saved_tensors_hooks`: a tensor saved for backward that lives in a
unit's buffer (a parameter, or a view of one) is saved as ``(unit, offset, size,
stride)``, and unpacked by gathering the unit again (prefetching the unit before it).

Backward reduce-scatters each unit's gradients as in stage 2 (`nnscaler.runtime.reducer`)
and frees the unit's parameters once its gradients are launched: they are not needed
again in that backward (autograd accumulates a parameter's gradient after every use).
Outside forward and backward every unit is freed; `gathered` gives the whole parameters
for a while. ``state_dict()`` gathers one unit at a time for the copy it returns;
checkpoints hold each rank's shards and load straight into them, gathering nothing
(`nnscaler.runtime.zero3_state`). See ``docs/zero.md``.

Recomputation (`Zero3Runner.recomputing` wraps each generated ``_recompute_*`` method):
a checkpointed piece's forward runs under the same hooks; when backward runs it again
it gathers the units it reads once more and keeps them until their gradients are out
(the recomputed tensors saved for backward are plain views of the unit, so nothing frees
a unit on the way). Pipelines (`Zero3Runner.end_backward`, called after each
micro-batch's backward) free what a backward left gathered; `kept_gathered` keeps every
unit gathered across the micro-batches of a step instead.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from nnscaler.config import ComputeConfigError
from nnscaler.errors import ParallelModuleError
from nnscaler.runtime.compiling import outside_compiled

if TYPE_CHECKING:
    from nnscaler.runtime.module import ParallelModule
    from nnscaler.runtime.reducer import Bucket, Reducer

__all__ = ["REST", "Zero3Runner", "check_units", "free", "free_unit", "gather",
           "gather_unit", "gathered", "kept_gathered", "prefetch", "unit_of", "wait_unit"]

#: The name of the *rest* unit: the parameters that lie under no block (or no named unit).
REST = ""


def check_units(units: Sequence[str], param_names: Iterable[str]) -> None:
    """Every unit must be a module path of the model (a proper prefix of a parameter's
    name); otherwise a `ComputeConfigError` names the closest module paths."""
    modules: set[str] = set()
    for name in param_names:
        parts = name.split(".")
        modules.update(".".join(parts[:i]) for i in range(1, len(parts)))
    for unit in units:
        if unit not in modules:
            close = difflib.get_close_matches(unit, sorted(modules), n=3, cutoff=0.0)
            raise ComputeConfigError(
                f"ComputeConfig.zero_units names {unit!r}, which is no module of the model "
                f"that holds parameters; the closest are {close}. Name modules by their "
                f"path in the model (as in model.named_modules())"
            )


def unit_of(name: str, units: Sequence[str] = ()) -> str:
    """The gathering unit of the parameter ``name``: with ``units`` (module paths), the
    longest that ``name`` lies under; without, its layer path (up to and including the
    first numeric part, ``gpt.blocks.3.attn.q_proj.weight`` -> ``gpt.blocks.3``); else
    ``''``, the rest unit."""
    if units:
        under = [u for u in units if name.startswith(u + ".")]
        return max(under, key=len) if under else ""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def gather_unit(reducer: Reducer, bucket: Bucket, async_op: bool = False) -> None:
    """Give ``bucket``'s parameters their values again: all-gather the shards of the
    reducer's ZeRO group into its buffer; with ``async_op`` only start it (`wait_unit`
    finishes it)."""
    if bucket.gathered or bucket.param_buffer is None or bucket.shard_param is None:
        return
    buf = bucket.param_buffer
    buf.untyped_storage().resize_(buf.numel() * buf.element_size())
    bucket.gathered = True
    src = bucket.shard_param.detach().to(buf.dtype)
    group = reducer._zero_group
    if group is None:
        buf.copy_(src)
        return
    bucket.gather_src = src  # alive until the gather is done
    bucket.gather_work = dist.all_gather_single(buf, src, group=group, async_op=True)
    if not async_op:
        wait_unit(bucket)


def wait_unit(bucket: Bucket) -> None:
    """Wait for ``bucket``'s gather, if one is in flight."""
    if bucket.gather_work is not None:
        bucket.gather_work.wait()
        bucket.gather_work = None
        bucket.gather_src = None


def free_unit(bucket: Bucket) -> None:
    """Drop ``bucket``'s parameter values (this rank keeps its shard): its buffer's
    storage shrinks to nothing; the parameters, views of it, keep their shapes."""
    if not bucket.gathered or bucket.param_buffer is None:
        return
    wait_unit(bucket)
    bucket.param_buffer.untyped_storage().resize_(0)
    bucket.gathered = False


class _Saved:
    """What the pack hook keeps of a tensor that lives in a unit's buffer."""

    __slots__ = ("bucket", "offset", "size", "stride")

    def __init__(self, bucket: Bucket, t: torch.Tensor) -> None:
        self.bucket = bucket
        self.offset = t.storage_offset()
        self.size = tuple(t.shape)
        self.stride = t.stride()


class _GatherMode(TorchFunctionMode):
    """Backward recomputes a checkpointed piece: each torch call that reads a parameter
    gathers its unit (`Zero3Runner.use_recompute`)."""

    def __init__(self, runner: Zero3Runner) -> None:
        super().__init__()
        self.runner = runner
        self.use = runner.use_recompute

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        for x in pytree.tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor):
                found = self.runner.param_bucket.get(id(x))
                if found is not None:
                    self.use(*found)
        return func(*args, **kwargs)


class Zero3Runner:
    """Gathers and frees the units of a stage-3 module's reducers (the module docstring)."""

    def __init__(self, reducers: list[Reducer]) -> None:
        self.reducers = reducers
        self.param_bucket: dict[int, tuple[Reducer, Bucket]] = {}
        self.storage_bucket: dict[int, tuple[Reducer, Bucket]] = {}
        #: the buckets of each unit (one per reducer and dtype), what `gather` names
        self.units: dict[str, list[tuple[Reducer, Bucket]]] = {}
        for r in reducers:
            for b in r.buckets:
                if b.param_buffer is None:
                    raise RuntimeError("internal error: a stage-3 bucket without a buffer")
                self.storage_bucket[b.param_buffer.untyped_storage()._cdata] = (r, b)
                self.units.setdefault(b.unit, []).append((r, b))
                for p in b.params:
                    self.param_bucket[id(p)] = (r, b)
        self.order: list[Bucket] = []  # units in the order the last forward used them
        self._seen: list[Bucket] = []
        self._backward_at: Bucket | None = None  # the block backward is in
        self._in_forward = False
        self.keep = False  # `kept_gathered`: no unit is freed until the block ends
        for r in reducers:
            r.release_unit = self.release  # type: ignore[method-assign]
        self.free_all()

    # -- gathering ----------------------------------------------------------------------
    def _reducer(self, bucket: Bucket) -> Reducer:
        return self.storage_bucket[bucket.param_buffer.untyped_storage()._cdata][0]  # type: ignore[union-attr]

    def _prefetch_after(self, bucket: Bucket, step: int) -> None:
        if bucket in self.order:
            i = self.order.index(bucket) + step
            if 0 <= i < len(self.order):
                nxt = self.order[i]
                gather_unit(self._reducer(nxt), nxt, async_op=True)

    def _unit(self, unit: str) -> list[tuple[Reducer, Bucket]]:
        found = self.units.get(unit)
        if found is None:
            raise ParallelModuleError(
                f"the generated code gathers the ZeRO stage-3 unit {unit!r}, which this "
                f"rank's reducers do not hold (they hold {sorted(self.units)}): the file "
                f"and the module's compute config disagree; generate the code again"
            )
        return found

    def enter(self, unit: str) -> None:
        """Forward is about to read ``unit``'s parameters: gather it and wait."""
        for r, b in self._unit(unit):
            if b not in self._seen:
                self._seen.append(b)
            gather_unit(r, b)
            wait_unit(b)

    def start(self, unit: str) -> None:
        """Forward reads ``unit`` next: start its gather (prefetch)."""
        for r, b in self._unit(unit):
            gather_unit(r, b, async_op=True)

    def leave(self, unit: str) -> None:
        """Forward ran the last statement that reads ``unit``: free it (unless kept)."""
        for _, b in self._unit(unit):
            self.release(b)

    def use_recompute(self, reducer: Reducer, bucket: Bucket) -> None:
        """Backward recomputes a checkpointed piece that reads ``bucket``'s parameters:
        gather it (prefetching the unit before it) and keep it; the tensors the piece
        saves are plain views of it, so it stays until its gradients are launched."""
        if bucket is not self._backward_at and bucket.unit:
            self._backward_at = bucket
            gather_unit(reducer, bucket)
            self._prefetch_after(bucket, -1)
        gather_unit(reducer, bucket)
        wait_unit(bucket)

    def recomputing(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a generated ``_recompute_*`` method, run by
        ``torch.utils.checkpoint.checkpoint``) gathering the units it reads when backward
        runs it again; inside a forward it runs as it is (the forward's hooks see it)."""

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if self._in_forward:
                return fn(*args, **kwargs)
            with _GatherMode(self):
                return fn(*args, **kwargs)

        return run

    def release(self, bucket: Bucket) -> None:
        """Free ``bucket`` unless `kept_gathered` holds every unit."""
        if not self.keep:
            free_unit(bucket)

    def end_backward(self) -> None:
        """After one backward (a pipeline's micro-batch): free the units it gathered
        whose gradients it did not launch (they accumulate until the step's last
        micro-batch)."""
        self._backward_at = None
        for r in self.reducers:
            r.end_backward()
        if not self.keep:
            self.free_all()

    def _pack(self, t: torch.Tensor) -> Any:
        found = self.storage_bucket.get(t.untyped_storage()._cdata)
        if found is None:
            return t
        return _Saved(found[1], t)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        bucket = saved.bucket
        reducer = self._reducer(bucket)
        if bucket is not self._backward_at and bucket.unit:  # backward reached a block
            self._backward_at = bucket
            gather_unit(reducer, bucket)
            self._prefetch_after(bucket, -1)
        gather_unit(reducer, bucket)
        wait_unit(bucket)
        return bucket.param_buffer.as_strided(saved.size, saved.stride, saved.offset)  # type: ignore[union-attr]

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Run a forward of the generated code (which gathers and frees its units, see
        `gather`): save parameters for backward as references to their unit, and free
        what is still gathered at the end."""
        self._seen, self._backward_at = [], None
        self._in_forward = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._in_forward = False
            self.order = list(self._seen)
            if not self.keep:
                self.free_all()

    def free_all(self) -> None:
        for r in self.reducers:
            for b in r.buckets:
                free_unit(b)

    def gather_all(self) -> None:
        for r in self.reducers:
            for b in r.buckets:
                gather_unit(r, b)


@contextlib.contextmanager
def gathered(pm: ParallelModule, write: bool = False) -> Iterator[None]:
    """Inside, every parameter of a stage-3 module holds its values (all units gathered);
    with ``write``, changes made to them inside are copied into the shards on the way
    out. Nothing to do for other stages."""
    runner: Zero3Runner | None = getattr(pm, "_zero3", None)
    if runner is None:
        yield
        return
    runner.gather_all()
    try:
        yield
        if write:
            for r in runner.reducers:
                r.refresh_shards()
    finally:
        runner.free_all()


@contextlib.contextmanager
def kept_gathered(pm: ParallelModule) -> Iterator[None]:
    """Inside, the units of a stage-3 module stay gathered once used, across the
    forwards and backwards of several micro-batches (one gather per unit instead of two
    per micro-batch, for the memory of the whole parameters); all are freed on the way
    out. Nothing to do for other stages::

        with kept_gathered(model):
            model.train_step(micro_batches)
    """
    runner: Zero3Runner | None = getattr(pm, "_zero3", None)
    if runner is None:
        yield
        return
    prev, runner.keep = runner.keep, True
    try:
        yield
    finally:
        runner.keep = prev
        if not prev:
            runner.free_all()


# -- what the generated forward calls ---------------------------------------------------
def _runner(pm: ParallelModule) -> Zero3Runner | None:
    return getattr(pm, "_zero3", None)


@outside_compiled
def gather(pm: ParallelModule, unit: str) -> None:
    """All-gather the parameters of ``unit`` over its ZeRO group (or wait for its
    prefetch): the generated forward calls it before the first statement that reads them.
    Nothing to do in a module without stage-3 reducers (an inference-only module)."""
    runner = _runner(pm)
    if runner is not None:
        runner.enter(unit)


@outside_compiled
def prefetch(pm: ParallelModule, unit: str) -> None:
    """Start gathering ``unit`` (asynchronous; `gather` waits for it): the generated
    forward calls it as it gathers the unit before, so the two can overlap."""
    runner = _runner(pm)
    if runner is not None:
        runner.start(unit)


@outside_compiled
def free(pm: ParallelModule, unit: str) -> None:
    """Drop the values of ``unit``'s parameters (the rank keeps its shard): the generated
    forward calls it after the last statement that reads them, before it moves on to
    another unit. Inside `kept_gathered` the unit stays gathered."""
    runner = _runner(pm)
    if runner is not None:
        runner.leave(unit)
