"""The pipeline executor: runs a rank's schedule over the stage functions of its module.

A pipelined ``GenModel`` (see ``docs/pipeline.md``) holds one method per pipeline stage
its device runs, ``_stage_{s}(self, sample, *received)``: the stage's ops on this
device's pieces; it returns the pieces this device sends to stage ``s + 1`` (a tuple), or,
for the last stage, the module's outputs. Its class attribute ``pipeline`` (a
`Pipeline`) says which stages this rank runs, what each stage receives and sends
(`Piece`: name, shape, dtype, whether a gradient comes back) and the action list
of this rank (``schedule``, from `nnscaler.schedule`).

`train_step` runs the action list in order:

- ``Forward(m, s)``: the stage function on micro-batch ``m`` (its inputs received, or the
  sample for stage 0); the outputs are kept for the backward. On the last stage the
  first output is the loss (``is_dummy_batch`` multiplies it by zero, ``scale_fn`` scales
  it) and the outputs of the micro-batch are recorded, detached;
- ``Backward(m, s)``: ``torch.autograd.backward`` on the stage's outputs with the received
  output gradients (the last stage: on the loss, seeded with 1 on every rank of the
  stage, ``boundary.output`` keeping it once); the gradients of the received inputs are
  kept to be sent (zeros for an input no gradient reached);
- sends and receives: a maximal run of consecutive messages is one group, posted with
  one ``torch.distributed.batch_isend_irecv`` (the communication model of
  ``docs/schedules.md``). The receives are waited for at once; the sends complete in the
  background and are waited for before the next group is posted (a runtime may wait for
  less than the model says: no device ever waits longer, so a schedule the simulator
  accepts still cannot deadlock). A message carries this device's pieces of the stage's
  boundary tensors; device ``i`` of a stage's devices exchanges with device ``i`` of the
  neighbouring stage's (its *lane*).

Gradients accumulate over the micro-batches and are summed over holders by
[`sync_grad`][nnscaler.ParallelModule.sync_grad] afterwards; during the schedule the
reducers only accumulate (``no_sync``), so the asynchronous reducer's collectives never
interleave with the pipeline's messages. At the end, the outputs of every micro-batch go
from the last stage to every rank of the scale unit.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from nnscaler.errors import PipelineError
from nnscaler.runtime.module import ParallelModule, first_output
from nnscaler.schedule.actions import (
    Action,
    Backward,
    Comm,
    Forward,
    RecvAct,
    RecvGrad,
    SendAct,
    SendGrad,
)

__all__ = [
    "Backward",
    "Forward",
    "Piece",
    "Pipeline",
    "PipelineError",
    "RecvAct",
    "RecvGrad",
    "SendAct",
    "SendGrad",
    "TimelineEntry",
    "anchored",
    "forward_only",
    "infer_step",
    "parse_schedule",
    "timeline",
    "train_step",
]

#: Tags of pipeline messages start here (adapters use small tags on their own pairs).
_TAG_BASE = 1 << 20


@attrs.frozen
class TimelineEntry:
    """One forward, backward or message group as this rank ran it (``perf_counter``
    seconds): ``kind`` is ``'forward'``, ``'backward'`` or ``'comm'``; ``what`` the
    action(s), as ``str`` writes them."""

    kind: str
    what: str
    start: float
    end: float


_timelines: list[list[TimelineEntry]] = []


@contextlib.contextmanager
def timeline() -> Iterator[list[TimelineEntry]]:
    """Record what the pipeline runs on this rank inside the block (for measurements:
    the idle time of a rank is the step time less its forwards and backwards)::

        with pipeline.timeline() as entries:
            module.train_step(samples)
        busy = sum(e.end - e.start for e in entries if e.kind != "comm")
    """
    entries: list[TimelineEntry] = []
    _timelines.append(entries)
    try:
        yield entries
    finally:
        _timelines.remove(entries)


@attrs.frozen
class Piece:
    """This device's piece of one tensor that crosses a stage boundary: the variable
    ``name`` in the generated code, its ``shape`` and ``dtype``, and whether its gradient
    travels back (``grad``)."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(n) for n in s))
    dtype: torch.dtype = torch.float32
    grad: bool = False


@attrs.frozen(kw_only=True)
class Pipeline:
    """What one rank runs of a pipeline (a generated class attribute).

    - ``scheduler``, ``nstages`` (pipeline devices), ``nvirtual`` (stages per device),
      ``nmicros``: the schedule's name and sizes; there are ``nstages * nvirtual`` stages;
    - ``stages``: the stages this rank runs, in model order;
    - ``stage_ranks``: for every stage, the rank that runs it on this rank's lane (the
      peer of each message);
    - ``inputs`` / ``outputs``: per stage of this rank, the pieces it receives from the
      previous stage / sends to the next one, in message order;
    - ``output_rank``: the rank of this scale unit that gives the module's outputs to
      the others; ``unit_ranks``: the ranks of this scale unit;
    - ``schedule``: this rank's actions.
    """

    scheduler: str
    nstages: int
    nvirtual: int
    nmicros: int
    stages: tuple[int, ...] = attrs.field(converter=tuple)
    stage_ranks: tuple[int, ...] = attrs.field(converter=tuple)
    inputs: Mapping[int, tuple[Piece, ...]]
    outputs: Mapping[int, tuple[Piece, ...]]
    output_rank: int
    unit_ranks: tuple[int, ...] = attrs.field(converter=tuple)
    schedule: tuple[Action, ...] = attrs.field(converter=tuple)

    @property
    def nstages_total(self) -> int:
        return self.nstages * self.nvirtual

    @property
    def last(self) -> int:
        return self.nstages_total - 1


# -- the schedule in generated code -------------------------------------------------------
_COMM_LABELS: dict[str, type[Comm]] = {
    "SEND_ACT": SendAct, "RECV_ACT": RecvAct, "SEND_GRAD": SendGrad, "RECV_GRAD": RecvGrad,
}


def _parse_action(text: str) -> Action:
    words = text.split()
    try:
        if len(words) == 1 and words[0][:1] in ("F", "B") and "@s" in words[0]:
            micro, stage = words[0][1:].split("@s")
            cls: type[Action] = Forward if words[0][0] == "F" else Backward
            return cls(micro=int(micro), stage=int(stage))
        if len(words) == 3 and words[0] in _COMM_LABELS:
            src, dst = (int(x.removeprefix("s")) for x in words[2].split("->"))
            comm = _COMM_LABELS[words[0]]
            stage = src if comm.is_send else dst
            action = comm(micro=int(words[1]), stage=stage)
            if (action.src, action.dst) == (src, dst):
                return action
    except ValueError:
        pass
    raise PipelineError(
        f"cannot read the schedule action {text!r}: actions are written as str() writes "
        f"them ('F3@s1', 'B3@s1', 'SEND_ACT 3 s1->s2', 'RECV_ACT 3 s1->s2', "
        f"'SEND_GRAD 3 s2->s1', 'RECV_GRAD 3 s2->s1'); generate the file again"
    )


def parse_schedule(text: str) -> tuple[Action, ...]:
    """The actions of ``text``: one group per line, actions separated by commas, each
    written as ``str(action)`` writes it (``F0@s1``, ``SEND_ACT 0 s1->s2``)."""
    out = []
    for line in text.splitlines():
        for item in line.split(","):
            if item.strip():
                out.append(_parse_action(item.strip()))
    return tuple(out)


def schedule_lines(actions: Sequence[Action]) -> list[str]:
    """``actions`` as `parse_schedule` reads them: each forward and backward on its
    own line, each group of consecutive messages on one line."""
    lines: list[str] = []
    group: list[str] = []
    for a in actions:
        if isinstance(a, Comm):
            group.append(str(a))
            continue
        if group:
            lines.append(", ".join(group))
            group = []
        lines.append(str(a))
    if group:
        lines.append(", ".join(group))
    return lines


def forward_only(stages: Sequence[int], nstages: int, nmicros: int,
                 nvirtual: int = 1) -> list[Action]:
    """The actions of an inference pass on the device holding ``stages``: micro-batch by
    micro-batch, each through all of this device's stages in model order (receive,
    forward, send). Every device follows the one sequential order, so it cannot
    deadlock."""
    last = nstages * nvirtual - 1
    out: list[Action] = []
    for m in range(nmicros):
        for s in stages:
            if s > 0 and nstages > 1:
                out.append(RecvAct(micro=m, stage=s))
            out.append(Forward(micro=m, stage=s))
            if s < last and nstages > 1:
                out.append(SendAct(micro=m, stage=s))
    return out


# -- generated code's helper --------------------------------------------------------------
class _Anchored(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.anchors = [(a.shape, a.dtype, a.device) for a in anchors]
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        zeros = [torch.zeros(shape, dtype=dtype, device=device)
                 for shape, dtype, device in ctx.anchors]
        return (g, *zeros)


def anchored(t: torch.Tensor, anchors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A stage output that carries ``anchors``: identity forward; its backward also gives
    zero gradients to ``anchors`` (tensors of this rank that only send inside the stage,
    so that their backward, which receives the real gradient, runs here too)."""
    live = [a for a in anchors if isinstance(a, torch.Tensor) and a.requires_grad]
    if not live or not torch.is_grad_enabled() or not t.requires_grad:
        return t
    return _Anchored.apply(t, *live)


# -- running a schedule ---------------------------------------------------------------------
def _tag(action: Comm, nstages_total: int, k: int) -> int:
    message = (action.micro * nstages_total + action.src) * 2 + int(action.is_grad)
    return _TAG_BASE + message * 256 + k


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


class _Run:
    """One pass of a rank's action list over a list of micro-batches."""

    def __init__(self, module: ParallelModule, spec: Pipeline, samples: list[Any], *,
                 train: bool, dummy: Sequence[bool] | None = None,
                 scale_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.module = module
        self.spec = spec
        self.samples = samples
        self.train = train
        self.dummy = dummy
        self.scale_fn = scale_fn
        self.device = module.device
        self.inputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.outputs: dict[tuple[int, int], tuple[Any, ...]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.out_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.in_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.results: dict[int, Any] = {}
        self.fns = {s: getattr(module, f"_stage_{s}") for s in spec.stages}
        self.sending: list[tuple[Any, torch.Tensor]] = []  # sends in flight, their tensors
        # ZeRO stage 3: each stage's last backward of the step reduce-scatters
        self.last_backward = {(a.micro, a.stage) for a in
                              {a.stage: a for a in spec.schedule if isinstance(a, Backward)}.values()}

    def wait_sends(self) -> None:
        for work, _ in self.sending:
            work.wait()
        self.sending.clear()

    def run(self, actions: Sequence[Action]) -> None:
        record = _timelines[-1] if _timelines else None
        i = 0
        while i < len(actions):
            start = time.perf_counter() if record is not None else 0.0
            if isinstance(actions[i], Comm):
                j = i
                while j < len(actions) and isinstance(actions[j], Comm):
                    j += 1
                self.communicate(actions[i:j])  # type: ignore[arg-type]
                if record is not None:
                    what = ", ".join(str(a) for a in actions[i:j])
                    record.append(TimelineEntry("comm", what, start, time.perf_counter()))
                i = j
                continue
            action = actions[i]
            if isinstance(action, Forward):
                self.forward(action.micro, action.stage)
            elif isinstance(action, Backward):
                self.backward_step(action.micro, action.stage)
            else:
                raise PipelineError(f"unknown pipeline action {action!r}")
            if record is not None:
                kind = "forward" if isinstance(action, Forward) else "backward"
                record.append(TimelineEntry(kind, str(action), start, time.perf_counter()))
            i += 1
        self.wait_sends()

    # -- compute ------------------------------------------------------------------------
    def _stage_inputs(self, m: int, s: int) -> list[torch.Tensor]:
        key = (m, s)
        if s == 0:
            return []
        if key not in self.inputs and (m, s - 1) in self.outputs:  # same device: hand over
            grads = [p.grad and self.train for p in self.spec.inputs.get(s, ())]
            self.inputs[key] = [t.detach().requires_grad_(g) for t, g in
                                zip(self.outputs[(m, s - 1)], grads, strict=True)]
        if key not in self.inputs:
            raise PipelineError(
                f"rank {self.module.rank}: the schedule runs {Forward(micro=m, stage=s)} "
                f"before the input of stage {s} for micro-batch {m} was received; the "
                f"schedule must receive it first (check it with nnscaler.schedule.simulate)"
            )
        return self.inputs[key]

    def forward(self, m: int, s: int) -> None:
        inputs = self._stage_inputs(m, s)
        zero3 = self.module._zero3  # stage 3: units gathered as the stage reads them
        with zero3.forward() if zero3 is not None else contextlib.nullcontext():
            out = self.fns[s](self.samples[m], *inputs)
        if s != self.spec.last:
            if not isinstance(out, tuple):
                raise PipelineError(f"_stage_{s} must return a tuple of the pieces it sends, "
                                    f"got {type(out).__name__}; generate the file again")
            self.outputs[(m, s)] = out
            if not self.train:
                self.inputs.pop((m, s), None)
            return
        self.results[m] = pytree.tree_map(_detach, out)
        if self.train:
            loss = first_output(out)
            if self.dummy is not None and self.dummy[m]:
                loss = loss * 0.0
            if self.scale_fn is not None:
                loss = self.scale_fn(loss)
            self.losses[m] = loss
        else:
            self.inputs.pop((m, s), None)

    def backward_step(self, m: int, s: int) -> None:
        """`backward`; with ZeRO stage 3 the gradients stay whole (no_sync) until the
        stage's last micro-batch, whose backward reduce-scatters them, and the units the
        backward gathered are freed after it."""
        zero3 = self.module._zero3
        if zero3 is None:
            self.backward(m, s)
            return
        with contextlib.ExitStack() as stack:
            if (m, s) in self.last_backward:  # a stage-2 reducer of a stage-3 module
                for r in self.module.reducers:  # spans stages: it waits for sync_grad
                    if r.stage >= 3:
                        stack.enter_context(r.syncing())
            self.backward(m, s)
        zero3.end_backward()

    def backward(self, m: int, s: int) -> None:
        key = (m, s)
        if s == self.spec.last:
            loss = self.losses.pop(m)
            if loss.requires_grad:
                torch.autograd.backward([loss])
        else:
            if key not in self.out_grads and (m, s + 1) in self.in_grads:  # same device
                self.out_grads[key] = self.in_grads.pop((m, s + 1))
            outs = self.outputs.pop(key)
            pieces = self.spec.outputs.get(s, ())
            if key not in self.out_grads and any(p.grad for p in pieces):
                raise PipelineError(
                    f"rank {self.module.rank}: the schedule runs {Backward(micro=m, stage=s)} "
                    f"before the gradient of stage {s}'s outputs for micro-batch {m} was "
                    f"received; the schedule must receive it first (check it with "
                    f"nnscaler.schedule.simulate)"
                )
            grads = iter(self.out_grads.pop(key, []))
            roots, seeds = [], []
            for t, piece in zip(outs, pieces, strict=True):
                if not piece.grad:
                    continue
                g = next(grads)
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    roots.append(t)
                    seeds.append(g)
            if roots:
                torch.autograd.backward(roots, seeds)
        inputs = self.inputs.pop(key, [])
        if s == 0:
            return
        pieces_in = self.spec.inputs.get(s, ())
        self.in_grads[key] = [
            x.grad if x.grad is not None else torch.zeros_like(x)
            for x, piece in zip(inputs, pieces_in, strict=True) if piece.grad
        ]

    # -- messages -----------------------------------------------------------------------
    def communicate(self, group: Sequence[Comm]) -> None:
        spec = self.spec
        ops: list[dist.P2POp] = []
        received: list[tuple[Comm, list[torch.Tensor]]] = []
        total = spec.nstages_total
        for action in group:
            peer = spec.stage_ranks[action.peer_stage]
            key = (action.micro, action.stage)
            if action.is_send:
                if action.is_grad:
                    tensors = self.in_grads.pop(key)
                else:
                    pieces = spec.outputs.get(action.stage, ())
                    tensors = [t.detach() for t in self.outputs[key]]
                    if not self.train:
                        self.outputs.pop(key)
                    if len(tensors) != len(pieces):
                        raise PipelineError(
                            f"_stage_{action.stage} returned {len(tensors)} tensors but sends "
                            f"{len(pieces)}; generate the file again")
                for k, t in enumerate(tensors):
                    ops.append(dist.P2POp(dist.isend, t.contiguous(), peer,
                                          tag=_tag(action, total, k)))
            else:
                if action.is_grad:
                    pieces = tuple(p for p in spec.outputs.get(action.stage, ()) if p.grad)
                else:
                    pieces = spec.inputs.get(action.stage, ())
                bufs = [torch.empty(p.shape, dtype=p.dtype, device=self.device) for p in pieces]
                for k, t in enumerate(bufs):
                    ops.append(dist.P2POp(dist.irecv, t, peer, tag=_tag(action, total, k)))
                received.append((action, bufs))
        self.wait_sends()
        if ops:
            works = dist.batch_isend_irecv(ops)
            if len(works) != len(ops):  # one work for the whole group: wait for all of it
                for work in works:
                    work.wait()
            else:
                for op, work in zip(ops, works, strict=True):
                    if op.op is dist.isend:  # waited for before the next group is posted
                        self.sending.append((work, op.tensor))
                    else:
                        work.wait()
        for action, bufs in received:
            key = (action.micro, action.stage)
            if action.is_grad:
                self.out_grads[key] = bufs
            else:
                pieces = spec.inputs.get(action.stage, ())
                self.inputs[key] = [b.requires_grad_(p.grad and self.train)
                                    for b, p in zip(bufs, pieces, strict=True)]


def _share_results(module: ParallelModule, spec: Pipeline, results: dict[int, Any],
                   nmicros: int) -> list[Any]:
    """Every micro-batch's outputs on every rank of the scale unit (from ``output_rank``)."""
    rank = module.rank
    mine = [results.get(m) for m in range(nmicros)]
    if len(spec.unit_ranks) == 1 or not (dist.is_available() and dist.is_initialized()):
        return mine
    from nnscaler.runtime.groups import get_group

    src = spec.output_rank
    box: list[Any] = [None]
    if rank == src:
        box[0] = pytree.tree_map(
            lambda x: x.to("cpu") if isinstance(x, torch.Tensor) else x, mine)
    dist.broadcast_object_list(box, src=src, group=get_group(spec.unit_ranks))
    if rank == src or spec.last in spec.stages:
        return mine
    device = module.device
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, box[0])


def _spec(module: ParallelModule) -> Pipeline:
    spec = type(module).pipeline
    if not isinstance(spec, Pipeline):
        raise PipelineError(f"{type(module).__qualname__} has no pipeline; it runs without "
                            f"nnscaler.runtime.pipeline")
    return spec


def _check_samples(module: ParallelModule, samples: list[Any]) -> None:
    """Every micro-batch against the traced sample, on every rank, before any stage sends
    or receives (the generated ``_check_inputs``; see ``boundary.check_inputs``)."""
    check = getattr(module, "_check_inputs", None)
    if check is not None:
        for sample in samples:
            check(sample)


def train_step(module: ParallelModule, samples: Sequence[Any],
               is_dummy_batch: Sequence[bool] | None = None,
               scale_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[Any]:
    """One training step of a pipelined module: ``samples`` are the micro-batches (as
    many as ``pipeline.nmicros``). Zeroes the gradients, runs this rank's schedule, and
    returns the detached outputs of every micro-batch (on every rank of the unit)."""
    spec = _spec(module)
    samples = list(samples)
    name = type(module).__qualname__
    if len(samples) != spec.nmicros:
        raise PipelineError(
            f"{name}.train_step: a pipelined module runs its schedule over exactly "
            f"pipeline_nmicros={spec.nmicros} micro-batches per step, but got "
            f"{len(samples)} samples. Pass a list of {spec.nmicros} micro-batches, or "
            f"parallelize again with pas_config['pipeline_nmicros']={len(samples)}"
        )
    if is_dummy_batch is not None and len(is_dummy_batch) != len(samples):
        raise PipelineError(
            f"{name}.train_step: is_dummy_batch has {len(is_dummy_batch)} entries for "
            f"{len(samples)} samples; give one flag per sample"
        )
    _check_samples(module, samples)
    module.zero_grad()
    run = _Run(module, spec, samples, train=True, dummy=is_dummy_batch, scale_fn=scale_fn)
    with module.no_sync() if not module.inference_only else contextlib.nullcontext():
        run.run(spec.schedule)
    return _share_results(module, spec, run.results, len(samples))


def infer_step(module: ParallelModule, samples: Sequence[Any]) -> list[Any]:
    """Forward of every sample through the pipeline without gradients (any number of
    samples: micro-batch by micro-batch); returns the outputs on every rank of the unit."""
    spec = _spec(module)
    samples = list(samples)
    if not samples:
        return []
    _check_samples(module, samples)
    actions = forward_only(spec.stages, spec.nstages, len(samples), spec.nvirtual)
    run = _Run(module, spec, samples, train=False)
    with torch.no_grad():
        run.run(actions)
    return _share_results(module, spec, run.results, len(samples))
