"""Activation recomputation in generated code (``graph.recompute(...)``).

The ops of a recompute group that run one after the other on a rank become one method,
``_recompute_{group}`` (``_recompute_{group}_{k}`` for the ``k``-th piece of a group an
adapter cuts), and the forward calls it through
``torch.utils.checkpoint.checkpoint(self._recompute_0, t42, use_reentrant=False)``: the
method's intermediate results are not kept for backward but computed again from its
inputs when backward needs them. The checkpoint restores the random number generator
state of the forward first, so dropout draws the same masks.

What a method takes and returns is read from the code itself: it takes the local
variables it reads that the forward defined before it, and returns those it defines that
the forward reads after it.

Three things are not recomputed, by design:

- *adapters* (the layout changes between ops, many of them collectives): each runs once
  in the forward and once (its adjoint) in backward; a recompute group is cut around
  them and their outputs are kept. Replaying a collective inside another rank's backward
  order could deadlock;
- an op whose parts talk to each other (a collective part op: the class-parallel
  cross-entropy, the expert-parallel MoE layer's all-to-all): cut out of the group like
  an adapter, for the same reason; it runs once in the forward and its output is kept;
- an op that changes one of the method's inputs in place (the recomputation would see
  the changed value): refused by `check_inputs_unchanged`.

A group that spans two pipeline stages is refused when the program is built
(`check_groups`).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Sequence

import attrs

from nnscaler.codegen.errors import CodegenError
from nnscaler.ir import Graph, Op

#: Marks the start and end of a piece of a recompute group in a method body.
BEGIN = "#<recompute "
END = "#</recompute>"
_INDENT = "    "


@attrs.frozen
class Segment:
    """One piece of a recompute group on one rank, as written into the forward."""

    group: int
    inplace: tuple[tuple[str, str], ...] = ()  # (variable changed in place, op's source)


def _loads_stores(stmt: ast.stmt) -> tuple[list[str], list[str]]:
    """The names ``stmt`` reads and those it assigns, each in `ast.walk`'s order."""
    loads, stores = [], []
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                loads.append(node.id)
            elif isinstance(node.ctx, ast.Store):
                stores.append(node.id)
    return loads, stores


def _flat(stmts: Iterable[ast.stmt]) -> list[ast.stmt]:
    """The statements in execution order, ``with`` blocks opened."""
    out: list[ast.stmt] = []
    for stmt in stmts:
        if isinstance(stmt, ast.With):
            out += _flat(stmt.body)
        else:
            out.append(stmt)
    return out


def _parse(lines: Sequence[str]) -> list[ast.stmt]:
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#<")
                     and not line.lstrip().startswith("#</"))
    try:
        return _flat(ast.parse(text).body) if text.strip() else []
    except SyntaxError as e:  # generated code is always valid Python
        raise CodegenError(f"internal error: a generated method does not parse ({e})") from e


@functools.lru_cache(maxsize=4096)
def _run_names(lines: tuple[str, ...]) -> list[tuple[list[str], list[str]]]:
    """`_loads_stores` of each statement of a run of lines, remembered by its text: the
    devices of one stage often run the same lines (their pieces of the same layers).
    Callers only read the result."""
    return [_loads_stores(stmt) for stmt in _parse(lines)]


def _runs(body: list[str]) -> list[tuple[int | None, list[str]]]:
    """``body`` cut at its markers: runs of lines, each ``(key, lines)`` with ``key`` the
    piece's key for the lines of a piece and None for the lines between pieces. Markers
    lie between top-level statements, so every run parses on its own."""
    runs: list[tuple[int | None, list[str]]] = []
    plain: list[str] = []
    i = 0
    while i < len(body):
        line = body[i]
        if not line.startswith(BEGIN):
            plain.append(line)
            i += 1
            continue
        if plain:
            runs.append((None, plain))
            plain = []
        j = body.index(END, i)
        runs.append((int(line[len(BEGIN):].rstrip(">")), body[i + 1:j]))
        i = j + 1
    if plain:
        runs.append((None, plain))
    return runs


def extract(body: list[str], params: Sequence[str], segments: dict[int, Segment],
            *, enabled: bool = True) -> tuple[list[str], list[list[str]]]:
    """``body`` (a method's lines, holding `BEGIN`/`END` markers) with each
    marked piece replaced by a checkpointed call, and the methods to add to the class
    (each a list of lines, without the class indentation). ``params``: the method's
    parameters. ``enabled`` False (inference only): the pieces stay inline.

    Linear in the size of ``body``: every run of lines between markers is parsed once,
    the variables the forward has defined are kept as the runs go, and whether a
    variable is read after a piece is looked up in the index of the last run reading it."""
    runs = _runs(body)
    # per statement of each run, in order: (names it reads, names it assigns), one walk
    names = [_run_names(tuple(lines)) for _, lines in runs]
    last_read: dict[str, int] = {}  # variable -> the last run that reads it
    for r, stmts in enumerate(names):
        for loads, _ in stmts:
            for name in loads:
                last_read[name] = r
    out: list[str] = []
    methods: list[list[str]] = []
    counts: dict[int, int] = {}
    defined = set(params)  # the local variables the forward has when a run starts
    for r, ((key, inner), stmts) in enumerate(zip(runs, names)):
        stored = [name for _, stores in stmts for name in stores]
        if key is None or not enabled or not stmts:
            out += inner
            defined.update(stored)
            continue
        seg = segments[key]
        inputs: list[str] = []
        seen: set[str] = set()
        for loads, stores in stmts:
            for name in loads:
                if name in defined and name not in seen and name not in inputs:
                    inputs.append(name)
            seen.update(stores)
        outputs = [n for n in dict.fromkeys(stored)
                   if last_read.get(n, -1) > r and n != "_out"]
        check_inputs_unchanged(seg, inputs)
        if not outputs:  # nothing of it is read later on this rank: no reason to keep it
            out += inner
            defined.update(stored)
            continue
        defined |= set(outputs)  # what the checkpointed call assigns
        k = counts.get(seg.group, 0)
        counts[seg.group] = k + 1
        name = f"_recompute_{seg.group}" if k == 0 else f"_recompute_{seg.group}_{k}"
        returned = ", ".join(outputs)
        doc = f'"""Recompute group {seg.group}: its activations are recomputed in backward."""'
        methods.append([f"def {name}(self, {', '.join(inputs)}):" if inputs
                        else f"def {name}(self):", _INDENT + doc,
                        *(_INDENT + x if x else "" for x in inner),
                        f"{_INDENT}return {returned}"])
        args = ", ".join([f"self.{name}", *inputs, "use_reentrant=False"])
        target = ", ".join(outputs)
        out.append(f"{target} = torch.utils.checkpoint.checkpoint({args})")
    return out, methods


def check_inputs_unchanged(seg: Segment, inputs: Sequence[str]) -> None:
    """Refuse a piece whose op changes one of the piece's inputs in place."""
    for var, where in seg.inplace:
        if var in inputs:
            raise CodegenError(
                f"{where}: this op changes {var} in place, but {var} is an input of "
                f"recompute group {seg.group} (made before the group's ops run here), so "
                f"recomputing the group in backward would read the changed value. Fix: "
                f"leave this op out of the group (graph.recompute with the other ops), or "
                f"put the op that makes {var} in the group too"
            )


def check_groups(graph: Graph, describe: object) -> None:
    """Refuse the recompute groups code generation cannot honour: a group whose ops lie
    in two pipeline stages."""
    stage_of: dict[int, tuple[int | None, Op]] = {}
    for op in graph.ops:
        group = op.plan.recompute
        if group is None:
            continue
        first = stage_of.setdefault(group, (op.plan.stage, op))
        if first[0] != op.plan.stage:
            raise CodegenError(
                f"{describe(op)} is in recompute group {group} and in pipeline stage "
                f"{op.plan.stage}, but the group's first op {describe(first[1])} is in stage "
                f"{first[0]}: a group is recomputed inside one stage's backward. Fix: mark "
                f"the ops of each stage as their own group (graph.recompute once per stage), "
                f"after graph.staging"
            )
