"""Write ``gencode{rank}.py``: the program of one runtime rank, as readable torch code.

The file holds module-level adapters (``ADAPTER_3 = Adapter(src, dst, shape=...)`` with a
comment naming the primitives) and one class ``GenModel(ParallelModule)``: class
attributes (rank, plan and runtime sizes, the process groups every rank creates, the
reducer options), ``__init__`` registering this rank's piece of every parameter, buffer
and constant under a name taken from its module path, and ``_forward_impl`` with this
rank's ops in program order, each under a ``# file:line  code`` comment. See
``docs/codegen.md`` and ``docs/internals/parallel-runtime.md``.

A pipelined program (``docs/pipeline.md``) has instead one method ``_stage_{s}`` per stage
the rank runs, the rank's schedule as module-level ``SCHEDULE`` text and a ``pipeline``
class attribute (`nnscaler.runtime.pipeline.Pipeline`) for the executor.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from nnscaler.codegen import recompute
from nnscaler.codegen.calls import CallSource, call_source
from nnscaler.codegen.errors import CodegenError
from nnscaler.codegen.file_parts import DeviceCode, Wrapped, header, program_attributes
from nnscaler.codegen.gathers import held_params, with_gathers
from nnscaler.codegen.layouts import describe_plan, relabel_invariant, shifted, unit_plan
from nnscaler.codegen.literals import Code, literal
from nnscaler.codegen.program_types import AdapterSpec, OpStep, Program
from nnscaler.codegen.stage_writer import StageWriter
from nnscaler.codegen.wrap import wrap_lines
from nnscaler.graph.ops import MULTIREF_NAME
from nnscaler.ir import FullTensor, Op, SubTensor, TensorKind, tensors_in
from nnscaler.ir.op import map_leaves

_INDENT = "    "
def _is_plain(tree: Any) -> bool:
    """Only lists, tuples (not named) and dicts with literal keys around the leaves."""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return False
    if type(tree) in (list, tuple):
        return all(_is_plain(x) for x in tree)
    if type(tree) is dict:
        return all(isinstance(k, (str, int)) and _is_plain(v) for k, v in tree.items())
    return pytree.tree_is_leaf(tree)


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.memory_format, torch.layout)


def _call_key(x: Any) -> Hashable | None:
    """A key equal for arguments that generated code writes alike: variables
    (`Code`) by their text, plain constants by type and value, and lists, tuples,
    dicts (in order) and slices of those; None for anything else (a tensor constant,
    an object), which is then written anew."""
    if isinstance(x, Code):
        return ("code", x.text)
    if isinstance(x, (float, complex)):
        return (type(x), repr(x))  # -0.0 == 0.0, but they are written differently
    if isinstance(x, _PLAIN):
        return (type(x), x)
    if x is Ellipsis:
        return ("...",)
    if type(x) in (list, tuple):
        items = [_call_key(v) for v in x]
        return None if any(k is None for k in items) else (type(x), tuple(items))
    if type(x) is dict:
        items = [(k, _call_key(v)) for k, v in x.items()]
        if any(v is None or not isinstance(k, (str, int)) for k, v in items):
            return None
        return (dict, tuple(items))
    if type(x) is slice:
        parts = [_call_key(v) for v in (x.start, x.stop, x.step)]
        return None if any(k is None for k in parts) else ("slice", tuple(parts))
    return None


def _target(tree: Any) -> str | None:
    """An assignment target for a tree of tuples/lists of names, or None."""
    if isinstance(tree, Code):
        return tree.text
    if isinstance(tree, (tuple, list)) and not hasattr(tree, "_fields") and tree:
        inner = [_target(x) for x in tree]
        if any(x is None for x in inner):
            return None
        return f"({inner[0]},)" if len(inner) == 1 else f"({', '.join(inner)})"  # type: ignore[arg-type]
    return None


class _Rank:
    """Writes the file of one runtime rank."""

    def __init__(self, p: Program, rank: int) -> None:
        self.p = p
        self.rank = rank
        self.device = rank % p.plan_ngpus
        self.unit = rank // p.plan_ngpus
        self.offset = self.unit * p.plan_ngpus
        self.imports: set[str] = set()
        self.defs: list[str] = []
        self.used: set[str] = set()  # local variables read
        self.adapters: list[AdapterSpec] = []
        self.anchors: list[str] = []
        self.pipe = p.pipeline
        self.group = self.pipe.group_of(self.device) if self.pipe is not None else None
        #: the writer of the pipeline's parts (the stage methods, the schedule)
        self.stages = StageWriter(self, self.pipe) if self.pipe is not None else None
        self.segments: dict[int, recompute.Segment] = {}  # pieces of recompute groups
        self.methods: list[list[str]] = []  # the methods the pieces call
        self.per_unit = False  # the body names this scale unit's ranks (see DeviceCode)
        #: the call sources made so far, shared by the writers of one program (see call)
        self.calls: dict[Hashable, CallSource] | None = None

    # -- variables ----------------------------------------------------------------------
    def source_var(self, full: FullTensor) -> str:
        """The variable of this device's piece of ``full`` where it is produced or held."""
        leaf = self.p.leaves.get(full)
        if leaf is not None and full.kind is TensorKind.INPUT:
            self.used.add(leaf.name)
            return leaf.name
        if leaf is not None:
            if self.p.held_layout(leaf, self.device) is None:
                raise CodegenError(f"internal error: device {self.device} reads {full} directly "
                                   f"but does not hold it ({leaf.layout})")
            return f"self.{leaf.name}"
        return self.p.variables[full]

    def read_var(self, step: OpStep, k: int) -> str | None:
        read = step.reads[k]
        if read.first_part:  # the weight on value part 0, nothing (None) on the others
            if read.layout.coords(self.device)[1]:
                return None
            return self.source_var(read.full)
        if read.adapter is not None:
            return read.adapter.result
        return self.source_var(read.full)

    # -- statements ---------------------------------------------------------------------
    def adapter_lines(self, spec: AdapterSpec) -> list[str]:
        if not spec.takes_part(self.device):
            return []
        self.adapters.append(spec)
        arg = self.source_var(spec.full) if self.device in spec.src.devices else "None"
        if self.device not in spec.dst.devices and spec.requires_grad:
            self.anchors.append(spec.result)
        return [f"{spec.result} = ADAPTER_{spec.index}({arg})"]

    def op_lines(self, step: OpStep, op: Op) -> list[str]:
        counter = iter(range(len(step.reads)))

        def to_code(x: Any) -> Any:
            if isinstance(x, SubTensor):
                var = self.read_var(step, next(counter))
                return None if var is None else Code(var)
            return x

        inputs = map_leaves(to_code, list(op.inputs))
        kwargs = map_leaves(to_code, dict(op.kwargs))
        if step.part_devices is not None:  # a collective part op talks to its sibling parts
            kwargs["group"] = Code(f"self.part_group({step.part_devices[op.device]!r})")
        if op.opdef is not None and op.opdef.name == MULTIREF_NAME:
            times = int(op.kwargs.get("times", len(op.outputs)))
            call = CallSource(", ".join([literal(inputs[0])] * times))
        else:
            call = self.call(op, inputs, kwargs)
        self.imports.update(call.imports)
        self.defs.extend(d for d in call.defs if d not in self.defs)
        lines = list(call.stmts)
        lines += self.assign(op, call.expr, statement=bool(call.stmts))
        produced = {t.full for t in tensors_in(op.outputs)}
        reads = {r.full: k for k, r in enumerate(step.reads)}
        for before, after in op.mutations:
            if after.full in produced:
                continue
            k = reads.get(before.full)
            src = self.read_var(step, k) if k is not None else self.source_var(before.full)
            lines.append(f"{self.p.variables[after.full]} = {src}")
        return lines

    def call(self, op: Op, inputs: list[Any], kwargs: dict[str, Any]) -> CallSource:
        """`call_source` for ``op`` reading these variables and constants; the
        instances of one op on other devices often read the same names (the parts of a
        split): with `calls` shared, the source is made once for them all. An op
        with an ``emit_fn`` (which sees the instance itself) is made for each."""
        key = None
        if self.calls is not None and (op.opdef is None or op.opdef.emit_fn is None):
            args = _call_key((inputs, kwargs))
            if args is not None:
                key = (id(op.opdef), op.name, id(op.fn), op.keywords, args)
                found = self.calls.get(key)
                if found is not None:
                    return found
        call = call_source(op, inputs, kwargs, where=self.p.graph.describe(op))
        if key is not None and self.calls is not None:
            self.calls[key] = call
        return call

    def assign(self, op: Op, expr: str, *, statement: bool = False) -> list[str]:
        """``expr`` assigned to the op's output variables (``statement``: the op was a
        statement, ``expr`` only names what it changed)."""
        names = [Code(self.p.variables[x.full]) if isinstance(x, SubTensor) else Code("_")
                 for x in op.outputs]
        if all(n.text == "_" for n in names):
            return [] if statement else [expr]
        tree = pytree.tree_unflatten(names, op.output_spec)
        target = _target(tree)
        if target is not None:
            if target.startswith("(") and target.endswith(")") and not target.endswith(",)"):
                target = target[1:-1]
            return [f"{target} = {expr}"]
        lines = [f"_out = {expr}"]
        for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, Code) and leaf.text != "_":
                lines.append(f"{leaf.text} = _out{pytree.keystr(path)}")
        return lines

    @staticmethod
    def comment(op: Op) -> str:
        if op.source_file:
            code = " ".join(op.code.split())
            text = f"# {os.path.basename(op.source_file)}:{op.source_line}"
            return f"{text}  {code}" if code else text
        return f"# {op.name}"

    # -- the forward --------------------------------------------------------------------
    def forward_body(self) -> list[str]:
        blocks = self.steps_body(self.p.steps)
        out_lines: list[str] = []
        for spec in self.p.output_adapters:
            out_lines += self.adapter_lines(spec)
        prologue = self.prologue()
        out_lines.append(f"return {self.returned()}")
        body = list(prologue) + _render(blocks) + out_lines
        return self.with_recompute(body, [name for name, _ in self.p.args])

    def steps_body(self, steps: list[OpStep]) -> list[tuple[_Mode | None, list[str]]]:
        """This device's lines of ``steps``: blocks of lines, each with or without
        gradients and under the autocast its ops were traced in; a block ``(None,
        [marker])`` opens or closes a piece of a recompute group
        (`nnscaler.codegen.recompute`), which adapters and collective part ops cut."""
        blocks: list[tuple[_Mode | None, list[str]]] = []  # ((no_grad, autocast), lines)
        open_: list[int] = []  # the key of the open piece, if any

        def add(mode: _Mode | None, lines: list[str]) -> None:
            if not lines:
                return
            if mode is not None and blocks and blocks[-1][0] == mode:
                blocks[-1][1].extend(lines)
            else:
                blocks.append((mode, list(lines)))

        def close() -> None:
            if open_:
                add(None, [recompute.END])
                open_.clear()

        last_comment = ""
        for step in steps:
            adapter_lines: list[str] = []
            for spec in step.adapters:
                adapter_lines += self.adapter_lines(spec)
            op = step.instances.get(self.device)
            group = op.plan.recompute if op is not None else None
            if adapter_lines:  # adapters run once, outside any recompute piece
                close()
                add((step.no_grad, step.origin.autocast), adapter_lines)
            if op is None:
                continue
            talks = step.part_devices is not None  # runs once too: its parts meet in forward
            if open_ and (self.segments[open_[0]].group != group or talks):
                close()
            if group is not None and not open_ and not talks:
                key = len(self.segments)
                self.segments[key] = recompute.Segment(group)
                open_.append(key)
                add(None, [f"{recompute.BEGIN}{key}>"])
            lines: list[str] = []
            note = self.comment(op)
            if note != last_comment:
                lines.append(note)
                last_comment = note
            lines += self.op_lines(step, op)
            if open_ and op.mutations:
                seg = self.segments[open_[0]]
                changed = tuple((self.mutated_var(step, before.full), self.p.graph.describe(op))
                                for before, _ in op.mutations)
                self.segments[open_[0]] = attrs.evolve(seg, inplace=seg.inplace + changed)
            add((step.no_grad, step.origin.autocast), lines)
        close()
        return blocks

    def steps_lines(self, steps: list[OpStep]) -> list[str]:
        """`steps_body` rendered (the blocks under their ``with`` statements)."""
        return _render(self.steps_body(steps))

    def mutated_var(self, step: OpStep, full: FullTensor) -> str:
        """The variable an op step reads ``full`` from (what an in-place op changes)."""
        for k, r in enumerate(step.reads):
            if r.full is full:
                return self.read_var(step, k) or ""
        leaf = self.p.leaves.get(full)
        if leaf is not None and full.kind is not TensorKind.INPUT:
            return ""  # a parameter or buffer: not an input of the piece
        return self.source_var(full)

    def with_recompute(self, body: list[str], params: list[str]) -> list[str]:
        """``body`` with its recompute pieces turned into checkpointed calls; the methods
        they call are kept for the class (``self.methods``)."""
        new, methods = recompute.extract(body, params, self.segments,
                                         enabled=not self.p.inference_only)
        if self.p.reducer_config.get("zero_stage", 0) >= 3 and not self.p.inference_only:
            units = {h.attr: h.unit for h in held_params(self.p, self.device) if not h.whole}
            new = with_gathers(new, methods, units)  # stage 3: the forward's gathers
        if any("torch.utils.checkpoint.checkpoint(" in line for line in new):
            self.imports.add("torch.utils.checkpoint")
        self.methods += methods
        return new

    def input_checks(self) -> list[str]:
        """``boundary.check_inputs({...})``: every forward argument against what the module
        was traced with (tensors: shape and dtype; Python values: the constant the code
        holds), before anything runs."""
        entries = [f"{leaf.access!r}: ({leaf.access}, {tuple(full.shape)!r}, "
                   f"{literal(full.dtype)})"
                   for full, leaf in self.p.leaves.items() if full.kind is TensorKind.INPUT]
        if self.pipe is None:  # a pipeline stage takes the sample only
            for name, default in self.p.args:
                value = self.p.graph.inputs.get(name, default)
                if default is not None:  # not traced: the code ran with the default
                    entries.append(f"{name!r}: ({name}, {default})")
                elif value is None or isinstance(value, (bool, int, float, str)):
                    entries.append(f"{name!r}: ({name}, {literal(value)})")
        if not entries:
            return []
        if len(entries) == 1:
            return [f"boundary.check_inputs({{{entries[0]}}})"]
        return ["boundary.check_inputs({", *(f"{_INDENT}{e}," for e in entries), "})"]

    def prologue(self) -> list[str]:
        # a pipeline checks every sample before its schedule runs (_check_inputs)
        lines = self.input_checks() if self.pipe is None else []
        training = not self.p.inference_only
        for full, leaf in self.p.leaves.items():
            if full.kind is not TensorKind.INPUT:
                continue
            # a pipeline's sample is data: its gradient is not summed over the unit
            summed = training and self.p.plan_ngpus > 1 and self.pipe is None
            grad = summed and full.requires_grad
            if summed and not full.requires_grad and (full.dtype.is_floating_point
                                                      or full.dtype.is_complex):
                # its gradient is not summed here: refuse a value that requires grad
                check = f"boundary.data_input({leaf.access}, {leaf.access!r})"
                lines.append(f"{leaf.name} = {check}" if leaf.name in self.used else check)
                continue
            if leaf.name not in self.used and not grad:
                continue
            if grad:
                self.per_unit = True  # the unit's runtime ranks: not shared across units
                ranks = list(self.p.unit_ranks(self.unit))
                lines.append(f"{leaf.name} = boundary.input({leaf.access}, ranks={ranks})")
                if leaf.name not in self.used:
                    self.anchors.append(leaf.name)
            elif leaf.name != leaf.access:
                lines.append(f"{leaf.name} = {leaf.access}")
        return lines

    def returned(self) -> str:
        p = self.p
        by_full = {o.full: o for o in p.outputs}
        anchors = self.anchors if not p.inference_only else []
        first_grad = next((o.full for o in p.outputs if o.full.requires_grad), None)

        def leaf_code(x: Any) -> Any:
            nonlocal anchors
            if not isinstance(x, SubTensor):
                return x
            out = by_full[x.full]
            var = out.adapter.result if out.adapter is not None else self.source_var(x.full)
            first = self.device == out.layout.devices[0]
            extra = ""
            if anchors and x.full is first_grad:
                extra = f", anchors=({', '.join(anchors)},)"
                anchors = []
            return Code(f"boundary.output({var}, first={first}{extra})")

        tree = pytree.tree_map(leaf_code, p.graph.outputs)
        if _is_plain(tree):
            return literal(tree, where="the forward's outputs")
        leaves, spec = pytree.tree_flatten(tree)
        try:
            dumped = pytree.treespec_dumps(spec)
        except Exception as e:
            raise CodegenError(
                f"the forward returns {type(p.graph.outputs).__name__}, a structure generated "
                f"code cannot rebuild ({e}); return tensors in tuples, lists or dicts"
            ) from None
        items = ", ".join(literal(x, where="the forward's outputs") for x in leaves)
        return (f"torch.utils._pytree.tree_unflatten([{items}], "
                f"torch.utils._pytree.treespec_loads({dumped!r}))")

    # -- __init__ -----------------------------------------------------------------------
    def init_lines(self) -> list[str]:
        p = self.p
        lines = []
        for full in p.graph.tensors:
            leaf = p.leaves.get(full)
            if leaf is None or full.kind is TensorKind.INPUT:
                continue
            layout = p.held_layout(leaf, self.device)
            if layout is None:
                continue
            box = layout.box(self.device)
            part = (layout.coords(self.device)[1], layout.v)
            names = full.names
            name = names[0] if names else f"__constants__.{full.name}"
            fields = [repr(leaf.name), repr(name)]
            if len(names) > 1:
                fields.append(f"names={tuple(names)!r}")
            fields.append(f"shape={tuple(full.shape)!r}")
            fields.append(f"index={tuple(box)!r}")
            if part != (0, 1):
                fields.append(f"value={part!r}")
            fields.append(f"dtype={literal(full.dtype)}")
            if full.kind is TensorKind.PARAMETER:
                fields.append(f"holders={p.leaf_holders(leaf, self.device)!r}")
                if not full.requires_grad:
                    fields.append("requires_grad=False")
                if full.model_shape is not None:  # held reshaped (nnscaler.trace.moe_weights)
                    fields.append(f"model_shape={tuple(full.model_shape)!r}")
                lines.append(f"self.add_param({', '.join(fields)})")
            elif full.kind is TensorKind.BUFFER:
                if not full.persistent:
                    fields.append("persistent=False")
                lines.append(f"self.add_buffer({', '.join(fields)})")
            else:
                lines.append(f"self.add_constant({', '.join(fields)})")
        return lines

    # -- the file -----------------------------------------------------------------------
    def device_code(self) -> DeviceCode:
        """The parts of the file that depend on the device only: the same in every scale
        unit (wrapped already, see `DeviceCode`)."""
        p = self.p
        stages = self.stages
        if stages is None:
            body = self.forward_body()  # first: it collects adapters, imports and anchors
            params = ", ".join(["self", *(n if d is None else f"{n}={d}" for n, d in p.args)])
            methods = [f"def _forward_impl({params}):", *(_INDENT + line for line in body)]
        else:
            methods = stages.methods()
        for extra in self.methods:  # the pieces of recompute groups
            methods += ["", *extra]
        init = self.init_lines()
        where = stages.where() if stages is not None else ""
        imports = ["", "import torch"]
        modules = sorted(m for m in self.imports if m not in ("torch", "builtins"))
        imports += [f"import {m}" for m in modules if not m.startswith("nnscaler.")]
        # the public runtime only (docs/runtime.md): nnscaler's own ops come from
        # nnscaler.runtime.ops, everything else from nnscaler.runtime
        imports.append("")
        imports += [f"import {m}" for m in modules if m.startswith("nnscaler.")]
        names = ["ParallelModule", "boundary"]
        if self.adapters:
            names.append("Adapter")
        if stages is not None:
            names += stages.runtime_names(methods)
        if any(line.lstrip().startswith("zero3.") for line in methods):
            names.append("zero3")
        imports.append(f"from nnscaler.runtime import {', '.join(sorted(names))}")
        for d in self.defs:
            imports += ["", "", d.rstrip()]
        if self.adapters:
            imports.append("")
        schedule = ["", *stages.schedule_lines()] if stages is not None else []
        body = ["", f"{_INDENT}def __init__(self, init_params: bool = True) -> None:",
                f"{_INDENT * 2}super().__init__(init_params)"]
        body += [_INDENT * 2 + line for line in init]
        body += [f"{_INDENT * 2}self._post_init(init_params)", ""]
        body += [_INDENT + line if line else "" for line in methods]
        return DeviceCode(
            where=where,
            imports=Wrapped.of(imports),
            adapters=tuple(sorted(set(self.adapters), key=lambda s: s.index)),
            schedule=Wrapped.of(schedule),
            body=Wrapped.of(body),
            per_unit=self.per_unit,
        )

    def adapter_definition(self, spec: AdapterSpec) -> tuple[str, ...]:
        """``ADAPTER_{index} = Adapter(...)`` on this scale unit's ranks, under a comment
        with its steps (the same in every file of the unit that runs the adapter)."""
        src, dst = shifted(spec.src, self.offset), shifted(spec.dst, self.offset)
        if not self.offset or relabel_invariant():  # the unit's plan is unit 0's renamed
            steps = describe_plan(spec.plan, self.offset)
        else:
            steps = describe_plan(unit_plan(spec.plan, self.offset, invariant=False))
        return (f"# {spec.label}: {steps}",
                f'ADAPTER_{spec.index} = Adapter("{src}", "{dst}", shape={tuple(src.shape)!r}, '
                f"dtype={literal(spec.full.dtype)})")

    def source(self, code: DeviceCode | None = None, shared: Wrapped | None = None,
               adapter_lines: dict[tuple[int, int], Wrapped] | None = None) -> str:
        """The file of this rank; ``code``: this device's `device_code`, made by a
        rank of another scale unit (it is the same in every unit unless
        `DeviceCode.per_unit`); ``shared``: `program_attributes`;
        ``adapter_lines``: `adapter_definition` by adapter and unit offset, filled
        as they are made (the ranks of one unit that run an adapter share its lines)."""
        if code is None or code.per_unit:
            code = self.device_code()
        p = self.p
        head = header(p, self.rank, code.where)
        definitions: list[Wrapped] = []
        for spec in code.adapters:
            key = (spec.index, self.offset)
            wrapped = None if adapter_lines is None else adapter_lines.get(key)
            if wrapped is None:
                wrapped = Wrapped.of(self.adapter_definition(spec))
                if adapter_lines is not None:
                    adapter_lines[key] = wrapped
            definitions.append(wrapped)
        adapters = Wrapped.joined(definitions)
        cls = ["", "", "class GenModel(ParallelModule):", f"{_INDENT}rank = {self.rank}"]
        pipeline = self.stages.pipeline_attr() if self.stages is not None else []
        # the file is the concatenation of these parts, wrapped line by line: the parts of
        # the device and of the program are wrapped once (outside a string, where every
        # part ends)
        parts = [Wrapped.of(head), code.imports, adapters, code.schedule,
                 Wrapped.of(cls), shared or program_attributes(p), Wrapped.of(pipeline),
                 code.body]
        if any(part.ends_in_string for part in parts):  # a '"""' left open: wrap it whole
            raw = [line for part in parts for line in part.raw]
            return "\n".join(wrap_lines(raw)) + "\n"
        return "\n".join(part.text for part in parts if part.lines) + "\n"


#: How a block of generated lines runs: (no_grad, the autocast of its ops).
_Mode = tuple[bool, tuple[tuple[str, torch.dtype], ...]]


def _render(blocks: list[tuple[_Mode | None, list[str]]]) -> list[str]:
    body: list[str] = []
    for mode, lines in blocks:
        if mode is None:  # a recompute marker
            body += lines
            continue
        no_grad, autocast = mode
        contexts = ["torch.no_grad()"] if no_grad else []
        contexts += [f"torch.autocast({device!r}, dtype={literal(dtype)})"
                     for device, dtype in autocast]
        if contexts:
            body.append(f"with {', '.join(contexts)}:")
            body += [_INDENT + line for line in lines]
        else:
            body += lines
    return body


def generate_rank(program: Program, rank: int) -> str:
    """The source of ``gencode{rank}.py``."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < program.runtime_ngpus:
        raise CodegenError(
            f"rank must be an int in [0, {program.runtime_ngpus}) (runtime_ngpus is "
            f"{program.runtime_ngpus}), got {rank!r}; generate the file of a rank of the job"
        )
    return _Rank(program, rank).source()


def generate(program: Program) -> dict[int, str]:
    """The source of every rank's file, by rank (each is `generate_rank`'s).

    The body of a file depends on the rank's device only, so it is made once per device
    of the plan and shared by that device's ranks in the other scale units: the work grows
    with ``plan_ngpus`` x the program, plus ``runtime_ngpus`` x a header, not with
    ``runtime_ngpus`` x the program. The class attributes shared by every rank (the
    process groups) are written once."""
    codes: dict[int, DeviceCode] = {}
    shared = program_attributes(program)
    adapter_lines: dict[tuple[int, int], Wrapped] = {}
    calls: dict[Hashable, CallSource] = {}
    out: dict[int, str] = {}
    for rank in range(program.runtime_ngpus):
        writer = _Rank(program, rank)
        writer.calls = calls
        code = codes.get(writer.device)
        if code is None:
            code = codes[writer.device] = writer.device_code()
        out[rank] = writer.source(code, shared, adapter_lines)
    return out
