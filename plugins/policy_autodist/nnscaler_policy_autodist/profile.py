"""Compute time of op parts, measured on this machine's device and cached on disk.

For an op split by a transform (or whole), `ComputeProfiler` runs one part,
forward then backward, on tensors of the part's shapes (random floats, zeros for
integers, ``True`` for masks): two untimed calls, then at least five timed ones, and
keeps their mean without the slowest quarter (`take_samples`, `typical`), subnormal
floats flushed (`flushing_denormals`). On a CPU running one thread per process the
times are CPU time, so another process taking the core is not counted
(`op_clock`); the ranks that share a core in training are (`core_share`).
The cache is a JSON file per device under the profile directory, keyed by op name,
shapes, dtypes, keyword arguments, the split and its number of parts: a second compile
profiles nothing.

An op too large to run here (more than ``max_bytes`` of tensors, or its parameters on
the meta device only) is never run: its time is measured on a part of a split that
shrinks it (the first transform whose outputs are split, in ``m`` parts) and multiplied
by ``m``, its work ratio. A part that cannot run alone (its parts talk to each other)
costs its share of the whole op, and the collectives its parts run are recorded by
calling it once on meta tensors (`ComputeProfiler.collectives`); an op whose
function fails on made-up values gets the
analytic estimate of the device's figures (`analytic_time`). For a named device that is not here
(``device_type='H100'``), every op gets the analytic estimate
(`nnscaler_policy_autodist.analytic`): its work over the device's throughput, or its
bytes over its memory bandwidth, whichever is longer; nothing for an op that returns a
view of its input.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from nnscaler.extend import (
    Op,
    PartGroup,
    Split,
    SubTensor,
    TensorKind,
    Transform,
    check_reduce_op,
    part_piece,
    tensors_in,
)
from nnscaler_policy_autodist.analytic import analytic_time, mark_strided
from nnscaler_policy_autodist.comm import DeviceSpec
from nnscaler_policy_autodist.experts import FFN_PARALLEL, MOE_EXPERTS, expert_part
from nnscaler_policy_autodist.twoaxis import part_call

__all__ = ["ComputeProfiler", "PartCall", "ProfileJob", "RecordingGroup", "TensorSpec",
           "analytic_time", "core_share", "device_key", "flushing_denormals", "measure_adam",
           "op_clock", "run_job", "take_samples", "typical"]

logger = logging.getLogger("nnscaler.autodist.profile")  # under nnscaler's loggers

#: How op times are measured, in the cache's file name: a profile measured another way is
#: not read (2: CPU time on a one-thread CPU, two untimed calls, the slowest quarter dropped).
PROFILE_METHOD = 2

#: The most bytes of tensors one profiled call may hold (inputs and outputs).
MAX_PROFILE_BYTES = 64 * 1024 * 1024

#: The most bytes of tensors (activations, weights, gradients, Adam's states) a whole
#: model may hold for `ComputeProfiler.calibrate` to run it.
MAX_CALIBRATION_BYTES = 1024 * 1024 * 1024


def device_key() -> str:
    """Names this machine's compute device for the cache: the CPU model, threads and the
    processes sharing the node, or the CUDA device name."""
    from nnscaler.extend import device_type

    if device_type() == "cuda":
        return "cuda-" + torch.cuda.get_device_name().replace(" ", "_")
    cpu = platform.processor() or platform.machine()
    # the processes that share this node's cores: four ranks on two cores get half the
    # time of two each, and their op times are measured so (profiling is spread over them)
    return (f"cpu-{cpu}-t{torch.get_num_threads()}-p{_local_processes()}"
            .replace(" ", "_").replace("/", "_"))


def _local_processes() -> int:
    import torch.distributed as dist

    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit():
        return int(local)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def core_share() -> float:
    """Processes (times their threads) per core of this node, at least 1: four one-thread
    ranks on two cores share each core by two. 1 on CUDA, a device per process."""
    from nnscaler.extend import device_type

    if device_type() == "cuda":
        return 1.0
    return max(1.0, _local_processes() * torch.get_num_threads() / (os.cpu_count() or 1))


def _bytes(op: Op) -> int:
    return sum(t.full.dtype.itemsize * math.prod(t.shape)
               for t in (*op.input_tensors(), *op.output_tensors()))


def _grads(op: Op) -> bool:
    return not op.no_grad and any(t.full.requires_grad for t in op.input_tensors())


def _make(spec: TensorSpec, device: torch.device, grad: bool,
          weight: bool = False) -> torch.Tensor:
    """A made-up tensor of ``spec``: standard normal floats; a ``weight`` of two or more
    dims divided by the square root of its last dim (its fan-in, as a linear layer's
    initialisation scales it), so that a chain of layers keeps its values near 1."""
    dtype, shape = spec.dtype, spec.shape
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, dtype=dtype, device=device)
        if weight and len(shape) >= 2 and shape[-1] > 0:
            t /= math.sqrt(shape[-1])
        return t.requires_grad_(grad)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def flushes_denormals() -> bool:
    """Whether this thread's CPU reads and writes subnormal floats as zero now."""
    return float(torch.tensor([1e-40]) * 1.0) == 0.0  # 1e-40 is subnormal in float32


@contextmanager
def flushing_denormals() -> Iterator[None]:
    """Subnormal floats flushed to zero on the CPU (x86's FTZ/DAZ) while measuring; the
    thread's setting is restored after.

    Made-up values chained through a model fall into the subnormal range where trained
    values do not (random weights of unit scale drive attention scores into ``exp``'s
    underflow and backward's gradients towards zero), and every multiply on a subnormal
    takes a slow path: a 4-layer GPT's step on made-up values ran 2.8x slower than on its
    own weights, and its calibration factor came out 2.9 instead of 1.1. With the flush
    (which costs nothing on normal values) the made-up step takes what the real one takes.
    It covers the calling thread; the made-up weights are also scaled by their fan-in
    (`_make`) for the CPU's other threads.
    """
    was = flushes_denormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(was)


class JsonCache:
    """A table of measured figures kept as JSON beside the profile: read when present (an
    unreadable file is ignored, with a warning) and written atomically by `save` when
    something new was measured."""

    path: Path
    _table: dict[str, list[float]]
    _dirty: bool

    def _read_table(self, path: Path, read: bool, what: str) -> None:
        self.path = path
        self._table = {}
        self._dirty = False
        if read and path.is_file():
            try:
                self._table = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                logger.warning("autodist: ignoring the unreadable %s %s (%s)", what, path, e)

    def save(self) -> None:
        """Write the cache (atomically) when something new was measured."""
        if not self._dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self._table, sort_keys=True))
        tmp.replace(self.path)
        self._dirty = False


class ComputeProfiler(JsonCache):
    """Measured (forward, backward) seconds of op parts, cached per device."""

    def __init__(self, spec: DeviceSpec, profile_dir: Path, *, measure: bool = True,
                 max_bytes: int = MAX_PROFILE_BYTES) -> None:
        self.spec = spec
        self.measure = measure
        self.max_bytes = max_bytes
        self.key = f"{device_key()}-m{PROFILE_METHOD}" if measure else f"analytic-{spec.name}"
        self._read_table(Path(profile_dir) / f"compute-{self.key}.json", measure,
                         "profile cache")
        self.profiled = 0  # calls measured by this profiler (not from the cache)
        self._memo: dict[tuple[int, Any, int], tuple[float, float]] = {}
        #: (ops, optimizer): what a whole step of the model takes over the sum of its
        #: parts measured alone (`calibrate`); every time is scaled by it
        self.factors: tuple[float, float] = (1.0, 1.0)
        #: tensors of the program that may not be contiguous (`note_program`): a
        #: reshape of one copies it
        self.strided: frozenset = frozenset()
        #: what the measured times are multiplied by: the processes per core
        #: (`core_share`) where they are CPU time, which does not count sharing (`op_clock`)
        self.clock_share = core_share() if measure and on_cpu_clock() else 1.0

    def note_program(self, ops: Sequence[Op]) -> None:
        """Read ``ops`` (the whole program, in order) for what the analytic estimate
        needs beyond one op: which tensors are strided views (`mark_strided`)."""
        self.strided = mark_strided(ops)

    # -- public ------------------------------------------------------------------------
    def time(self, op: Op, t: Transform | None, num: int) -> tuple[float, float]:
        """(forward, backward) seconds of one part of ``op`` split by ``t`` in ``num``
        parts (``t=None``: the whole op, as every replica runs it), in a step of the
        calibrated model (`calibrate`)."""
        fw, bw = self._raw(op, t, num)
        scale = self.factors[0] * self.clock_share
        return fw * scale, bw * scale

    def _raw(self, op: Op, t: Transform | None, num: int) -> tuple[float, float]:
        memo = (id(op), t, num)
        if memo not in self._memo:
            self._memo[memo] = self._time(op, t, num if t is not None else 1)
        return self._memo[memo]

    # long: the method in the docstring; the code measures once and records the factors
    def calibrate(self, ops: Sequence[Op], outputs: Sequence[Any],
                  max_bytes: int = MAX_CALIBRATION_BYTES) -> tuple[float, float]:
        """Measure the whole model once and scale the op times to it.

        An op timed alone runs with its inputs and weights hot in the caches; in a step
        they were written, or last read, many ops ago. On this project's 2-core machine
        the GPT of the benchmarks steps 1.1-1.3x slower than its ops timed alone add up
        to, and the ratio differs with the model's sizes. So the ops of the unsplit model
        run here in program order on made-up values (forward, then backward from
        ``outputs``; then Adam's step over its weights), and ``factors`` become the
        measured times over the sums of the profiled parts and of `optimizer_time`.
        The model's distinct ops are timed alone again between its runs (`_run_model`),
        and the factor divides by those times: both sides of the ratio then see the
        same load on the machine, wherever its profile was taken earlier.
        Inside a distributed ``parallelize`` the other ranks keep their cores busy
        meanwhile, as in training. The factors are cached per model, with the profile.
        A model larger than ``max_bytes``, one whose ops reject made-up values, and a
        named device that is not here, keep the factors 1.
        """
        if not self.measure:
            return self.factors
        import hashlib

        digest = hashlib.sha1("\n".join(self._key(op.name, op.inputs, dict(op.kwargs), op)
                                        for op in ops).encode()).hexdigest()[:16]
        key = f"calibration|{CALIBRATION_METHOD}|{digest}"
        if key not in self._table:
            parts = sum(fw + (bw if _grads(op) else 0.0)
                        for op in ops for fw, bw in [self._raw(op, None, 1)])
            jobs = {found[0]: found[1] for op in ops
                    for found in [self._job(op, None, 1)] if found is not None}
            weights = {x.full for op in ops for x in op.input_tensors()
                       if x.full.is_leaf and x.full.requires_grad
                       and x.full.kind is not TensorKind.INPUT}
            opt = sum(self._optimizer_raw(w.numel * w.dtype.itemsize) for w in weights)
            # the other ranks keep their cores busy meanwhile, as they do in training
            # (four ranks on two cores run each op at half speed, as their profile says)
            from nnscaler.extend import call_on_every_rank

            got = _too_large(ops, max_bytes)
            if got is None:  # else nothing to run, on any rank
                _HERE["job"] = (ops, outputs, max_bytes, 3, tuple(jobs.values()))
                retiming = sum(_job_seconds(sum(self._table[k])) for k in jobs)
                try:
                    got = call_on_every_rank(_calibration_share,
                                             2 * (4 * (parts + opt) + 3 * retiming))[0]
                finally:
                    _HERE.pop("job", None)
            if isinstance(got, str):
                logger.info("autodist: op times not calibrated on the whole model (%s)", got)
                factors = [1.0, 1.0]
            else:
                alone = self._alone(ops, dict(zip(jobs, got[2])))
                factors = [got[0] / alone if alone > 0 else 1.0,
                           got[1] / opt if opt > 0 and got[1] > 0 else 1.0]
                logger.info("autodist: a step of the model takes %.3g s (its ops timed alone "
                            "meanwhile: %.3g s, in the profile: %.3g s) and Adam's %.3g s "
                            "(estimated %.3g s): op times scaled by %.2f, the optimizer's "
                            "by %.2f", got[0], alone, parts, got[1], opt, *factors)
            self._table[key] = factors
            self._dirty = True
        self.factors = (float(self._table[key][0]), float(self._table[key][1]))
        return self.factors

    def _alone(self, ops: Sequence[Op], timed: dict[str, tuple[float, float] | str]) -> float:
        """The seconds of ``ops`` timed alone, each op by its time in ``timed`` (by cache
        key, times its work ratio) where that has one, else by its profile."""
        total = 0.0
        for op in ops:
            found = self._job(op, None, 1)
            got = timed.get(found[0]) if found is not None else None
            fw, bw = ((got[0] * found[2], got[1] * found[2]) if isinstance(got, tuple)
                      else self._raw(op, None, 1))
            total += fw + (bw if _grads(op) else 0.0)
        return total

    def optimizer_time(self, nbytes: float, opt_state: float = 2.0) -> float:
        """Seconds of the optimizer's step over one parameter of ``nbytes`` on a device
        (its gradient and ``opt_state`` states of the same size). Measured here once:
        ``torch.optim.Adam`` on one large parameter and on many small ones, giving a cost
        per parameter and per byte (scaled to ``opt_state`` states), with the zeroing of
        the gradient's buffer and the accumulation into it (`_adam_seconds`); for a
        named device, memory bound: ``3 + 2 * opt_state`` passes over the bytes."""
        return self._optimizer_raw(nbytes, opt_state) * self.factors[1] * self.clock_share

    def _optimizer_raw(self, nbytes: float, opt_state: float = 2.0) -> float:
        passes = 3 + 2 * opt_state
        if not self.measure:
            return passes * nbytes / self.spec.mem_bw
        key = f"optimizer|{OPTIMIZER_METHOD}|torch.optim.Adam|float32"
        if key not in self._table:
            self._table[key] = list(measure_adam())
            self._dirty = True
        per_param, per_byte = self._table[key]
        return per_param + per_byte * nbytes * passes / (3 + 2 * 2)  # Adam: 2 states

    def prefetch(self, requests: Sequence[tuple[Op, Transform | None, int]]) -> int:
        """Measure every ``(op, t, num)`` of ``requests`` missing from the cache, spread
        over the ranks while rank 0 plans (`nnscaler.parallel.map_over_ranks`: each
        time is then taken while every device computes, as in training); returns how
        many were measured. Later `time` calls find them in the cache."""
        if not self.measure:
            return 0
        jobs: dict[str, tuple[ProfileJob, Op, int]] = {}
        for op, t, num in requests:
            found = self._job(op, t, num if t is not None else 1)
            if found is not None:
                key, job, scale = found
                if key not in self._table and key not in jobs:
                    jobs[key] = (job, op, num * scale)
        if not jobs:
            return 0
        import pickle

        from nnscaler.extend import map_over_ranks

        def travels(job: ProfileJob) -> bool:
            try:
                pickle.dumps(job)
            except Exception:  # noqa: BLE001 - an argument that cannot leave this process
                return False
            return True

        spread = [key for key, (job, _, _) in jobs.items() if travels(job)]
        times = dict(zip(spread, map_over_ranks(run_job, [jobs[k][0] for k in spread])))
        for key, (job, op, parts) in jobs.items():
            got = times[key] if key in times else run_job(job)  # measured here
            self._store(key, job, op, parts, got)
        return len(jobs)

    def collectives(self, op: Op, t: Transform, num: int) -> tuple[PartCall, ...]:
        """The collectives one part of ``op`` split by ``t`` runs when ``t``'s parts talk
        to each other (its rule's ``part_op`` is collective): the part op is called once
        on meta tensors of the part's shapes with a `RecordingGroup`, which notes
        every ``all_reduce`` and ``all_gather``. Empty for other splits."""
        # by content: the instances of a repeated layer, and transforms made anew (a
        # restricted model's), that split the same shapes by the same rule record once
        memo = ("collectives", op.name, repr(op.kwargs),
                tuple((tuple(x.shape), x.dtype) for x in op.input_tensors()),
                t.part_op, repr(t.inputs), repr(t.outputs), num)
        if memo in self._memo:
            return self._memo[memo]  # type: ignore[return-value]
        calls: tuple[PartCall, ...] = ()
        if t.part_op is not None and op.opdef is not None:
            from nnscaler.extend import get_plugin_manager

            part = get_plugin_manager().ops.get(t.part_op)
            if part.collective:
                calls = self._record(op, t, num, part)
        self._memo[memo] = calls  # type: ignore[assignment]
        return calls

    def _record(self, op: Op, t: Transform, num: int, part: Any) -> tuple[PartCall, ...]:
        grads = _grads(op)

        def meta(k: int, x: Any) -> Any:
            if not isinstance(x, SubTensor):
                return x
            piece = part_piece(x, t.inputs[k], num, 0)
            spec = tensor_spec(piece)
            made = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
            return made.requires_grad_(grads and spec.dtype.is_floating_point)

        args = [meta(k, x) for k, x in enumerate(op.inputs)]
        kwargs = dict(op.opdef.part_kwargs(t, op.kwargs, 0))
        group = RecordingGroup(num)
        try:
            with torch.enable_grad() if grads else torch.no_grad():
                part.call(args, {**kwargs, "group": group})
        except Exception as e:  # noqa: BLE001 - a part op without meta kernels
            # its outputs summed once each way: the usual shape of such a part op
            out = sum(math.prod(y.shape) * y.dtype.itemsize for y in tensors_in(op.outputs))
            logger.info("autodist: %s via %s does not run on meta tensors (%s); costing its "
                        "parts' communication as one all-reduce of its output each way",
                        op.name, t.part_op, e)
            return (PartCall("all_reduce", out // max(num, 1), grads),)
        return tuple(group.calls)

    # -- internals ---------------------------------------------------------------------
    def _job(self, op: Op, t: Transform | None, num: int
             ) -> tuple[str, ProfileJob, int] | None:
        """The cache key, the job that measures it and its work ratio (``None``: the op
        cannot run alone, estimate it)."""
        if op.opdef is None or op.anno is None:
            return None
        opdef = op.opdef
        if t is not None and t.part_op is not None:
            from nnscaler.extend import get_plugin_manager

            opdef = get_plugin_manager().ops.get(t.part_op)
        if opdef.collective:
            # a part whose parts talk runs alone only where a stand-in does its work
            # (an expert split's: its local experts on the pairs it receives)
            local = expert_part(op, t, num)
            if local is None:
                return None
            opdef, (inputs, kwargs) = op.opdef, local
        elif t is None:
            inputs, kwargs = list(op.inputs), dict(op.kwargs)
        else:  # part 0 (of a two-axis split too: `twoaxis.part_call`)
            inputs, kwargs = part_call(op, t, num, 0)
        size = _bytes(op) // num
        scale = 1
        if size > self.max_bytes:
            shrunk = self._shrink(op, t, num, inputs, kwargs, size)
            if shrunk is None:
                return None
            inputs, kwargs, scale = shrunk
        job = ProfileJob(op=opdef.name, args=pytree.tree_map(tensor_spec, list(inputs)),
                         kwargs=pytree.tree_map(tensor_spec, kwargs), grads=_grads(op))
        name = opdef.name + ("|routed-evenly" if opdef.name in VALUE_MAKERS else "")
        return self._key(name, inputs, kwargs, op), job, scale

    def _store(self, key: str, job: ProfileJob, op: Op, parts: int,
               got: tuple[float, float] | str) -> None:
        if isinstance(got, str):  # made-up values the op rejects: estimate it
            logger.debug("autodist: cannot profile %s (%s); estimating", job.op, got)
            got = analytic_time(op, self.spec, parts, self.strided)
        self._table[key] = list(got)
        self._dirty = True
        self.profiled += 1

    def _time(self, op: Op, t: Transform | None, num: int) -> tuple[float, float]:
        if not self.measure:
            return analytic_time(op, self.spec, num, self.strided, t)
        found = self._job(op, t, num)
        if found is None:
            if t is not None and op.anno is not None and op.opdef is not None \
                    and not op.opdef.collective:
                # a part that cannot run alone (its parts talk to each other) or cannot
                # be shrunk to fit: the whole op's share
                fw, bw = self._raw(op, None, 1)
                return fw / num, bw / num
            return analytic_time(op, self.spec, num, self.strided)
        key, job, scale = found
        if key not in self._table:
            self._store(key, job, op, num * scale, run_job(job))
        fw, bw = self._table[key]
        return fw * scale, bw * scale

    def _shrink(self, op: Op, t: Transform | None, num: int, inputs: list[Any],
                kwargs: dict[str, Any], size: int
                ) -> tuple[list[Any], dict[str, Any], int] | None:
        """A part of the part that fits: split once more along a dim its outputs keep
        split (no value-partial output), in ``m`` parts; returns it and ``m``."""
        anno = op.anno
        shapes = [tuple(b - a for a, b in x.indmap) if isinstance(x, SubTensor) else None
                  for x in inputs]
        try:
            bound = anno.anno.bind(shapes, kwargs)
        except Exception:  # noqa: BLE001
            return None
        need = max(2, 2 ** math.ceil(math.log2(size / self.max_bytes)))
        rules = op.opdef.rules_for(bound) if t is None or t.part_op is None else ()
        for m in (need, need * 2, need * 4):
            for s in bound.transform_space(m, rules=rules):
                if s.part_op is not None or not all(isinstance(o, Split) for o in s.outputs):
                    continue
                sub = [part_piece(x, s.inputs[k], m, 0) if isinstance(x, SubTensor) else x
                       for k, x in enumerate(inputs)]
                return sub, op.opdef.part_kwargs(s, kwargs, 0), m
        return None

    @staticmethod
    def _key(name: str, inputs: Sequence[Any], kwargs: dict[str, Any], op: Op) -> str:
        def show(x: Any) -> Any:
            if isinstance(x, SubTensor):
                return f"{x.full.dtype}{list(b - a for a, b in x.indmap)}" + (
                    "g" if x.full.requires_grad else "")
            return repr(x)

        leaves = pytree.tree_map(show, (list(inputs), kwargs))
        return f"{name}|{leaves}|{'nograd' if op.no_grad else 'grad'}"


@attrs.frozen
class PartCall:
    """A collective one part of a split runs: ``kind`` (``'all_reduce'``,
    ``'all_gather'``, ``'send_recv'`` or ``'all_to_all'``), the bytes each part contributes, and whether its gradient is
    exchanged in backward too."""

    kind: str
    nbytes: int
    backward: bool


class RecordingGroup(PartGroup):
    """A `PartGroup` of ``size`` parts that computes
    nothing across parts but notes each collective a part op calls (on meta tensors)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.index = 0
        self.calls: list[PartCall] = []

    def _note(self, kind: str, x: torch.Tensor, backward: bool) -> None:
        self.calls.append(PartCall(kind, x.numel() * x.element_size(),
                                   backward and x.requires_grad))

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        check_reduce_op(op)
        self._note("all_reduce", x, op == "sum")
        return x if op == "sum" else x.detach()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._note("all_gather", x, True)
        return x.unsqueeze(0).expand(self.size, *x.shape)

    def send_recv(self, x: torch.Tensor, dst: int, src: int) -> torch.Tensor:
        self._note("send_recv", x, True)
        return x.clone()

    def all_to_all(self, x: torch.Tensor, send_splits: Any, recv_splits: Any) -> torch.Tensor:
        self._note("all_to_all", x, True)
        return x.new_empty((sum(recv_splits), *x.shape[1:])).requires_grad_(x.requires_grad)


@attrs.frozen
class TensorSpec:
    """A tensor to make up for profiling: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def tensor_spec(x: Any) -> Any:
    """A sub-tensor as the shape and dtype a profiling job builds it from; anything else as is."""
    if isinstance(x, SubTensor):
        return TensorSpec(tuple(b - a for a, b in x.indmap), x.full.dtype)
    return x


@attrs.frozen
class ProfileJob:
    """One measurement, as it travels to another rank: the registered op's name, its
    arguments with `TensorSpec` for tensors, and whether gradients flow."""

    op: str
    args: Any
    kwargs: Any
    grads: bool


def _balanced_grouped_mm(args: list[Any], kw: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """``torch._grouped_mm``'s ``offs`` ends every group: zeros would make every group
    empty and the call free. Balanced groups (an even routing of tokens to experts) cost
    what a trained router costs on average."""
    a = args[0]
    b = args[1] if len(args) > 1 else kw.get("mat2")
    offs_in_kw = "offs" in kw
    offs = kw["offs"] if offs_in_kw else (args[2] if len(args) > 2 else None)
    if not isinstance(offs, torch.Tensor) or not isinstance(a, torch.Tensor) \
            or not isinstance(b, torch.Tensor):
        return args, kw
    if a.dim() == 2 and b.dim() == 3:
        length = a.shape[0]
    elif a.dim() == 3 and b.dim() == 2:
        length = b.shape[-1]
    else:
        length = a.shape[-1]
    align = max(1, 16 // a.element_size())
    groups = offs.numel()
    ends = [min(length, (length * (i + 1) // groups) // align * align) for i in range(groups)]
    ends[-1] = length
    balanced = torch.tensor(ends, dtype=offs.dtype, device=offs.device)
    if offs_in_kw:
        return args, {**kw, "offs": balanced}
    return [*args[:2], balanced, *args[3:]], kw


def _even_routing(args: list[Any], kw: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """An MoE op's ``top_k_index`` of zeros sends every token to expert 0: one matmul, and
    nothing for the rest. Pair ``i`` to expert ``i mod E`` instead, the even routing the
    cost model assumes (`nnscaler_policy_autodist.experts`)."""
    if len(args) < 4 or not all(isinstance(a, torch.Tensor) for a in args[:4]):
        return args, kw
    index, experts = args[1], args[3].shape[0]
    even = torch.arange(index.numel(), device=index.device) % max(experts, 1)
    return [args[0], even.view(index.shape).to(index.dtype), *args[2:]], kw


#: Ops whose cost depends on the values of integer arguments (made up as zeros): how to
#: make values of the usual cost from the made-up arguments, by registered op name
#: (their cache keys are marked, so times measured with zeros are not read back).
VALUE_MAKERS: dict[str, Any] = {"torch._grouped_mm": _balanced_grouped_mm,
                                MOE_EXPERTS: _even_routing, FFN_PARALLEL: _even_routing}


def run_job(job: ProfileJob) -> tuple[float, float] | str:
    """Run ``job`` on this rank's device: the (forward, backward) seconds of a few
    calls after a warm-up (`take_samples`, `typical`), subnormal floats flushed
    (`flushing_denormals`); or the error's text when the op rejects made-up values."""
    return _time_job(job)


def op_clock(device: torch.device) -> Callable[[], float]:
    """The clock op times are read from: on a CPU that runs one thread per process, this
    thread's CPU time; else (CUDA, several threads) wall time.

    On a CPU shared with other work, wall time counts what the other processes take from
    the op: under a load of 5-12 on this project's 2 cores, 4-layer GPT ops timed alone
    added up to 0.11-0.54 s from one minute to the next, and a profile measured so
    stays in the cache. An op's CPU time is what it costs with the core to itself; the
    ranks sharing cores in training are counted by `core_share`
    (`ComputeProfiler.time`)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def on_cpu_clock() -> bool:
    """Whether this process's op times are read from its CPU time (`op_clock`)."""
    from nnscaler.extend import device_type

    return device_type() != "cuda" and torch.get_num_threads() == 1


def _time_job(job: ProfileJob) -> tuple[float, float] | str:
    """`run_job`'s measurement, read from `op_clock` (what the calibration calls, on rank
    0 only: it compares the model's run with it on the same clock)."""
    from nnscaler.extend import current_device, device_type, get_plugin_manager

    device = current_device() if device_type() == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    clock = op_clock(device)
    grads = job.grads
    try:
        opdef = get_plugin_manager().ops.get(job.op)

        def build(x: Any) -> Any:
            return _make(x, device, grads) if isinstance(x, TensorSpec) else x

        args = pytree.tree_map(build, job.args)
        kw = pytree.tree_map(build, job.kwargs)
        shape_values = VALUE_MAKERS.get(job.op)
        if shape_values is not None:
            args, kw = shape_values(args, kw)
        leaves = [x for x in pytree.tree_leaves((args, kw))
                  if isinstance(x, torch.Tensor) and x.requires_grad]

        def once() -> tuple[float, float]:
            if cuda:
                torch.cuda.synchronize()
            t0 = clock()
            out = opdef.call(args, kw)
            if cuda:
                torch.cuda.synchronize()
            t1 = clock()
            outs = [o for o in pytree.tree_leaves(out)
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            if not (grads and outs and leaves):
                return t1 - t0, 0.0
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            if cuda:
                torch.cuda.synchronize()
            for x in leaves:
                x.grad = None
            return t1 - t0, clock() - t1

        with flushing_denormals(), torch.no_grad() if not grads else torch.enable_grad():
            samples = take_samples(once)
    except Exception as e:  # noqa: BLE001 - made-up values an op rejects
        return f"{type(e).__name__}: {e}"
    return typical(samples)


#: `take_samples`: calls before timing, timed calls at least and at most, and the
#: seconds of timed calls after which it stops once it has the least number.
WARMUP_CALLS, MIN_SAMPLES, MAX_SAMPLES, SAMPLE_SECONDS = 2, 5, 20, 0.02


def take_samples(once: Callable[[], tuple[float, float]]) -> list[tuple[float, float]]:
    """The (forward, backward) seconds of calls of ``once`` after `WARMUP_CALLS` untimed
    ones: at least `MIN_SAMPLES`, more while they add up to under `SAMPLE_SECONDS`, at
    most `MAX_SAMPLES`.

    The first calls of an op in a process pay once for what later calls reuse (the
    allocator's first blocks, a kernel's lazy set-up, autograd's first graph of the
    shape); a second untimed call covers what the first left half-done."""
    for _ in range(WARMUP_CALLS):
        once()
    samples: list[tuple[float, float]] = []
    spent = 0.0
    while len(samples) < MIN_SAMPLES or (spent < SAMPLE_SECONDS and len(samples) < MAX_SAMPLES):
        fw, bw = once()
        samples.append((fw, bw))
        spent += fw + bw
    return samples


def typical(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The (forward, backward) mean of ``samples`` without their slowest quarter (at least
    one): a call slowed by something else (a page fault, a collection, another process
    taking the core, a first call's set-up) is dropped, while the mean of the rest keeps
    what the op costs when the ranks share the machine as they do in training (spread
    profiling runs on every rank at once; the fastest call alone would miss the time a
    core shared by two ranks spends on the other one)."""
    ranked = sorted(samples, key=lambda x: x[0] + x[1])
    kept = ranked[:max(1, len(ranked) - max(1, len(ranked) // 4))]
    return (sum(x[0] for x in kept) / len(kept), sum(x[1] for x in kept) / len(kept))


#: How `ComputeProfiler.calibrate` measures; factors cached another way are not used.
#: 4: subnormals flushed, weights at their fan-in's scale; 5: the ops re-timed alone in
#: the same window; 6: Adam's step with the gradient buffers' work (`_adam_seconds`)
CALIBRATION_METHOD = 6

#: How `measure_adam` measures (the key of its cached figures): 2, with the zeroing of
#: the gradient buffers and the accumulation into them (`_adam_seconds`)
OPTIMIZER_METHOD = 2

_HERE: dict[str, Any] = {}  # the model this rank calibrates (rank 0's, while it plans)


def _job_seconds(call: float) -> float:
    """About how long `take_samples` takes over an op whose call takes ``call`` seconds."""
    return WARMUP_CALLS * call + max(MIN_SAMPLES * call, min(MAX_SAMPLES * call, SAMPLE_SECONDS))


def _calibration_share(seconds: float) -> tuple[float, float, list] | str | None:
    """Rank 0 runs the model it calibrates (`_run_model`); every other rank keeps
    its core busy with matmuls for about ``seconds``, as it would in training."""
    job = _HERE.pop("job", None)
    if job is not None:
        return _run_model(*job)
    work = torch.randn(192, 192)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        work @ work
    return None


def _too_large(ops: Sequence[Op], max_bytes: int) -> str | None:
    """Why running ``ops`` whole would hold more than ``max_bytes`` (its activations, and
    its weights with their gradients and Adam's states), or ``None``."""
    held = 0
    for op in ops:
        for x in (*op.input_tensors(), *op.output_tensors()):
            n = x.full.numel * x.full.dtype.itemsize
            held += 4 * n if x.full.is_leaf and x.full.requires_grad else n
    if held <= max_bytes:
        return None
    return (f"it holds about {held / 2**20:.0f} MiB, more than the "
            f"{max_bytes / 2**20:.0f} MiB allowed for calibration")


def _run_model(ops: Sequence[Op], outputs: Sequence[Any], max_bytes: int,
               repeat: int = 3, alone: Sequence[ProfileJob] = ()
               ) -> tuple[float, float, list[tuple[float, float] | str]] | str:
    """(seconds of forward and backward, seconds of Adam's step, the times of ``alone``)
    of running ``ops`` in order on made-up leaves (random floats, weights scaled by their
    fan-in, zeros for integers, ``True`` for masks; subnormal results flushed,
    `flushing_denormals`), each the median of ``repeat`` runs after a warm-up; or why it
    cannot run. The jobs of ``alone`` (the model's ops, to be timed alone in the same
    window) are timed after each run, each its median over the runs (`_time_job`; the
    error's text where one fails)."""
    import statistics

    from nnscaler.extend import FullTensor, current_device, device_type, release_schedule, run_ops

    device = current_device() if device_type() == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    clock = op_clock(device)
    too_large = _too_large(ops, max_bytes)
    if too_large is not None:
        return too_large
    leaves: dict[Any, torch.Tensor] = {}
    for op in ops:
        for x in op.input_tensors():
            f = x.full
            if f.is_leaf and f not in leaves:
                if f.kind is TensorKind.CONSTANT and f.value is not None:
                    leaves[f] = f.value.to(device)
                else:  # weights at their fan-in's scale, as initialised
                    leaves[f] = _make(TensorSpec(tuple(f.shape), f.dtype), device,
                                      f.requires_grad, weight=f.kind is not TensorKind.INPUT)
    weights = [v for f, v in leaves.items()
               if v.requires_grad and f.kind is not TensorKind.INPUT]
    ends = {x.full if isinstance(x, SubTensor) else x for x in outputs}
    release = release_schedule(ops, [f for f in ends if isinstance(f, FullTensor)])

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def once() -> float:
        env: dict[Any, Any] = dict(leaves)
        for v in leaves.values():
            v.grad = None  # as an optimizer's zero_grad leaves them: fresh each step
        sync()
        t0 = clock()
        run_ops(ops, env, device, release=release)  # intermediates freed as generated code does
        outs = [env[f] for f in ends if isinstance(env.get(f), torch.Tensor)
                and env[f].requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        sync()
        return clock() - t0

    try:
        with flushing_denormals(), torch.enable_grad():
            once()
            steps, rounds = [], []
            for _ in range(repeat):  # the ops alone after each run: under the same load
                steps.append(once())
                rounds.append([_time_job(job) for job in alone])
            opt_time = _adam_seconds(weights, repeat) if weights else 0.0
    except Exception as e:  # noqa: BLE001 - made-up values an op rejects
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return statistics.median(steps), opt_time, [_median_pair(r) for r in zip(*rounds)]


def _median_pair(times: Sequence[tuple[float, float] | str]) -> tuple[float, float] | str:
    """The median forward and backward of ``times``, or the first error among them."""
    import statistics

    errors = [x for x in times if isinstance(x, str)]
    if errors:
        return errors[0]
    return (statistics.median(x[0] for x in times), statistics.median(x[1] for x in times))


def _adam_seconds(params: list[torch.Tensor], steps: int) -> float:
    """The median seconds of ``steps`` steps of ``torch.optim.Adam`` over ``params``
    (made-up gradients; after a first step that creates the states), each with the work
    the runtime does on every weight's gradient in a step besides the op that computes
    it: the gradient stays in its buffer (a reducer's), which ``zero_grad`` zeroes and
    backward adds the new gradient to (`nnscaler.runtime.reducer`), two passes over its
    bytes that neither backward timed alone nor Adam's step include. On this project's
    2-core machine they were 1.6 of a 22 ms step of the MLP of bench_quality.py at
    ``plan_ngpus=2`` (``aten::fill_`` and ``AccumulateGrad`` in torch's profiler)."""
    import statistics

    cuda = params[0].device.type == "cuda"
    clock = op_clock(params[0].device)
    fresh = [torch.randn_like(p) for p in params]  # what backward computes
    for p in params:
        p.grad = torch.zeros_like(p)  # the gradient buffer
    opt = torch.optim.Adam(params, lr=1e-6)
    opt.step()
    samples = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = clock()
        for p, g in zip(params, fresh):
            p.grad.zero_()
            p.grad.add_(g)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        samples.append(clock() - t0)
    return statistics.median(samples)


def measure_adam(large: int = 1 << 20, many: int = 8, small: int = 256, count: int = 64,
                 steps: int = 3) -> tuple[float, float]:
    """(seconds per parameter, seconds per byte) of ``torch.optim.Adam``'s step here:
    per byte on ``many`` parameters of ``large`` elements (states far larger than the
    caches, as a model's are), per parameter on ``count`` tiny ones; the median of
    ``steps`` steps each."""
    from nnscaler.extend import current_device, device_type

    device = current_device() if device_type() == "cuda" else torch.device("cpu")

    tiny = _adam_seconds([torch.zeros(small, device=device, requires_grad=True)
                          for _ in range(count)], steps)
    big = _adam_seconds([torch.zeros(large, device=device, requires_grad=True)
                         for _ in range(many)], steps)
    per_byte_big = big / (4 * large * many)
    per_param = max(tiny - count * small * 4 * per_byte_big, 0.0) / count
    per_byte = max(big - many * per_param, 0.0) / (4 * large * many)
    return per_param, per_byte


def tensors_of(op: Op) -> list[SubTensor]:
    """Every tensor ``op`` reads or writes (for memory)."""
    return [*tensors_in(op.inputs), *tensors_in(dict(op.kwargs)), *op.output_tensors()]
