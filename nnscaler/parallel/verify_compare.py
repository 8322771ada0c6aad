"""The comparison of [`verify`][nnscaler.verify]: the pieces every rank recorded against the
single-device reference, in program order (op outputs), then in backward order
(gradients), then the parameters' gradients after the reducers; the first that differs
becomes a [`Difference`][nnscaler.Difference].
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from nnscaler.parallel.verify_report import Difference


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


class Compare:
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
            want = meta.take(self.ref_params[name]) * times
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
