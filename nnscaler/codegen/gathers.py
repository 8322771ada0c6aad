"""ZeRO stage 3 in a rank's file: what the rank holds, and the gathers of the forward.

With ``zero_stage=3`` a rank holds a shard of each parameter piece (`nnscaler.runtime.zero3`).
The generated forward says so where it happens: before the first statement that reads a
gathering unit's parameters it calls ``zero3.gather(self, unit)`` and
``zero3.prefetch(self, next_unit)``, and once it is done with them
``zero3.free(self, unit)``.
These calls are the mechanism (the runtime gathers nothing else in forward), so they are
written from what each statement of the final code reads (``self.<attribute>``, and the
parameters of the ``_recompute_*`` method a checkpointed call runs):

- a *block* unit (a layer path, or a unit the user named) is gathered before the first
  statement that reads it, and freed just before the statement that reads another block
  unit (the forward moves on); a block read again later is gathered again;
- the *rest* unit (``zero3.REST``: embeddings, final norm, a tied head) is gathered before
  its first reader; it, and the last block, are freed after the statements that share the
  source comment of their last reader (the runtime frees what is left when forward ends);
- each gather is followed by the prefetch of the unit gathered next, if there is one.

The file's docstring lists every parameter piece the rank holds a shard of, by unit, with
the range of its flat elements that the shard holds (`shard_lines`; the runtime's buckets
lay the pieces out the same way: the stage-3 parity tests compare the two,
``check_zero3_header`` in ``tests/parity_utils.py``), and, in a pipeline, the pieces it
holds whole (stage 2's layout).
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Sequence

import attrs

from nnscaler.codegen.program_types import Program
from nnscaler.ir import TensorKind
from nnscaler.runtime.bucket import padded_numel
from nnscaler.runtime.zero import zero_groups
from nnscaler.runtime.zero3 import unit_of

__all__ = ["HeldParam", "held_params", "shard_lines", "shard_ranges", "with_gathers"]

_INDENT = "    "
_SELF_ATTR = re.compile(r"\bself\.([A-Za-z_]\w*)")


@attrs.frozen
class HeldParam:
    """A parameter piece a device holds under stage 3 (in ``add_param`` order)."""

    attr: str  # the attribute of the generated module
    unit: str  # its gathering unit ('' the rest)
    shape: tuple[int, ...]  # the full parameter's
    index: tuple[tuple[int, int], ...]  # the piece's ranges
    dtype: object
    holders: tuple[int, ...]  # the ranks holding the same piece (its reducer)
    whole: bool  # held whole (stage 2's layout): a pipeline's piece that spans stages

    @property
    def numel(self) -> int:
        return math.prod(hi - lo for lo, hi in self.index)


def held_params(p: Program, device: int) -> list[HeldParam]:
    """The parameter pieces that ``device``'s ranks hold and a stage-3 reducer manages
    (trainable ones), in the order the module registers them."""
    units = p.reducer_config.get("zero_units", ())
    out = []
    for full in p.graph.tensors:
        leaf = p.leaves.get(full)
        if leaf is None or full.kind is not TensorKind.PARAMETER or not full.requires_grad:
            continue
        layout = p.held_layout(leaf, device)
        holders = tuple(p.leaf_holders(leaf, device))
        if layout is None or not holders:
            continue
        # as ParallelModule._spans_stages: several ranks of one scale unit hold the piece
        whole = (p.pipeline is not None
                 and len({h // p.plan_ngpus for h in holders}) < len(holders))
        out.append(HeldParam(leaf.name, unit_of(full.names[0], units), tuple(full.shape),
                             tuple(layout.box(device)), full.dtype, holders, whole))
    return out


def shard_ranges(p: Program, rank: int, held: Sequence[HeldParam] | None = None
                 ) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """Per stage-3 attribute of ``rank``: the flat elements ``[lo, hi)`` of its piece that
    the rank's shard holds (``lo == hi``: none) and the ZeRO group the piece is sharded
    over. One flat buffer per reducer, unit and dtype, the pieces one after the other,
    padded to split evenly over the group (as `nnscaler.runtime.bucket.Bucket` lays it);
    ``held``: `held_params` of the rank's device, when made already."""
    ngroups = p.reducer_config.get("zero_ngroups", 1)
    buckets: dict[tuple[object, ...], list[HeldParam]] = {}
    for h in held if held is not None else held_params(p, rank % p.plan_ngpus):
        if not h.whole:
            buckets.setdefault((h.holders, h.unit, h.dtype), []).append(h)
    out = {}
    for (holders, _, _), params in buckets.items():
        groups = zero_groups(holders, ngroups if len(holders) > 1 else 1, rank)
        numel = sum(h.numel for h in params)
        shard = padded_numel(numel, groups.zero_size) // groups.zero_size
        lo, hi = groups.shard_index * shard, (groups.shard_index + 1) * shard
        offset = 0
        for h in params:
            start, end = max(lo, offset), min(hi, offset + h.numel)
            held = (start - offset, end - offset) if start < end else (0, 0)
            out[h.attr] = (*held, groups.zero_ranks)
            offset += h.numel
    return out


def _piece(h: HeldParam) -> str:
    if all(lo == 0 and hi == n for (lo, hi), n in zip(h.index, h.shape)):
        return ""
    return " [" + ", ".join(f"{lo}:{hi}" for lo, hi in h.index) + "]"


def shard_lines(p: Program, rank: int) -> list[str]:
    """The docstring's lines on what ``rank`` holds under stage 3."""
    held = held_params(p, rank % p.plan_ngpus)
    ranges = shard_ranges(p, rank, held)
    lines = ["ZeRO stage 3: this rank holds a shard of each parameter piece below: the "
             "flat elements [start, end) of the piece (after the full parameter's shape, "
             "and the piece's ranges where it is a piece), gathered one unit at a time by "
             "the zero3.gather and zero3.free calls of the forward."]
    by_unit: dict[str, list[HeldParam]] = {}
    for h in held:
        if not h.whole:
            by_unit.setdefault(h.unit, []).append(h)
    for unit, params in by_unit.items():
        over = " and ".join(dict.fromkeys(str(list(ranges[h.attr][2])) for h in params))
        lines.append(f"{_INDENT}unit {unit or 'zero3.REST (the rest)'}, sharded over ranks "
                     f"{over}:")
        for h in params:
            lo, hi, _ = ranges[h.attr]
            part = f"[{lo}, {hi})" if hi > lo else "none"
            lines.append(f"{_INDENT * 2}{h.attr} {h.shape}{_piece(h)}: {part} of {h.numel}")
    whole = [h for h in held if h.whole]
    if whole:
        lines.append("Held whole, as in stage 2 (several ranks of one scale unit hold them, "
                     "at different stages of the pipeline):")
        lines += [f"{_INDENT * 2}{h.attr} {h.shape}{_piece(h)}" for h in whole]
    return lines


# -- the forward ----------------------------------------------------------------------
@attrs.frozen
class _Stmt:
    first: int  # the first line, comments above it included (0-based)
    last: int  # its last line
    indent: str
    reads: tuple[str, ...]  # the units it reads, in order
    returns: bool
    commented: bool  # a source comment (``# file:line  code``) is above it


def _statements(body: Sequence[str], units: dict[str, str],
                method_units: dict[str, tuple[str, ...]]) -> list[_Stmt]:
    """The simple statements of ``body`` (inside ``with`` blocks too), with the units
    each reads."""
    tree = ast.parse("\n".join(body))
    out: list[_Stmt] = []

    def walk(stmts: list[ast.stmt]) -> None:
        for st in stmts:
            if isinstance(st, ast.With):
                walk(st.body)
                continue
            first, last = st.lineno - 1, (st.end_lineno or st.lineno) - 1
            while first > 0 and body[first - 1].strip().startswith("#"):
                first -= 1
            reads: list[str] = []
            for line in body[st.lineno - 1:last + 1]:
                for name in _SELF_ATTR.findall(line):
                    for unit in ((units[name],) if name in units
                                 else method_units.get(name, ())):
                        if unit not in reads:
                            reads.append(unit)
            indent = body[st.lineno - 1][:st.col_offset]
            out.append(_Stmt(first, last, indent, tuple(reads), isinstance(st, ast.Return),
                             first < st.lineno - 1))

    walk(tree.body)
    return out


def _method_units(methods: Sequence[Sequence[str]], units: dict[str, str]
                  ) -> dict[str, tuple[str, ...]]:
    """The units each method (``def name(self, ...)`` and its lines) reads."""
    out = {}
    for method in methods:
        name = method[0].split("(", 1)[0].removeprefix("def ").strip()
        reads: list[str] = []
        for line in method[1:]:
            for attr in _SELF_ATTR.findall(line):
                if attr in units and units[attr] not in reads:
                    reads.append(units[attr])
        out[name] = tuple(reads)
    return out


def with_gathers(body: list[str], methods: Sequence[Sequence[str]],
                 units: dict[str, str]) -> list[str]:
    """``body`` (a forward or a pipeline stage's method body) with the ``zero3`` calls
    that gather, prefetch and free the units its statements read; ``units``: attribute ->
    unit of the stage-3 parameters of the device; ``methods``: the ``_recompute_*``
    methods the body may call."""
    stmts = _statements(body, units, _method_units(methods, units))
    before: dict[int, list[str]] = {}  # line -> calls inserted before it
    after: dict[int, list[str]] = {}
    gathered: dict[str, int] = {}  # unit -> the index of the statement that last read it
    events: list[tuple[int, str]] = []  # (statement, unit) of each gather, in order
    frees: dict[int, list[str]] = {}  # statement -> the units freed just before it

    for i, st in enumerate(stmts):
        blocks = [u for u in st.reads if u]
        if blocks:  # forward moves on: free the blocks this statement does not read
            for unit in [u for u in gathered if u and u not in blocks]:
                del gathered[unit]
                frees.setdefault(i, []).append(unit)
        for unit in st.reads:
            if unit not in gathered:
                events.append((i, unit))
            gathered[unit] = i
    for unit, i in gathered.items():  # the last block and the rest unit: after the last
        j = _group_end(stmts, i)      # statement under the comment of their last reader
        if not stmts[j].returns:      # (the runtime frees what is left when forward ends)
            after.setdefault(stmts[j].last, []).append(
                f"{stmts[j].indent}zero3.free(self, {_name(unit)})")
    for i, freed in frees.items():
        st = stmts[i]
        before.setdefault(st.first, []).extend(
            f"{st.indent}zero3.free(self, {_name(u)})" for u in freed)
    for k, (i, unit) in enumerate(events):
        st = stmts[i]
        calls = before.setdefault(st.first, [])
        calls.append(f"{st.indent}zero3.gather(self, {_name(unit)})")
        if k + 1 < len(events) and events[k + 1][0] != i:
            calls.append(f"{st.indent}zero3.prefetch(self, {_name(events[k + 1][1])})")
    out: list[str] = []
    for n, line in enumerate(body):
        out += before.get(n, [])
        out.append(line)
        out += after.get(n, [])
    return out


def _group_end(stmts: Sequence[_Stmt], i: int) -> int:
    """The last statement of the run that statement ``i`` belongs to: the statements after
    it without a source comment of their own, in the same block."""
    j = i
    while (j + 1 < len(stmts) and not stmts[j + 1].commented
           and stmts[j + 1].indent == stmts[i].indent and not stmts[j + 1].returns
           and stmts[j + 1].first == stmts[j].last + 1):
        j += 1
    return j


def _name(unit: str) -> str:
    return "zero3.REST" if not unit else repr(unit)
