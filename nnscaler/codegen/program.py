"""The analysis behind code generation: what every device runs, in one global order.

`build_program` walks a planned graph once, for all ranks:

- it groups the op instances into *steps*: consecutive instances of one traced op (one
  instance per device at most);
- it computes the layout of every tensor as its producers write it (leaves: parameters,
  buffers and constants in their *canonical* layout, the one their first consumer wants
  with value parts folded into replicas; forward inputs replicated on every device), and
  the layout each step reads it in;
- where the two differ it plans an adapter (`nnscaler.layout.plan`), reusing an
  earlier adapter of the same tensor to the same layout;
- graph outputs are brought to ``R(plan_ngpus)`` (replicated on the whole scale unit);
- it records the holders of every parameter piece and the process groups all ranks
  create, in one order;
- for a graph cut into pipeline stages it also finds the stages' device sets, the
  tensors that cross each stage boundary and the schedule
  (`nnscaler.codegen.pipeline`); layouts are then seen per stage (a tensor made in
  an earlier stage arrives lane by lane in the layout it was made in, a parameter is held
  by every stage that reads it) and adapters never span two stages.

`nnscaler.codegen.emit` then writes one file per rank from the result. The types of the
result (`Program`, `OpStep`, `Read`, ...) are in `nnscaler.codegen.program_types`; they
are importable from here too.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from nnscaler.codegen.errors import CodegenError
from nnscaler.codegen.groups import process_groups
from nnscaler.codegen.layouts import Placed, fold_values, replicated, restrict, to_layout
from nnscaler.codegen.naming import Namer, identifier
from nnscaler.codegen.pipeline import (
    PipelinePlan,
    find_stages,
    make_schedule,
    map_layout,
    pipeline_settings,
)
from nnscaler.codegen.program_types import (
    RESERVED,
    AdapterSpec,
    Leaf,
    OpStep,
    Output,
    Program,
    Read,
)
from nnscaler.codegen.recompute import check_groups as check_recompute_groups
from nnscaler.config import ComputeConfig, ComputeConfigError, PipelineConfig, as_compute_config
from nnscaler.graph import IRGraph, check_plan
from nnscaler.graph.check import written_by
from nnscaler.graph.graph import as_irgraph
from nnscaler.ir import FullTensor, Graph, Op, SubTensor, TensorKind, tensors_in
from nnscaler.layout import Layout
from nnscaler.layout import plan as make_plan
from nnscaler.runtime.zero3 import check_units


def program_config(compute_config: Any, plan_ngpus: int, runtime_ngpus: int) -> ComputeConfig:
    """The [`ComputeConfig`][nnscaler.ComputeConfig] a program is built for: ``compute_config``
    (or the fields of a mapping or object, or the defaults for None) with ``plan_ngpus``
    and ``runtime_ngpus``; validated by ``ComputeConfig`` itself."""
    if isinstance(compute_config, ComputeConfig):
        if (compute_config.plan_ngpus, compute_config.runtime_ngpus) != (plan_ngpus,
                                                                          runtime_ngpus):
            raise CodegenError(
                f"build_program was given plan_ngpus={plan_ngpus}, runtime_ngpus="
                f"{runtime_ngpus}, but compute_config says {compute_config.plan_ngpus}, "
                f"{compute_config.runtime_ngpus}; pass the numbers of the compute config"
            )
        return compute_config
    data = compute_config if isinstance(compute_config, Mapping) or compute_config is None \
        else {n: getattr(compute_config, n) for n in ComputeConfig.field_names()
              if hasattr(compute_config, n)}
    fields = {**dict(data or {}), "plan_ngpus": plan_ngpus, "runtime_ngpus": runtime_ngpus}
    try:
        return as_compute_config(fields)
    except ComputeConfigError as e:
        raise CodegenError(f"build_program: {e}") from None


def _runs(g: IRGraph) -> list[tuple[Op, list[Op]]]:
    """Maximal runs of consecutive instances of one traced op."""
    runs: list[tuple[Op, list[Op]]] = []
    for op in g.ops:
        origin = g.origin(op)
        if runs and runs[-1][0] is origin:
            runs[-1][1].append(op)
        else:
            runs.append((origin, [op]))
    return runs


def _forward_args(
    g: IRGraph, signature: inspect.Signature | None, namer: Namer
) -> list[tuple[str, str | None]]:
    from nnscaler.codegen.literals import literal

    traced = list(g.inputs)
    if signature is None:
        names = [(n, None) for n in traced]
    else:
        params = [p for p in signature.parameters.values() if p.name != "self"
                  and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        missing = [n for n in traced if n not in {p.name for p in params}]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        if missing and not takes_any:
            raise CodegenError(
                f"the graph was traced with the forward arguments {traced}, but the given "
                f"forward signature {signature} lacks {missing}; pass the signature of the "
                f"traced module's forward"
            )
        names = []
        for p in params:
            if p.name in g.inputs:
                names.append((p.name, None))
                continue
            try:  # not traced: the trace used the default; accept and ignore the argument
                default = literal(p.default) if p.default is not p.empty else "None"
            except CodegenError:
                default = "None"
            names.append((p.name, default))
        names += [(n, None) for n in missing]  # taken by **kwargs: keyword arguments here
    for name, _ in names:
        if not name.isidentifier() or name in RESERVED:
            raise CodegenError(
                f"the forward argument {name!r} cannot be a parameter of the generated "
                f"forward: generated code reserves the names {sorted(RESERVED)}. Rename the "
                f"argument in the model's forward"
            )
        namer.reserve(name)
    return names


def build_program(
    graph: Graph,
    *,
    plan_ngpus: int,
    runtime_ngpus: int,
    end2end: bool = False,
    inference_only: bool = False,
    compute_config: ComputeConfig | Mapping[str, Any] | None = None,
    forward_signature: inspect.Signature | None = None,
    pipeline: PipelineConfig | Mapping[str, Any] | None = None,
    origin: Mapping[str, Any] | None = None,
) -> Program:
    """Analyse a planned, checked graph for code generation (see the module docstring).

    Raises `PlanCheckError` for an incomplete plan (an op not
    assigned to a device of ``0 .. plan_ngpus - 1``, a piece nothing writes) and
    `CodegenError` for what code generation cannot do (pieces that do not form an
    RVD layout, ``runtime_ngpus`` not a multiple of ``plan_ngpus``, ...).

    A graph cut into two or more stages ([`staging`][nnscaler.IRGraph.staging]) becomes
    a pipeline (see `nnscaler.codegen.pipeline`): ``pipeline`` (a
    `PipelineConfig` or a dict with ``pipeline_nmicros`` and
    ``pipeline_scheduler``) or else ``compute_config.pipeline`` gives the schedule.

    ``compute_config`` is a [`ComputeConfig`][nnscaler.ComputeConfig], or a mapping (or an
    object) with some of its fields, turned into one with ``plan_ngpus`` and
    ``runtime_ngpus``; it gives the reducer options (``compute_config.reducer``).

    ``origin`` says what produced the plan, for the header of each file: ``module`` (the
    model's class path), ``policy`` (its name) and ``config`` (other compute config
    fields worth showing, by name); [`nnscaler.parallelize`][nnscaler.parallelize] passes them.
    """
    config = program_config(compute_config, plan_ngpus, runtime_ngpus)
    if not isinstance(graph, Graph):
        raise TypeError(f"build_program takes a planned graph (an IRGraph a policy placed), "
                        f"got {type(graph).__name__} {graph!r}")
    g = as_irgraph(graph)
    check_plan(g, plan_ngpus)
    pipe = _pipeline_of(g, plan_ngpus, end2end, config, pipeline)
    _check_compile(pipe, config)
    builder = _Builder(g, plan_ngpus, runtime_ngpus, pipe)
    args = _forward_args(g, forward_signature, builder.namer)
    builder.args = {name for name, _ in args}
    if pipe is not None:
        _check_pipeline_args(g, args)
    builder.name_inputs()
    steps = [builder.step(origin, insts, pos) for pos, (origin, insts) in enumerate(builder.runs)]
    check_recompute_groups(g, g.describe)
    outputs, output_adapters = builder.outputs()
    builder.name_held()
    if pipe is not None:
        builder.boundaries()
        pipe.schedule = make_schedule(pipe)
    program = Program(
        graph=g,
        plan_ngpus=plan_ngpus,
        runtime_ngpus=runtime_ngpus,
        end2end=bool(end2end),
        inference_only=bool(inference_only),
        reducer_config=config.reducer.as_options(),
        args=args,
        steps=steps,
        outputs=outputs,
        output_adapters=output_adapters,
        leaves=builder.leaves,
        variables=builder.variables,
        adapters=builder.adapters,
        process_groups=[],
        reducer_groups=[],
        pipeline=pipe,
        compile_config=config.compiler.as_options(),
        origin=_origin(origin, config),
    )
    program.process_groups, program.reducer_groups = process_groups(program)
    check_units(config.reducer.zero_units, (n for f in program.leaves for n in f.names
                                            if f.kind is TensorKind.PARAMETER))
    return program


def _pipeline_of(g: IRGraph, plan_ngpus: int, end2end: bool, config: ComputeConfig,
                 pipeline: PipelineConfig | Mapping[str, Any] | None) -> PipelinePlan | None:
    """The pipeline of a plan cut into stages, with its schedule settings (``pipeline``,
    else ``config.pipeline``); None for a plan without stages."""
    pipe = find_stages(g, plan_ngpus)
    if pipe is None:
        return None
    if not end2end:
        raise CodegenError(
            f"the plan cuts the graph into {len(pipe.stages)} pipeline stages, but the "
            f"module is not end2end: a pipeline runs its stages over micro-batches in "
            f"train_step/infer_step, which needs forward(sample) -> loss first. "
            f"Parallelize with ComputeConfig(use_end2end=True), or use a policy without "
            f"pipeline stages (e.g. 'tp')"
        )
    pipe.settings = pipeline_settings(config, pipeline)
    return pipe


def _check_compile(pipe: PipelinePlan | None, config: ComputeConfig) -> None:
    if pipe is not None and config.compiler.enabled:
        raise CodegenError(
            f"ComputeConfig(compile=...) is not supported for a pipelined plan (this one has "
            f"{len(pipe.stages)} stages): its stages run under a schedule that interleaves "
            f"micro-batches and point-to-point transfers, which the compiled regions do not "
            f"cover yet. Compile a plan without stages, or leave compile off"
        )


def _origin(origin: Mapping[str, Any] | None, compute_config: ComputeConfig) -> dict[str, Any]:
    out = dict(origin or {})
    config = dict(out.get("config") or {})
    pas = compute_config.pas_config
    if pas:
        config.setdefault("pas_config", dict(pas))
    if config:
        out["config"] = config
    return out


def _none_allowed(op: Op, k: int) -> bool:
    """Input slot ``k`` of ``op`` is an argument by itself (not inside a list) whose
    parameter defaults to ``None`` in the op's signature (a bias)."""
    sig = op.opdef.signature if op.opdef is not None else None
    if sig is None:
        return False
    params = list(sig.parameters.values())
    start = 0
    for i, x in enumerate(op.inputs):
        n = sum(1 for _ in tensors_in(x))
        if start <= k < start + n:
            return (n == 1 and isinstance(x, SubTensor) and i < len(params)
                    and params[i].default is None)
        start += n
    for name, x in op.kwargs.items():
        n = sum(1 for _ in tensors_in(x))
        if start <= k < start + n:
            p = sig.parameters.get(name)
            return n == 1 and isinstance(x, SubTensor) and p is not None and p.default is None
        start += n
    return False


def _check_pipeline_args(g: IRGraph, args: list[tuple[str, str | None]]) -> None:
    if not args:
        raise CodegenError(
            "a pipelined module takes the sample as the first argument of forward, but the "
            "traced forward takes no argument; give forward the sample (an end2end module)"
        )
    traced = [name for name, default in args if default is None]
    if len(traced) > 1 or (traced and traced[0] != args[0][0]):
        raise CodegenError(
            f"a pipelined module takes the sample as the first argument of forward and "
            f"keeps the defaults of the others (an end2end module), but the graph was "
            f"traced with the arguments {list(g.inputs)}; trace with the sample only "
            f"(dummy_forward_args={{{args[0][0]!r}: ...}})"
        )


class _Builder:
    def __init__(self, g: IRGraph, plan_ngpus: int, runtime_ngpus: int,
                 pipe: PipelinePlan | None = None) -> None:
        self.g = g
        self.pipe = pipe
        self.stage = 0  # the stage of the step being built (pipelines)
        self.produced_in: dict[FullTensor, int] = {}  # activation -> stage of its writers
        self.last_read: dict[FullTensor, int] = {}  # activation -> last stage reading it
        self.n = plan_ngpus
        self.runtime_ngpus = runtime_ngpus
        self.namer = Namer(RESERVED)
        self.args: set[str] = set()
        self.leaves: dict[FullTensor, Leaf] = {}
        self.variables: dict[FullTensor, str] = {}
        self.adapters: list[AdapterSpec] = []
        self._cache: dict[tuple[FullTensor, Layout, Layout, bool, int], AdapterSpec] = {}
        self._produced: dict[FullTensor, Layout] = {}
        self.writes: dict[FullTensor, list[Placed]] = {}
        self.writers: dict[FullTensor, list[Op]] = {}
        self.last_write: dict[FullTensor, int] = {}
        self.runs = _runs(g)
        for pos, (_, insts) in enumerate(self.runs):
            for op in insts:
                for piece, key in written_by(g, op):
                    self.writes.setdefault(piece.full, []).append(
                        Placed.of(op.device, piece, key))  # type: ignore[arg-type]
                    self.writers.setdefault(piece.full, []).append(op)
                    self.last_write[piece.full] = pos
                    if op.plan.stage is not None:
                        self.produced_in[piece.full] = op.plan.stage

    # -- names ----------------------------------------------------------------------------
    def name_inputs(self) -> None:
        for piece in self.g.input_tensors():
            full = piece.full
            if full in self.leaves or full.kind is not TensorKind.INPUT:
                continue
            access = full.names[0] if full.names else full.name
            # a top-level tensor argument is its own variable; a nested one gets a name
            name = access if access in self.args else self.namer.new(identifier(access))
            self.leaves[full] = Leaf(full, replicated(full.shape, range(self.n)), name, access)

    def name_held(self) -> None:
        """Attribute names for held leaves, in the graph's tensor order (so that every
        rank names them alike, whatever it holds)."""
        from nnscaler.runtime.module import ParallelModule

        attrs_namer = Namer(set(dir(ParallelModule)) | RESERVED)
        for full in self.g.tensors:
            leaf = self.leaves.get(full)
            if leaf is None or full.kind is TensorKind.INPUT:
                continue
            stem = full.names[0] if full.names else f"const_{full.tid}"
            leaf.name = attrs_namer.new(identifier(stem))

    def variable(self, full: FullTensor) -> str:
        if full not in self.variables:
            self.variables[full] = self.namer.new(f"t{full.tid}")
        return self.variables[full]

    def stem(self, full: FullTensor) -> str:
        leaf = self.leaves.get(full)
        if leaf is not None and full.kind is TensorKind.INPUT:
            return leaf.name
        if leaf is not None:
            return identifier(full.names[0] if full.names else f"const_{full.tid}")
        return self.variable(full)

    # -- layouts --------------------------------------------------------------------------
    def source(self, full: FullTensor, first_use: Layout | None, pos: int,
               reader: str) -> Layout:
        """Where ``full`` lives before ``reader`` (at run ``pos``) reads it (in a
        pipeline: on the devices of the stage being built)."""
        pipe = self.pipe
        here = pipe.stages[self.stage] if pipe is not None else None
        if full.kind is TensorKind.INPUT and full.version == 0:
            if here is not None:  # every stage reads the sample itself
                return replicated(full.shape, here.devices)
            return self.leaves[full].layout
        if full.is_leaf:
            leaf = self.leaves.get(full)
            if leaf is None:
                devices = here.devices if here is not None else range(self.n)
                layout = fold_values(first_use) if first_use is not None \
                    else replicated(full.shape, devices)
                leaf = Leaf(full, layout, "", group=here.group if here is not None else 0)
                self.leaves[full] = leaf
            if here is None or pipe is None:
                return leaf.layout
            leaf.groups.add(here.group)
            return map_layout(leaf.layout, pipe.groups[leaf.group], here.devices)
        if full not in self._produced:
            writers = self.writers.get(full, [])
            what = ("the op instances that write it (" + ", ".join(
                f"#{w.oid} on device {w.device}" for w in writers[:8]) + ")") if writers \
                else "no op"
            self._produced[full] = to_layout(full, self.writes.get(full, []),
                                             what=f"{full} as written by {what}")
        if self.last_write.get(full, -1) >= pos:
            raise CodegenError(
                f"{reader} reads {full} before the last op instance that writes it has run "
                f"(the instances of one op must be consecutive in program order); keep the "
                f"instances that partition or replicate an op together"
            )
        if here is None or pipe is None:
            return self._produced[full]
        at = self.produced_in[full]
        if at == self.stage:
            return self._produced[full]
        # made by an earlier stage: it arrives lane by lane, in the layout it was made in
        pipe.produced[full] = (at, self._produced[full])
        self.last_read[full] = max(self.last_read.get(full, at), self.stage)
        return pipe.view(full, self.stage)

    def adapter(self, full: FullTensor, src: Layout, dst: Layout,
                no_grad: bool) -> tuple[AdapterSpec | None, bool]:
        """The adapter from ``src`` to ``dst`` (None when every device of ``dst`` already
        holds its piece), and whether it is new (not an earlier adapter reused)."""
        src = restrict(src, dst.devices) or src
        if src == dst:
            return None, False
        key = (full, src, dst, no_grad, self.stage)
        if key in self._cache:
            return self._cache[key], False
        plan = make_plan(src, dst)
        if not plan.steps:
            return None, False
        index = len(self.adapters)
        spec = AdapterSpec(index=index, full=full, src=src, dst=dst, plan=plan,
                           no_grad=no_grad, result=self.namer.new(f"{self.stem(full)}_{index}"),
                           label=self.stem(full))
        self.adapters.append(spec)
        self._cache[key] = spec
        return spec, True

    # -- steps ----------------------------------------------------------------------------
    def step(self, origin: Op, insts: list[Op], pos: int) -> OpStep:
        g = self.g
        if self.pipe is not None:
            self.stage = insts[0].plan.stage or 0
        by_device: dict[int, Op] = {}
        for op in insts:
            device = op.device
            if device in by_device:
                raise CodegenError(
                    f"two instances of {g.describe(origin)} run on device {device}: "
                    f"{g.describe(by_device[device])} and {g.describe(op)}. A device runs at "
                    f"most one instance of an op, so that it holds one piece of each tensor "
                    f"(an RVD layout). Fix: assign the instances to different devices, or "
                    f"partition the op into fewer parts"
                )
            by_device[device] = op  # type: ignore[index]
        no_grad = all(op.no_grad for op in insts)
        slots = [op.input_tensors() for op in insts]
        nslots = len(slots[0])
        if any(len(s) != nslots for s in slots):
            raise CodegenError(f"the instances of {g.describe(origin)} read different numbers "
                               f"of tensors; the op was edited inconsistently")
        reads: list[Read] = []
        adapters: list[AdapterSpec] = []
        reader = g.describe(origin)
        for k in range(nslots):
            full = slots[0][k].full
            if any(s[k].full is not full for s in slots):
                raise CodegenError(f"the instances of {reader} read different tensors in "
                                   f"input {k}; the op was edited inconsistently")
            placed = [Placed.of(op.device, s[k]) for op, s in zip(insts, slots, strict=True)]  # type: ignore[arg-type]
            dst = to_layout(full, placed, what=f"{reader} reads input {k}")
            if self._first_part(full, dst, insts, k):
                reads.append(Read(full, dst, None, first_part=True))
                continue
            src = self.source(full, dst, pos, reader)
            spec, new = self.adapter(full, src, dst, no_grad)
            if new and spec is not None:
                adapters.append(spec)
            reads.append(Read(full, dst, spec))
        self._check_mutations(origin, insts, reads)
        for op in insts:
            for t in op.output_tensors():
                if not t.full.is_leaf:
                    self.variable(t.full)
        step = OpStep(origin, by_device, adapters, reads, no_grad,
                      self._part_devices(origin, insts))
        if self.pipe is not None:
            self.pipe.stages[self.stage].steps.append(step)
        return step

    def _first_part(self, full: FullTensor, dst: Layout, insts: list[Op], k: int) -> bool:
        """Whether input ``k`` of ``insts`` is a weight read in value parts into an
        argument that may be ``None`` (see `Read`); if so the weight is held on the
        devices of value part 0 only (its first reader decides, as for every weight)."""
        if dst.v == 1 or not full.is_leaf or full.version or full.kind not in (
                TensorKind.PARAMETER, TensorKind.BUFFER, TensorKind.CONSTANT):
            return False
        if not all(_none_allowed(op, k) for op in insts):
            return False
        if any(before.full is full for op in insts for before, _ in op.mutations):
            return False
        firsts = [d for d in dst.devices if dst.coords(d)[1] == 0]
        held = restrict(fold_values(dst), firsts)
        if held is None:
            return False
        pipe = self.pipe
        here = pipe.stages[self.stage] if pipe is not None else None
        leaf = self.leaves.get(full)
        if leaf is None:
            leaf = Leaf(full, held, "", group=here.group if here is not None else 0)
            self.leaves[full] = leaf
        mine = leaf.layout if here is None or pipe is None else map_layout(
            leaf.layout, pipe.groups[leaf.group], here.devices)
        if mine != held:
            return False
        if here is not None:
            leaf.groups.add(here.group)
        return True

    def _part_devices(self, origin: Op, insts: list[Op]) -> dict[int, tuple[int, ...]] | None:
        """The devices of the parts each instance of a collective part op talks to, in
        part order, by the instance's device; None for any other op. The groups of the
        instances split the instances: one group when the op was split once, several
        (strided over the unit) when the parts were split or replicated again, or when
        the op's replicas were each split."""
        if not any(op.opdef is not None and op.opdef.collective for op in insts):
            return None
        groups: dict[int, tuple[int, ...]] = {}
        for inst in insts:
            parts = self.g.split_parts(inst)
            if not set(parts) <= set(insts) or len(set(parts)) != len(parts):
                raise CodegenError(
                    f"{self.g.describe(origin)} is split into {len(parts)} parts that talk to "
                    f"each other ({inst.opdef.name}), but {len(insts)} instances of it run "
                    f"here and not every part is one of them: each part must run exactly "
                    f"once, on its own device. Fix: partition the op into as many parts as "
                    f"devices, and replace every part alike"
                )
            groups[inst.device] = tuple(op.device for op in parts)  # type: ignore[misc]
        return groups

    def _check_mutations(self, origin: Op, insts: list[Op], reads: list[Read]) -> None:
        g = self.g
        read_fulls = {r.full: r for r in reads}
        for op in insts:
            for before, _ in op.mutations:
                r = read_fulls.get(before.full)
                if r is None:
                    if not all(p.is_whole for i in insts for p in
                               (*i.input_tensors(), *i.output_tensors())):
                        raise CodegenError(
                            f"{g.describe(op)} writes {before.full} in place through a view, "
                            f"which generated code follows only when every instance of the op "
                            f"holds whole tensors; replicate the op (and the ops that made the "
                            f"view) instead of partitioning it"
                        )
                    continue
                if r.adapter is not None and before.full.kind in (
                        TensorKind.PARAMETER, TensorKind.BUFFER) and before.full.version == 0:
                    raise CodegenError(
                        f"{g.describe(op)} updates the {before.full.kind.value} {before.full} in "
                        f"place, but reads it in the layout {r.layout}, not in the layout the "
                        f"module holds it in ({r.adapter.src}), so the update would be lost. "
                        f"Fix: partition this op like the first op that reads "
                        f"{before.full.name}, or replicate both"
                    )

    # -- outputs --------------------------------------------------------------------------
    def outputs(self) -> tuple[list[Output], list[AdapterSpec]]:
        outs: list[Output] = []
        adapters: list[AdapterSpec] = []
        seen: set[FullTensor] = set()
        end = len(self.runs)
        devices: Any = range(self.n)
        if self.pipe is not None:  # the outputs come out of the last stage
            self.stage = self.pipe.last
            devices = self.pipe.stages[self.pipe.last].devices
        for piece in self.g.output_tensors():
            full = piece.full
            if full in seen:
                continue
            seen.add(full)
            dst = replicated(full.shape, devices)
            src = self.source(full, dst, end, "the graph's output")
            spec, new = self.adapter(full, src, dst, no_grad=False)
            if new and spec is not None:
                adapters.append(spec)
            outs.append(Output(full, dst, spec))
        return outs, adapters

    def boundaries(self) -> None:
        """The tensors each stage receives and sends: an activation made in stage ``a``
        and read last in stage ``b > a`` goes through every boundary in between."""
        pipe = self.pipe
        if pipe is None:
            return
        for full in sorted(self.last_read, key=lambda f: f.tid):
            at, last = self.produced_in[full], self.last_read[full]
            for s in range(at, last):
                pipe.stages[s].outputs.append(full)
                pipe.stages[s + 1].inputs.append(full)
