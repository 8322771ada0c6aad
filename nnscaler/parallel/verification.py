"""``nnscaler.verify``: run a plan and its single-device model side by side, op by op.

``verify(module, dummy_forward_args, pas_policy, compute_config)`` answers "does this plan
train like one device?" and, when it does not, "where does it first go wrong?":

1. it traces the module and plans it exactly as [`parallelize`][nnscaler.parallelize] does, and
   writes the generated files into a temporary folder;
2. the *reference*: the traced graph runs op by op on one device
   (`nnscaler.ir.leaf_values`, ``Op.call``), keeping every op's output and, after
   backward, the gradient that reached it;
3. the *parallel run*: every runtime rank loads its real ``gencode{rank}.py`` and runs
   one forward and backward (``train_step`` for end2end modules, the pipeline schedule
   for pipelined ones). A trace function on the generated methods (``sys.settrace``, no
   change to the generated code) keeps the value of every local variable when it is
   assigned, and its gradient after backward. ``Program.variables`` says which op
   output each variable holds, and the op instance says which piece (index ranges and
   value part) of the full tensor it is;
4. the comparison, in program order: every piece of every op output against the
   reference over the piece's ranges (value-partial pieces summed with their sibling
   parts first), then, in backward order, every gradient. The first difference is
   reported with the op, its source line, the layouts on both sides and the size of the
   difference.

The ranks are this process group's when ``torch.distributed`` is initialised (run under
torchrun with ``runtime_ngpus`` processes); otherwise ``verify`` starts
``runtime_ngpus`` CPU processes with gloo itself (forked; POSIX only).

Pipelined plans run ``pipeline_nmicros`` copies of the sample; every micro-batch is
compared with the one reference. Random ops (dropout) draw different numbers on
different devices and are reported as differences; verify with dropout off.
"""

from __future__ import annotations

import copy
import inspect
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from nnscaler.errors import NNScalerError
from nnscaler.parallel.config import ComputeConfig
from nnscaler.testing import free_port

__all__ = ["Difference", "VerifyError", "VerifyReport", "verify"]

#: Default tolerances: the project's parity standard for float32.
RTOL, ATOL = 1e-5, 1e-6


class VerifyError(NNScalerError, RuntimeError):
    """``verify`` could not run the comparison (a rank failed, a bad argument)."""


@attrs.frozen(kw_only=True)
class Difference:
    """The first place where the parallel program and the reference disagree."""

    #: ``"output"`` (forward value), ``"gradient"`` (the gradient reaching a tensor) or
    #: ``"parameter gradient"`` (after the reducers; ``tensor`` is the parameter's name)
    kind: str
    #: the op's name (``torch.nn.functional.linear``, ``mylib.row_norm``)
    op: str
    #: ``file:line`` of the model code that called the op
    source: str
    #: that line's code
    code: str
    #: the module path of the call (``gpt.blocks.0.attn``)
    module_path: str
    #: the full tensor (``t12``) and which output of the op it is
    tensor: str
    output_index: int
    #: the ops that read the tensor (for a gradient: their backward sent it)
    consumers: tuple[str, ...]
    #: the reference side: ``f32[4, 8] on one device``
    reference_layout: str
    #: every rank's piece of the tensor, e.g. ``rank 0: [0:2, 0:8]``
    parallel_layout: tuple[str, ...]
    #: where the difference was seen: rank, micro-batch, the piece's ranges
    rank: int
    micro_batch: int
    piece: str
    max_abs_diff: float
    max_rel_diff: float
    #: the index (in the full tensor) of the largest difference, and both values there
    at: tuple[int, ...]
    expected: float
    got: float

    def __str__(self) -> str:
        if self.kind == "parameter gradient":
            what = f"the gradient of parameter {self.tensor}, read by"
        else:
            what = ("the output" if self.kind == "output"
                    else "the gradient reaching output") + f" {self.output_index} ({self.tensor})"
            what += " of"
        lines = [
            f"first difference: {what} op {self.op}",
            f"  at {self.source}  {self.code}".rstrip(),
            f"  in module {self.module_path or '<root>'}",
        ]
        if self.kind == "gradient" and self.consumers:
            lines.append("  sent back by the backward of: " + "; ".join(self.consumers))
        lines += [
            f"  reference: {self.reference_layout}",
            "  parallel:  " + "; ".join(self.parallel_layout),
            f"  rank {self.rank}, micro-batch {self.micro_batch}, piece {self.piece}: max abs "
            f"difference {self.max_abs_diff:.3e} (relative {self.max_rel_diff:.3e}) at "
            f"{list(self.at)}: expected {self.expected:.6g}, got {self.got:.6g}",
        ]
        return "\n".join(lines)


@attrs.frozen(kw_only=True)
class VerifyReport:
    """What [`verify`][nnscaler.verify] found: ``equal`` or the `first` difference."""

    equal: bool
    first: Difference | None
    policy: str
    plan_ngpus: int
    runtime_ngpus: int
    #: op outputs and gradients compared (pieces, over every rank and micro-batch)
    compared_outputs: int
    compared_gradients: int
    #: parameter pieces whose gradients were compared after the reducers (none with ZeRO)
    compared_parameter_gradients: int
    #: op outputs with a reference value that no generated variable held (not compared)
    unrecorded: tuple[str, ...]
    rtol: float
    atol: float
    seconds: float

    def __str__(self) -> str:
        head = (f"nnscaler verify: policy {self.policy!r}, plan_ngpus={self.plan_ngpus}, "
                f"runtime_ngpus={self.runtime_ngpus}: ")
        counts = (f"{self.compared_outputs} op output pieces, {self.compared_gradients} "
                  f"gradient pieces and {self.compared_parameter_gradients} parameter "
                  f"gradients compared (rtol={self.rtol:g}, atol={self.atol:g}, "
                  f"{self.seconds:.1f} s)")
        if self.unrecorded:
            counts += (f"; {len(self.unrecorded)} op outputs not held in a variable of the "
                       f"generated code were not compared: {', '.join(self.unrecorded[:8])}")
        if self.equal:
            return head + "equal within tolerance; " + counts
        return head + "DIFFERENT; " + counts + "\n" + str(self.first)


# -- the reference ------------------------------------------------------------------------


def _fresh(tree: Any) -> Any:
    def copy_leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        return x

    return pytree.tree_map(copy_leaf, tree)


def _first_tensor(out: Any) -> torch.Tensor | None:
    """The loss of an end2end module: the first output, as ``train_step`` takes it."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(out, dict) and out:
        first = next(iter(out.values()))
        return first if isinstance(first, torch.Tensor) else None
    return None


def _backward(out: Any, end2end: bool) -> None:
    """Backward from the loss (end2end) or from the sum of every output (otherwise)."""
    if end2end:
        loss = _first_tensor(out)
        roots = [loss] if loss is not None and loss.requires_grad else []
    else:
        roots = [t.float().sum() for t in pytree.tree_leaves(out)
                 if isinstance(t, torch.Tensor) and t.requires_grad]
    if roots:
        torch.stack([r.reshape(()) for r in roots]).sum().backward()


def _reference(graph: Any, state: Mapping[str, torch.Tensor], args: Mapping[str, Any],
               end2end: bool) -> tuple[dict[Any, torch.Tensor], dict[Any, torch.Tensor],
                                       dict[str, torch.Tensor]]:
    """Every op output of the traced ``graph`` run on one device, the gradient that
    reached it (``run_graph``'s loop, keeping what it computes), and every parameter's
    gradient by name."""
    from nnscaler.ir import CURRENT_DEVICE, SubTensor, default_device, leaf_values

    params = {n: _fresh(t) for n, t in state.items()}
    env = leaf_values(graph, params, _fresh(dict(args)))
    device = default_device(env)
    values: dict[Any, torch.Tensor] = {}
    live: dict[Any, torch.Tensor] = {}

    def value_of(leaf: Any) -> Any:
        if isinstance(leaf, SubTensor):
            return env[leaf.full]
        return device if leaf is CURRENT_DEVICE else leaf

    grad_on = torch.is_grad_enabled()
    try:
        for op in graph.ops:
            torch.set_grad_enabled(grad_on and not op.no_grad)
            result = op.call(pytree.tree_map(value_of, op.inputs),
                             pytree.tree_map(value_of, dict(op.kwargs)))
            for before, after in op.mutations:
                env[after.full] = env[before.full]
                values[after.full] = env[before.full].detach().to("cpu", copy=True)
            for ir, value in zip(op.outputs, pytree.tree_leaves(result), strict=True):
                if isinstance(ir, SubTensor) and isinstance(value, torch.Tensor):
                    env[ir.full] = value
                    values[ir.full] = value.detach().to("cpu", copy=True)
                    if value.requires_grad and not value.is_leaf:
                        value.retain_grad()
                        live[ir.full] = value
    finally:
        torch.set_grad_enabled(grad_on)
    _backward(pytree.tree_map(value_of, graph.outputs), end2end)
    grads = {full: t.grad.detach().to("cpu", copy=True) for full, t in live.items()
             if t.grad is not None}
    param_grads = {n: t.grad.detach().to("cpu", copy=True) for n, t in params.items()
                   if isinstance(t, torch.Tensor) and t.grad is not None}
    return values, grads, param_grads


# -- the parallel run: recording the generated code's variables --------------------------


class _Recorder:
    """A ``sys.settrace`` function that keeps every tensor local of the generated forward
    (``_forward_impl``) or stage methods (``_stage_{s}``) when it first appears: its value
    (a copy) and the tensor itself, whose gradient is read after backward."""

    def __init__(self, files: set[str], samples: list[Any]) -> None:
        self.files = files
        self.samples = samples
        self.values: dict[tuple[int, str], torch.Tensor] = {}
        self.live: dict[tuple[int, str], torch.Tensor] = {}
        self.calls: dict[str, int] = {}

    def _micro(self, frame: FrameType) -> int:
        code = frame.f_code
        args = [frame.f_locals.get(n) for n in code.co_varnames[1:code.co_argcount]]
        for m, sample in enumerate(self.samples):
            if any(a is sample for a in args):
                return m
        k = self.calls.get(code.co_name, 0)  # e.g. a forward of plain arguments
        self.calls[code.co_name] = k + 1
        return k

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if event != "call" or code.co_filename not in self.files:
            return None
        if code.co_name != "_forward_impl" and not code.co_name.startswith("_stage_"):
            return None
        micro = self._micro(frame)
        seen: set[str] = set()

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event in ("line", "return"):
                for name, value in frame.f_locals.items():
                    if name in seen or not isinstance(value, torch.Tensor):
                        continue
                    seen.add(name)
                    self.values[(micro, name)] = value.detach().to("cpu", copy=True)
                    if value.requires_grad:
                        if not value.is_leaf:
                            try:
                                value.retain_grad()
                            except RuntimeError:  # e.g. a view changed in place
                                continue
                        self.live[(micro, name)] = value
            return local

        return local

    def result(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]]:
        out = {}
        for key, value in self.values.items():
            t = self.live.get(key)
            grad = None if t is None or t.grad is None else t.grad.detach().to("cpu", copy=True)
            out[key] = (value, grad)
        return out


def _to(tree: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def _run_rank(outdir: str, rank: int, args: Mapping[str, Any], end2end: bool,
              nmicros: int, zero: bool) -> dict[str, Any]:
    """Load rank ``rank``'s generated module, run one forward and backward while
    recording; return the records (``vars``) and, but under ZeRO (where they live in
    the optimizer's shards), the gradients of its parameter pieces after the reducers
    (``params``: attribute -> (its `AttrMeta`, gradient))."""
    from nnscaler.codegen.files import load_generated_class
    from nnscaler.gendir import gencode_name

    cls = load_generated_class(outdir, rank)
    model = cls()
    files = {str(Path(outdir).resolve() / gencode_name(rank)),
             inspect.getsourcefile(cls) or ""}
    if end2end:
        sample = next(iter(args.values()))
        samples = [_to(_fresh(sample), model.device) for _ in range(nmicros)]
    else:
        samples = [_to(_fresh(dict(args)), model.device)]
    recorder = _Recorder(files, samples)
    previous = sys.gettrace()
    sys.settrace(recorder)
    try:
        if end2end:
            model.train_step(samples)
        else:
            out = model(**samples[0])
            sys.settrace(previous)
            _backward(out, end2end=False)
    finally:
        sys.settrace(previous)
    params: dict[str, Any] = {}
    if not zero:
        model.sync_grad()
        for attr, p in model.named_parameters():
            meta = model.fullmap.get(attr)
            if meta is not None and p.grad is not None:
                params[attr] = (meta, p.grad.detach().to("cpu", copy=True))
    return {"vars": recorder.result(), "params": params}


def _worker(fn: Callable[[int], Any], rank: int, world: int, port: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      NNSCALER_DEVICE="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result: tuple[str, Any] = ("ok", fn(rank))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        result = ("error", traceback.format_exc())
    path = os.path.join(outdir, f"rank{rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)
    if result[0] == "error":  # the parent stops the other ranks, which may wait forever
        open(os.path.join(outdir, f"rank{rank}.failed"), "w").close()  # noqa: SIM115
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)  # a forked child: skip the parent's atexit handlers and finalisers


def _spawn(fn: Callable[[int], Any], world: int, timeout: float) -> list[Any]:
    """``fn(rank)`` on ``world`` forked CPU processes joined by gloo; results by rank."""
    ctx = mp.get_context("fork")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="nnscaler-verify-") as outdir:
        procs = [ctx.Process(target=_worker, args=(fn, r, world, port, outdir))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(os.path.exists(os.path.join(outdir, f"rank{r}.failed")) or
                   (p.exitcode is not None and p.exitcode != 0) for r, p in enumerate(procs)):
                time.sleep(0.5)  # a rank failed: the others may wait for it forever
                break
            time.sleep(0.02)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        marks = {r: os.path.join(outdir, f"rank{r}.failed") for r in range(world)}
        failed = sorted((r for r in range(world) if os.path.exists(marks[r])),
                        key=lambda r: os.stat(marks[r]).st_mtime_ns)  # the first to fail
        results = []
        for r in failed + [r for r in range(world) if r not in failed]:  # a failure first
            path = os.path.join(outdir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise VerifyError(f"verify: rank {r} died or ran past {timeout:.0f} s (exit code "
                                  f"{procs[r].exitcode}); run it under torchrun to see its "
                                  f"output, or raise timeout=")
            status, value = torch.load(path, weights_only=False)
            if status == "error":
                raise VerifyError(f"verify: rank {r} failed running the parallel plan:\n{value}")
            results.append((r, value))
        return [value for _, value in sorted(results, key=lambda x: x[0])]


# -- the comparison -----------------------------------------------------------------------


def _ranges_str(indmap: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> str:
    parts = [":" if (a, b) == (0, n) else f"{a}:{b}" for (a, b), n in zip(indmap, shape, strict=True)]
    return "[" + ", ".join(parts) + "]"


def _piece_str(piece: Any) -> str:
    text = _ranges_str(piece.indmap, piece.full.shape)
    part, nparts = piece.valmap
    return text + (f" value part {part + 1}/{nparts}" if nparts > 1 else "")


def _shape_str(full: Any) -> str:
    from nnscaler.ir import dtype_str

    return f"{dtype_str(full.dtype)}[{', '.join(map(str, full.shape))}]"


def _slices(ranges: tuple[tuple[int, int], ...], within: tuple[tuple[int, int], ...] | None = None
            ) -> tuple[slice, ...]:
    if within is None:
        return tuple(slice(a, b) for a, b in ranges)
    return tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(ranges, within, strict=True))


def _reshape(value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return value.reshape(shape) if value.numel() == math.prod(shape) else value


class _Compare:
    """Pieces recorded on every rank against the reference, in program order."""

    def __init__(self, program: Any, records: list[dict], ref_values: dict, ref_grads: dict,
                 ref_params: dict, nmicros: int, rtol: float, atol: float) -> None:
        from nnscaler.graph.check import written_by

        self.p = program
        self.g = program.graph
        self.records = [r["vars"] for r in records]
        self.params = [r["params"] for r in records]
        self.ref_params = ref_params
        self.ref_values = ref_values
        self.ref_grads = ref_grads
        self.nmicros = nmicros
        self.rtol, self.atol = rtol, atol
        self.outputs = 0
        self.gradients = 0
        self.parameter_gradients = 0
        self.unrecorded: set[str] = set()  # op outputs no rank's variables held
        self.mutated = {t.full for op in self.g.ops for pair in op.mutations for t in pair}
        # full tensor -> every written piece: (device, piece, value key)
        self.written: dict[Any, list[tuple[int, Any, Any]]] = {}
        for op in self.g.ops:
            for piece, key in written_by(self.g, op):
                self.written.setdefault(piece.full, []).append((op.device, piece, key))

    # -- values of pieces ---------------------------------------------------------------
    def _ranks(self, device: int) -> list[int]:
        return [u * self.p.plan_ngpus + device for u in range(self.p.nunits)]

    def _record(self, rank: int, micro: int, full: Any) -> tuple[torch.Tensor, Any] | None:
        name = self.p.variables.get(full)
        return None if name is None else self.records[rank].get((micro, name))

    def _region(self, full: Any, piece: Any, unit: int, micro: int) -> torch.Tensor | None:
        """The whole value over ``piece``'s ranges from the value parts written in
        ``unit`` (the parts summed)."""
        from nnscaler.graph.pieces import Gap, cover

        entries = []
        for device, other, key in self.written.get(full, []):
            rec = self._record(unit * self.p.plan_ngpus + device, micro, full)
            if rec is not None:
                entries.append((other, key, _reshape(rec[0], other.shape)))
        found = cover(piece.indmap, [e[0] for e in entries], [e[1] for e in entries])
        if isinstance(found, Gap):
            return None
        total = torch.zeros([b - a for a, b in piece.indmap], dtype=torch.float64)
        for cell in found:
            for i in cell.picks:
                other, _, value = entries[i]
                total[_slices(cell.ranges, piece.indmap)] += \
                    value[_slices(cell.ranges, other.indmap)].double()
        return total

    def _layouts(self, full: Any) -> tuple[str, ...]:
        return tuple(f"rank {r}: {_piece_str(piece)}" for device, piece, _ in
                     self.written.get(full, []) for r in self._ranks(device)[:1])

    def _close(self, got: torch.Tensor, want: torch.Tensor) -> bool:
        if got.shape != want.shape:
            return False
        if not (want.is_floating_point() or want.is_complex()):
            return torch.equal(got.to(want.dtype), want)
        return torch.allclose(got.double(), want.double(), rtol=self.rtol, atol=self.atol,
                              equal_nan=True)

    def _difference(self, kind: str, op: Any, k: int, full: Any, piece: Any, rank: int,
                    micro: int, got: torch.Tensor, want: torch.Tensor) -> Difference:
        consumers = tuple(f"{c.name} at {c.short_source}" for c in self.g.consumers(full)
                          if self.g.origin(c) is c or self.g.instances(self.g.origin(c)))
        consumers = tuple(dict.fromkeys(consumers))
        if got.shape != want.shape:
            return Difference(
                kind=kind, op=op.name, source=op.source or "<unknown>", code=op.code.strip(),
                module_path=op.module_path, tensor=full.name, output_index=k,
                consumers=consumers, reference_layout=f"{_shape_str(full)} on one device",
                parallel_layout=self._layouts(full), rank=rank, micro_batch=micro,
                piece=_piece_str(piece), max_abs_diff=math.inf, max_rel_diff=math.inf,
                at=(), expected=math.nan, got=math.nan)
        delta = (got.double() - want.double()).abs().nan_to_num(nan=math.inf)
        flat = int(delta.argmax()) if delta.numel() else 0
        local = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), delta.shape)) \
            if delta.dim() else ()
        at = tuple(i + a for i, (a, _) in zip(local, piece.indmap, strict=True))
        rel = (delta / want.double().abs().clamp_min(1e-30)).max().item() if delta.numel() else 0.0
        return Difference(
            kind=kind, op=op.name, source=op.source or "<unknown>", code=op.code.strip(),
            module_path=op.module_path, tensor=full.name, output_index=k, consumers=consumers,
            reference_layout=f"{_shape_str(full)} on one device",
            parallel_layout=self._layouts(full), rank=rank, micro_batch=micro,
            piece=_piece_str(piece), max_abs_diff=float(delta.max()) if delta.numel() else 0.0,
            max_rel_diff=float(rel), at=at,
            expected=float(want.reshape(-1)[flat]) if want.numel() else math.nan,
            got=float(got.reshape(-1)[flat]) if got.numel() else math.nan)

    def _outputs_of(self, step: Any) -> list[tuple[Any, int, Any, Any]]:
        """(instance, output index, piece, device) of every output piece of ``step``."""
        found = []
        for device, inst in step.instances.items():
            for k, piece in enumerate(inst.output_tensors()):
                found.append((inst, k, piece, device))
        return found

    # -- forward, then backward ----------------------------------------------------------
    def forward(self) -> Difference | None:
        for step in self.p.steps:
            origin = step.origin
            for _, k, piece, device in self._outputs_of(step):
                want_full = self.ref_values.get(piece.full)
                if want_full is None:
                    continue  # an op the policy inserted (multiref): checked by its readers
                want = want_full[_slices(piece.indmap)]
                for micro in range(self.nmicros):
                    for unit, rank in enumerate(self._ranks(device)):
                        rec = self._record(rank, micro, piece.full)
                        if rec is None:
                            self.unrecorded.add(piece.full.name)
                            continue
                        if piece.valmap[1] > 1:
                            got = self._region(piece.full, piece, unit, micro)
                            if got is None:
                                continue
                        else:
                            got = _reshape(rec[0], piece.shape)
                        self.outputs += 1
                        if not self._close(got, want):
                            return self._difference("output", origin, k, piece.full, piece,
                                                    rank, micro, got, want)
        return None

    def backward(self) -> Difference | None:
        """Gradients in backward order. The replicas of one piece (same ranges and value
        part, in one scale unit) either each hold the whole gradient, or hold shares
        that sum to it (the runtime's convention for an output, or for a tensor whose
        readers are split): both are accepted."""
        for step in reversed(self.p.steps):
            origin = step.origin
            groups: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}
            for _, k, piece, device in self._outputs_of(step):
                if piece.full in self.mutated or piece.full not in self.ref_grads:
                    continue
                for unit, rank in enumerate(self._ranks(device)):
                    key = (k, piece.full, piece.indmap, piece.valmap, unit)
                    groups.setdefault(key, []).append((rank, piece))
            for (k, full, indmap, _, _), holders in groups.items():
                want = self.ref_grads[full][_slices(indmap)]
                for micro in range(self.nmicros):
                    got = []
                    for rank, piece in holders:
                        rec = self._record(rank, micro, full)
                        if rec is not None and rec[1] is not None:
                            got.append((rank, piece, _reshape(rec[1], piece.shape)))
                    if not got:
                        continue
                    self.gradients += len(got)
                    bad = [g for g in got if not self._close(g[2], want)]
                    if not bad:
                        continue
                    total = sum(g[2].double() for g in got)
                    if len(got) > 1 and self._close(total, want.double()):
                        continue
                    rank, piece, value = bad[0]
                    return self._difference("gradient", origin, k, full, piece, rank, micro,
                                            value, want)
        return None

    def parameters(self) -> Difference | None:
        """Every rank's parameter pieces' gradients after the reducers: the reference
        gradient times the number of samples behind them (every scale unit and
        micro-batch ran the same sample), in the order the ops read the parameters."""
        times = self.p.nunits * self.nmicros
        readers: dict[str, tuple[Any, Any]] = {}  # parameter name -> (first reader, full)
        for step in self.p.steps:
            for t in step.origin.input_tensors():
                if t.full.kind.value == "parameter":
                    for name in t.full.names:
                        readers.setdefault(name, (step.origin, t.full))
        found = []
        for rank, pieces in enumerate(self.params):
            for meta, grad in pieces.values():
                name = next((n for n in (meta.orig_name, *meta.names) if n in self.ref_params),
                            None)
                if name is None or meta.value[1] > 1 or name not in readers:
                    continue
                found.append((rank, meta, name, grad))
        order = {name: k for k, name in enumerate(readers)}
        for rank, meta, name, grad in sorted(found, key=lambda f: (order[f[2]], f[0])):
            op, full = readers[name]
            want = self.ref_params[name][meta.slicers] * times
            piece = attrs.evolve(full.whole(), indmap=meta.index)
            self.parameter_gradients += 1
            if not self._close(_reshape(grad, piece.shape), want):
                diff = self._difference("parameter gradient", op, 0, full, piece, rank, 0,
                                        _reshape(grad, piece.shape), want)
                return attrs.evolve(diff, tensor=name, parallel_layout=tuple(
                    f"rank {r}: {_ranges_str(m.index, tuple(m.shape))}"
                    for r, ps in enumerate(self.params) for m, _ in ps.values()
                    if name in (m.orig_name, *m.names)))
        return None


# -- the entry point ----------------------------------------------------------------------


def _policy_name(pas_policy: Any) -> str:
    if isinstance(pas_policy, str):
        return pas_policy
    return getattr(pas_policy, "__qualname__", repr(pas_policy))


def _check_args(module: Any, dummy_forward_args: Any, compute_config: Any) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"verify takes the single-device torch.nn.Module, got "
                        f"{type(module).__name__} {module!r}")
    if not isinstance(dummy_forward_args, Mapping):
        raise TypeError(f"dummy_forward_args must be a dict of forward arguments by name (as "
                        f"for parallelize), got {type(dummy_forward_args).__name__}")
    if not isinstance(compute_config, ComputeConfig):
        raise TypeError(f"compute_config must be an nnscaler.ComputeConfig, got "
                        f"{type(compute_config).__name__} {compute_config!r}")
    if compute_config.inference_only:
        raise VerifyError("verify compares forward and backward; it needs "
                          "ComputeConfig(inference_only=False)")


def _run_everywhere(outdir: str, args: dict[str, Any], config: ComputeConfig, nmicros: int,
                    timeout: float) -> list[Any]:
    """Every rank's records of the files in ``outdir``: run by the ranks of the process
    group under torchrun, else by ``runtime_ngpus`` forked CPU processes."""

    def run(rank: int) -> Any:
        return _run_rank(outdir, rank, args, config.use_end2end, nmicros, config.use_zero)

    if not (dist.is_available() and dist.is_initialized()):
        return _spawn(run, config.runtime_ngpus, timeout)
    if dist.get_world_size() != config.runtime_ngpus:
        raise VerifyError(
            f"verify runs the plan on runtime_ngpus={config.runtime_ngpus} processes, "
            f"but the process group has {dist.get_world_size()}; launch torchrun "
            f"with --nproc-per-node {config.runtime_ngpus}, or call verify outside "
            f"torch.distributed to let it start its own processes")
    mine = run(dist.get_rank())
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, mine)
    return records


def verify(
    module: torch.nn.Module,
    dummy_forward_args: dict[str, Any],
    pas_policy: str | Callable[[Any, ComputeConfig], Any],
    compute_config: ComputeConfig,
    *,
    rtol: float = RTOL,
    atol: float = ATOL,
    timeout: float = 600.0,
) -> VerifyReport:
    """Run ``module`` on one device and the plan ``pas_policy`` makes for it on
    ``compute_config.runtime_ngpus`` processes, and compare them op by op.

    Arguments are those of [`parallelize`][nnscaler.parallelize] (``dummy_forward_args`` are
    also the inputs compared on; for an end2end module, the sample). Returns a
    [`VerifyReport`][nnscaler.VerifyReport]: ``report.equal``, or ``report.first``, the first op in
    program order whose output differs (else, in backward order, the first gradient), with its
    source line, the layouts on both sides and the difference. ``module`` is left as it
    was. Under torchrun (``torch.distributed`` initialised, ``runtime_ngpus`` processes)
    every rank calls it and gets the same report; otherwise it forks ``runtime_ngpus``
    CPU processes with gloo, which must finish within ``timeout`` seconds.
    """
    from nnscaler.codegen import build_program, emit_files
    from nnscaler.graph import IRGraph
    from nnscaler.parallel.api import _resolve_policy
    from nnscaler.trace import trace

    start = time.perf_counter()
    _check_args(module, dummy_forward_args, compute_config)
    policy_fn = _resolve_policy(pas_policy)
    config = compute_config
    state = {n: t.detach().clone().requires_grad_(t.requires_grad)
             for n, t in module.named_parameters(remove_duplicate=False)}
    state.update({n: t.detach().clone() for n, t in module.named_buffers(remove_duplicate=False)})
    try:
        traced_module = copy.deepcopy(module)  # tracing runs forward: keep the user's intact
    except Exception:  # noqa: BLE001 - a module that does not copy: restore its state below
        traced_module = module
    try:
        graph = trace(traced_module, dummy_forward_args, strategy=config.tracing.strategy)
    finally:
        if traced_module is module:
            with torch.no_grad():
                for n, t in [*module.named_parameters(remove_duplicate=False),
                             *module.named_buffers(remove_duplicate=False)]:
                    t.copy_(state[n])
    planned = policy_fn(IRGraph.from_graph(graph), config)
    if not isinstance(planned, IRGraph):
        raise VerifyError(f"the policy {_policy_name(pas_policy)!r} must return the IRGraph it "
                          f"was given, got {type(planned).__name__}")
    planned.check(config.plan_ngpus)
    program = build_program(
        planned, plan_ngpus=config.plan_ngpus, runtime_ngpus=config.runtime_ngpus,
        end2end=config.use_end2end, inference_only=False, compute_config=config,
        forward_signature=inspect.signature(module.forward))
    nmicros = program.pipeline.settings.nmicros if program.pipeline is not None else 1
    ref_values, ref_grads, ref_params = _reference(graph, state, dummy_forward_args,
                                                   config.use_end2end)

    with tempfile.TemporaryDirectory(prefix="nnscaler-verify-") as outdir:
        emit_files(planned, outdir, plan_ngpus=config.plan_ngpus,
                   runtime_ngpus=config.runtime_ngpus, state=state,
                   end2end=config.use_end2end, compute_config=config, program=program)
        records = _run_everywhere(outdir, dummy_forward_args, config, nmicros, timeout)
    compare = _Compare(program, records, ref_values, ref_grads, ref_params, nmicros, rtol, atol)
    first = compare.forward() or compare.backward() or compare.parameters()
    return VerifyReport(
        equal=first is None, first=first, policy=_policy_name(pas_policy),
        plan_ngpus=config.plan_ngpus, runtime_ngpus=config.runtime_ngpus,
        compared_outputs=compare.outputs, compared_gradients=compare.gradients,
        compared_parameter_gradients=compare.parameter_gradients,
        unrecorded=tuple(sorted(compare.unrecorded)),
        rtol=rtol, atol=atol, seconds=time.perf_counter() - start)


# -- the command --------------------------------------------------------------------------


def _load(path: str, what: str, *, call: bool = True) -> Any:
    """``package.module:name`` -> the object (called, with ``call``, when it is callable
    and not a module)."""
    import importlib

    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise VerifyError(f"{what} must be given as 'package.module:name' (an import path, a "
                          f"colon, then a callable or object in that module), got {path!r}")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise VerifyError(f"{what} {path!r}: cannot import {module_name!r} ({e}); run from the "
                          f"folder that holds it or add it to PYTHONPATH") from e
    for part in attr.split("."):
        if not hasattr(found, part):
            raise VerifyError(f"{what} {path!r}: {module_name!r} has no attribute {attr!r}")
        found = getattr(found, part)
    if call and callable(found) and not isinstance(found, torch.nn.Module):
        found = found()
    return found


def add_arguments(parser: Any) -> None:
    """The options of ``python -m nnscaler verify`` (an ``argparse`` parser)."""
    import argparse

    parser.add_argument("model", help="the single-device module: 'package.module:factory', a "
                        "function returning an nn.Module (or a module object)")
    parser.add_argument("inputs", help="the dummy forward arguments: 'package.module:function' "
                        "returning a dict by argument name (as for parallelize)")
    parser.add_argument("--policy", required=True, help="a registered policy name (dp, data, "
                        "tp, pp, hybrid, ...) or 'package.module:function'")
    parser.add_argument("--plan-ngpus", type=int, default=2)
    parser.add_argument("--runtime-ngpus", type=int, default=None,
                        help="default: plan_ngpus")
    parser.add_argument("--end2end", action=argparse.BooleanOptionalAction, default=True,
                        help="forward(sample) returns the loss first (default); "
                        "--no-end2end backpropagates the sum of every output")
    parser.add_argument("--pas-config", default="{}", help="the policy's options, as JSON")
    parser.add_argument("--rtol", type=float, default=RTOL)
    parser.add_argument("--atol", type=float, default=ATOL)
    parser.add_argument("--timeout", type=float, default=600.0)


def run_command(args: Any) -> int:
    """``python -m nnscaler verify``: print the report; exit status 0 when equal, 1 when a
    difference was found, 2 when the comparison could not run (the reason on stderr)."""
    try:
        return _command(args)
    except VerifyError as e:
        print(f"nnscaler verify: {e}", file=sys.stderr)
        return 2


def _command(args: Any) -> int:
    import json

    try:
        pas_config = json.loads(args.pas_config)
    except json.JSONDecodeError as e:
        raise VerifyError(f"--pas-config must be JSON (e.g. '{{\"pipeline_nmicros\": 2}}'), "
                          f"got {args.pas_config!r}: {e}") from e
    policy: Any = args.policy
    if ":" in policy:  # a policy function: imported, not called
        policy = _load(policy, "--policy", call=False)
    config = ComputeConfig(plan_ngpus=args.plan_ngpus,
                           runtime_ngpus=args.runtime_ngpus or args.plan_ngpus,
                           use_end2end=args.end2end, pas_config=pas_config)
    module = _load(args.model, "the model")
    inputs = _load(args.inputs, "the inputs")
    report = verify(module, inputs, policy, config, rtol=args.rtol, atol=args.atol,
                    timeout=args.timeout)
    print(report)
    return 0 if report.equal else 1
