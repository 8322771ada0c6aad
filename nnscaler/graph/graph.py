"""``IRGraph``: the traced graph as a policy sees it, with the operations a policy applies.

A policy is a callable ``(graph, compute_config) -> graph``. It finds ops with
[`IRGraph.select`][nnscaler.IRGraph.select], splits them with
[`IRGraph.partition`][nnscaler.IRGraph.partition] (through the op's transform space, see
``docs/annotations.md``) or copies them with [`IRGraph.replicate`][nnscaler.IRGraph.replicate],
places every resulting op instance on a device with [`IRGraph.assign`][nnscaler.IRGraph.assign], and
may cut the program into pipeline stages ([`IRGraph.staging`][nnscaler.IRGraph.staging]), mark ops
for recomputation ([`IRGraph.recompute`][nnscaler.IRGraph.recompute]) or give each consumer of a
tensor its own copy ([`IRGraph.multiref`][nnscaler.IRGraph.multiref]).
[`IRGraph.check`][nnscaler.IRGraph.check] then says whether the plan is complete. See
``docs/policies.md``.

Partitioning and replicating replace an op *in place*: its instances take its position in
program order, so the order of the program never changes. An instance reads and writes
`SubTensor` pieces of the op's tensors; splitting an instance again
splits its pieces further.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Sequence
from typing import Any

import attrs
import torch.utils._pytree as pytree

from nnscaler.anno import AnnotationError, Transform, ValuePartial
from nnscaler.graph.errors import PartitionError, PlanError, StagingError
from nnscaler.graph.op_parts import new_instance, op_parts, shapes_str, talking_parts
from nnscaler.ir import FullTensor, Graph, Op, OpPlan, SubTensor
from nnscaler.ops.registry import OpRegistry
from nnscaler.registry import active_registry

_GLOB = frozenset("*?[")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)




def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class IRGraph(Graph):
    """A traced `Graph` plus the policy writer's operations.

    Build one from a traced graph with [`from_graph`][nnscaler.IRGraph.from_graph] (``parallelize``
    does this before it calls the policy). The graph keeps track of what each op became: an op that
    was partitioned or replicated is no longer in `ops`, and passing it again gives an
    error that names its instances ([`instances`][nnscaler.IRGraph.instances] lists them).
    """

    def __init__(self) -> None:
        super().__init__()
        self._origin: dict[Op, Op] = {}  # instance -> the traced (or inserted) op it came from
        self._parent: dict[Op, tuple[Op, str]] = {}  # instance -> (the op it replaced, how)
        self._replaced: dict[Op, tuple[Op, ...]] = {}  # op gone from the graph -> its instances
        self._split: dict[Op, tuple[Transform, int]] = {}  # part -> (its transform, part)
        self._recompute_groups = 0
        self.num_stages = 0
        #: the ZeRO stage the policy chose (`choose_zero_stage`); None: it chose none
        self.zero_stage: int | None = None
        self._ops: OpRegistry | None = None  # None: the process-wide op registry
        self._hint = 0  # where the last replacement ended in ops (see _position)

    @classmethod
    def from_graph(cls, graph: Graph, *, ops: OpRegistry | None = None) -> IRGraph:
        """A copy of ``graph`` for a policy to edit; ``graph`` itself is left unchanged.

        Tensors are shared (they are values); every op is copied with its own plan.
        ``ops`` is the op registry that resolves the ops the graph inserts (multiref, a
        transform rule's part op); default: the one ``graph`` had, else the process-wide
        registry.
        """
        new = cls()
        new._ops = ops if ops is not None else getattr(graph, "_ops", None)
        mapping = {op: attrs.evolve(op, plan=op.plan.copy()) for op in graph.ops}
        new.ops = list(mapping.values())
        new.tensors = list(graph.tensors)
        new.inputs = graph.inputs
        new.outputs = graph.outputs
        new.data_dependent = list(graph.data_dependent)
        new._next_tensor_id = graph._next_tensor_id
        new._next_op_id = graph._next_op_id
        if isinstance(graph, IRGraph):
            new._origin = {mapping[i]: mapping.get(o, o) for i, o in graph._origin.items()
                           if i in mapping}
            new._parent = {mapping[i]: p for i, p in graph._parent.items() if i in mapping}
            new._replaced = {o: tuple(mapping.get(i, i) for i in insts)
                             for o, insts in graph._replaced.items()}
            new._split = {mapping.get(i, i): t for i, t in graph._split.items()}
            new._recompute_groups = graph._recompute_groups
            new.num_stages = graph.num_stages
        for op in new.ops:
            new._origin.setdefault(op, op)
        new.reindex()
        return new

    def op_registry(self) -> OpRegistry:
        """The op registry that resolves the ops this graph inserts by name."""
        return self._ops if self._ops is not None else active_registry("ops")

    # -- finding ops --------------------------------------------------------------------
    def nodes(self) -> list[Op]:
        """Every op instance, in program order."""
        return list(self.ops)

    def select(
        self,
        name: str | None = None,
        type: type | str | None = None,  # noqa: A002 - the name nnScaler users know
        module: str | None = None,
    ) -> list[Op]:
        """The op instances that match every given criterion, in program order.

        - ``name``: the op's name, exact or a glob, matched against the full name
          (``torch.nn.functional.linear``) or its last part (``linear``);
        - ``type``: the class of the module that made the call (the innermost one): a class,
          or a class name (qualified, or the bare ``Linear``);
        - ``module``: the path of that module (``gpt.blocks.0.mlp``): a prefix, matching the
          module and everything inside it, or a glob (``*.mlp.fc``).
        """
        return [op for op in self.ops if self._matches(op, name, type, module)]

    @staticmethod
    def _matches(op: Op, name: str | None, cls: type | str | None, module: str | None) -> bool:
        if name is not None:
            short = op.name.rsplit(".", 1)[-1]
            if not (fnmatch.fnmatchcase(op.name, name) or fnmatch.fnmatchcase(short, name)):
                return False
        if cls is not None:
            if isinstance(cls, str):
                if cls not in (op.module_class, op.module_class.rsplit(".", 1)[-1]):
                    return False
            elif op.module_class != _class_name(cls):
                return False
        if module is not None:
            path = op.module_path
            if _GLOB & set(module):
                if not fnmatch.fnmatchcase(path, module):
                    return False
            elif module and path != module and not path.startswith(module + "."):
                return False
        return True

    def origin(self, op: Op) -> Op:
        """The traced op (or the op inserted by [`multiref`][nnscaler.IRGraph.multiref]) that ``op``
        comes from."""
        return self._origin.get(op, op)

    def instances(self, op: Op) -> list[Op]:
        """The op instances in the graph that ``op`` became (``[op]`` while it is there)."""
        if op in self._origin:
            return [op]
        found = []
        for inst in self._replaced.get(op, ()):
            found += self.instances(inst)
        return found

    def split_parts(self, op: Op) -> list[Op]:
        """The parts of the split that made the instance ``op`` (``op`` among them), in
        part order; ``[op]`` when ``op`` is not a part of a split. The parts of a
        collective part op (`OpDef.collective`) are the group it talks to; where those
        parts were partitioned or replicated again, ``op`` talks to the instance at its
        own position under every other part (a strided group: under tensor x context
        parallelism, the devices of one head part). Raises `PlanError` where the parts
        were not replaced alike."""
        return talking_parts(self, op)

    def value_key(self, op: Op, out: int) -> tuple[tuple[tuple[str, int], int], ...]:
        """Which splits made output ``out`` of the instance ``op`` value-partial:
        ``((identifier, num), part)`` for each, outermost first (``()``: whole values).

        Parts of one tensor are summed only when these keys agree on the splits (see
        `nnscaler.graph.pieces`): parts of ``sum(x)`` split over rows do not mix with
        parts split over columns.
        """
        key = []
        at = op
        while at in self._parent:
            split = self._split.get(at)
            if split is not None:
                t, part = split
                if out < len(t.outputs) and isinstance(t.outputs[out], ValuePartial):
                    key.append(((t.ident, t.num), part))
            at = self._parent[at][0]
        return tuple(reversed(key))

    def describe(self, op: Op) -> str:
        """``op`` for messages: its name, annotation, source line, module and lineage."""
        anno = "opaque: no annotation" if op.anno is None else f"annotation '{op.anno}'"
        where = op.source or "<unknown source>"
        code = f" `{op.code.strip()}`" if op.code.strip() else ""
        text = (f"op #{op.oid} {op.name} ({anno}) at {where}{code}, in module "
                f"{op.module_path or '<root>'}")
        lineage = []
        at = op
        while at in self._parent:
            at, how = self._parent[at]
            lineage.append(how)
        if lineage:
            text += f" [{'; '.join(lineage)}]"
        return text

    def _require(self, op: Any, what: str) -> Op:
        """``op`` if it is an op instance of this graph; else a PlanError that says why."""
        if not isinstance(op, Op):
            raise TypeError(f"{what} takes an op of this graph (from graph.select or "
                            f"graph.nodes()), got {type(op).__name__} {op!r}")
        if op in self._origin:
            return op
        if op in self._replaced:
            insts = self.instances(op)
            raise PlanError(
                f"{what}: {self.describe(op)} is no longer in the graph: it was replaced by "
                f"{len(insts)} instances (ops {', '.join(f'#{i.oid}' for i in insts)}). Pass "
                f"those instead (graph.instances(op) lists them, partition and replicate "
                f"return them)."
            )
        raise PlanError(f"{what}: {self.describe(op)} is not an op of this graph; take ops "
                        f"from this graph's select() or nodes()")

    # -- replacing ops ------------------------------------------------------------------
    def _position(self, op: Op) -> int:
        """Where ``op`` is in `ops`. Policies mostly replace ops in program order, so
        the search starts where the last replacement ended (linear in the distance, not in
        the graph: partitioning every op stays linear) and wraps around."""
        hint = getattr(self, "_hint", 0)  # (a graph unpickled from an older version)
        hint = hint if hint < len(self.ops) else 0
        try:
            return self.ops.index(op, hint)
        except ValueError:
            return self.ops.index(op, 0, hint)

    def _replace(self, op: Op, instances: Sequence[Op], how: Sequence[str]) -> None:
        at = self._position(op)
        self.ops[at:at + 1] = list(instances)
        self._hint = at + len(instances)
        origin = self._origin.pop(op)
        for inst, label in zip(instances, how, strict=True):
            self._origin[inst] = origin
            self._parent[inst] = (op, label)
        self._replaced[op] = tuple(instances)
        self.reindex_replaced(op, list(instances))

    def replicate(self, op: Op, times: int = 1) -> list[Op]:
        """Replace ``op`` by ``times`` copies that read and write the same pieces.

        Any op can be replicated, opaque ones included (it is all they allow). The copies
        start unassigned; they keep the op's stage and recompute group.
        """
        op = self._require(op, "replicate")
        if not _is_int(times) or times < 1:
            raise PlanError(f"replicate {self.describe(op)}: times is the number of copies, a "
                            f"positive int; got {times!r}")
        copies = [new_instance(self, op) for _ in range(times)]
        self._replace(op, copies, [f"replica {i} of {times} of op #{op.oid}"
                                   for i in range(times)])
        return copies

    def partition(
        self,
        op: Op,
        algo: str | None = None,
        *,
        idx: int,
        dim: int | None,
        num: int,
    ) -> list[Op]:
        """Split ``op`` in ``num`` parts along dim ``dim`` of its input ``idx``
        (``dim=None``: split the values, by the op's value rule: value parts of input
        ``idx`` in, value parts out).

        The split must be in the op's transform space (its annotation, or its op's
        transform rules): every tensor that carries the split identifier is split the same
        way, outputs that lose a ``+`` identifier become value-partial, the others are
        replicated. ``op`` is replaced, at its position, by the ``num`` parts, which are
        returned; each part holds its pieces of the op's tensors and its own keyword
        arguments, and can itself be partitioned. ``algo`` is accepted for nnScaler's
        ``partition(node, algo, idx=, dim=, num=)`` form; the only algorithm is ``'dim'``.
        """
        if algo is not None and algo != "dim":
            raise PartitionError(
                f"partition: the algorithm {algo!r} is not known; the only one is 'dim' "
                f"(split along a dim of the transform space): graph.partition(op, idx=..., "
                f"dim=..., num=...)"
            )
        op = self._require(op, "partition")
        for key, value in (("idx", idx), ("dim", dim), ("num", num)):
            if not _is_int(value) and not (key == "dim" and value is None):
                raise TypeError(f"partition {self.describe(op)}: {key} must be an int"
                                f"{' or None (split the values)' if key == 'dim' else ''}, "
                                f"got {value!r}")
        if op.is_opaque or op.anno is None or op.opdef is None:
            raise PartitionError(
                f"cannot partition {self.describe(op)}: the op has no dim annotation, so "
                f"nnscaler cannot tell how to split it. Replicate it "
                f"(graph.replicate(op, times=...)), or register an annotation for "
                f"{op.name} with nnscaler.register_op"
            )
        anno, given = op.anno, dim
        if dim is not None and 0 <= idx < len(anno.expanded.inputs) and dim < 0:  # from the end
            dim += len(anno.expanded.inputs[idx].dims or ())
        try:
            transform = anno.split(idx, dim, num, rules=op.opdef.rules_for(anno))
        except AnnotationError as e:
            legal = anno.transform_space(rules=op.opdef.rules_for(anno))
            fix = ("Pick one of the legal choices, or replicate the op" if legal
                   else "Replicate the op")
            raise PartitionError(
                f"cannot partition {self.describe(op)} with idx={idx}, dim={given}, num={num} "
                f"(input shapes {shapes_str(op.input_tensors())}): {e}\n{fix} "
                f"(graph.replicate(op, times=...))."
            ) from None
        if op.opdef.collective and transform.part_op is not None:
            raise PartitionError(
                f"cannot partition {self.describe(op)} as {transform}: it is a part of a "
                f"split whose parts talk to each other ({op.opdef.name}), and this split "
                f"would make its parts run {transform.part_op} instead. A talking part splits "
                f"again only along a dim its own annotation leaves free (its instances then "
                f"talk to the instances at the same position under the other parts); split "
                f"the op it came from differently, or replicate the part")
        parts = op_parts(self, op, transform)
        self._replace(op, parts, [f"part {p} of {num} of op #{op.oid} ({transform})"
                                  for p in range(num)])
        self._split.update({part: (transform, p) for p, part in enumerate(parts)})
        return parts

    # -- placing ops --------------------------------------------------------------------
    def assign(self, op: Op, device: int) -> Op:
        """Run the op instance ``op`` on ``device`` (an index into the scale unit)."""
        op = self._require(op, "assign")
        if not _is_int(device) or device < 0:
            raise PlanError(f"assign {self.describe(op)}: device is an index into the scale "
                            f"unit, an int >= 0; got {device!r}")
        op.plan.device = device
        return op

    def multiref(self, tensor: FullTensor | SubTensor) -> Op:
        """Give each op that reads ``tensor`` its own copy, through one inserted identity op.

        Afterwards the consumers read different tensors, so their partitions may differ
        without constraining each other. Instances of one op (already partitioned or
        replicated) share one copy. The new op (``nnscaler.graph.ops.multiref``) sits just
        before the first consumer, has an annotation (every dim splits) and is returned:
        partition and assign it like any other op.
        """
        from nnscaler.graph.ops import MULTIREF_NAME, multiref_annotation

        if not isinstance(tensor, (FullTensor, SubTensor)):
            raise TypeError(f"multiref takes a tensor of the graph (a FullTensor or a piece of "
                            f"one), got {type(tensor).__name__} {tensor!r}")
        full = tensor.full if isinstance(tensor, SubTensor) else tensor
        consumers = self.consumers(full)
        groups: dict[Op, list[Op]] = {}
        for op in consumers:
            groups.setdefault(self.origin(op), []).append(op)
        if len(groups) < 2:
            raise PlanError(
                f"multiref {full}: the tensor is read by {len(groups)} op(s); multiref gives "
                f"each of several consumers its own copy, so there is nothing to do"
            )
        for op in consumers:
            if any(before.full is full for before, _ in op.mutations):
                raise PlanError(f"multiref {full}: {self.describe(op)} changes it in place, "
                                f"so its consumers cannot each take a copy")
        opdef = self.op_registry().get(MULTIREF_NAME)
        times = len(groups)
        anno = multiref_annotation(full.ndim, times)
        first = consumers[0]
        at = self.ops.index(first)
        copies = [self.new_tensor(shape=full.shape, dtype=full.dtype,
                                  requires_grad=full.requires_grad) for _ in range(times)]
        outputs = tuple(c.whole() for c in copies)
        ref = Op(
            oid=self.next_op_id(),
            name=opdef.name,
            fn=opdef.fn,
            opdef=opdef,
            anno=anno.bind([full.shape], {"times": times}),
            inputs=(full.whole(),),
            kwargs={"times": times},
            outputs=outputs,
            output_spec=pytree.tree_flatten(outputs)[1],
            module_path=first.module_path,
            module_class=first.module_class,
            source_file=first.source_file,
            source_line=first.source_line,
            code=first.code,
            no_grad=all(op.no_grad for op in consumers),
            plan=OpPlan(stage=first.plan.stage),
        )
        renamed = {}
        for copy, insts in zip(copies, groups.values(), strict=True):
            for op in insts:
                renamed[op] = self._reading(op, full, copy)
        self.ops = [renamed.get(op, op) for op in self.ops]
        self.ops.insert(at, ref)
        self._origin[ref] = ref
        for old, new in renamed.items():
            self._origin[new] = self._origin.pop(old)
            self._parent[new] = (old, f"reads a copy of {full.name} from op #{ref.oid}")
            self._replaced[old] = (new,)
        self.reindex()
        return ref

    def _reading(self, op: Op, full: FullTensor, copy: FullTensor) -> Op:
        """``op`` reading ``copy`` wherever it read ``full`` (same pieces)."""

        def swap(x: Any) -> Any:
            if isinstance(x, SubTensor) and x.full is full:
                return SubTensor(full=copy, indmap=x.indmap, valmap=x.valmap)
            return x

        return attrs.evolve(
            op,
            inputs=tuple(pytree.tree_map(swap, list(op.inputs))),
            kwargs=pytree.tree_map(swap, dict(op.kwargs)),
            plan=op.plan,  # the same instance, moved: its plan moves with it
        )

    def choose_zero_stage(self, stage: int) -> None:
        """Record the ZeRO stage (0 to 3, ``docs/zero.md``) this plan is made for: with
        ``ComputeConfig(zero_stage='auto')``, ``parallelize`` generates the code, the
        reducers and the checkpoints for it."""
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise PlanError(f"choose_zero_stage takes a ZeRO stage, 0, 1, 2 or 3, got "
                            f"{stage!r}")
        self.zero_stage = stage

    # -- pipeline stages and recomputation ----------------------------------------------
    def staging(self, ops: Sequence[Op]) -> list[list[Op]]:
        """Cut the program into pipeline stages: each op of ``ops`` starts one.

        ``ops`` are given in program order and the first must be the first op of the
        graph; every op gets the index of the stage it falls in (ops added later by
        partition, replicate or multiref inherit it). Returns the ops of each stage.
        """
        if isinstance(ops, Op) or not isinstance(ops, Sequence) or not ops:
            raise StagingError(f"staging takes a non-empty list of ops, each of which starts a "
                               f"stage, got {ops!r}")
        starts: list[int] = []
        seen: dict[Op, int] = {}
        for k, given in enumerate(ops):
            op = self._require(given, "staging")
            if op in seen:
                raise StagingError(f"staging: {self.describe(op)} is given twice (entries "
                                   f"{seen[op]} and {k}); each stage starts at a different op")
            seen[op] = k
            starts.append(self.ops.index(op))
        if starts[0] != 0:
            raise StagingError(
                f"staging: stage 0 must start at the first op of the graph, "
                f"{self.describe(self.ops[0])}; it starts at {self.describe(ops[0])} (position "
                f"{starts[0]}), which would leave the ops before it in no stage"
            )
        for k in range(1, len(starts)):
            if starts[k] <= starts[k - 1]:
                raise StagingError(
                    f"staging: stages must start in program order, but stage {k} starts at "
                    f"{self.describe(ops[k])} (position {starts[k]}), before stage {k - 1}'s "
                    f"first op {self.describe(ops[k - 1])} (position {starts[k - 1]}); list "
                    f"the ops in program order"
                )
        bounds = [*starts, len(self.ops)]
        stages = [self.ops[a:b] for a, b in zip(bounds, bounds[1:])]
        for s, members in enumerate(stages):
            for op in members:
                op.plan.stage = s
        self.num_stages = len(stages)
        return [list(members) for members in stages]

    def recompute(self, ops: Sequence[Op] | str | Sequence[str]) -> int:
        """Mark ``ops`` as one recomputation group: their activations are not kept for
        backward but recomputed. ``ops`` may also be module paths (each selects the ops
        of that module, as ``select(module=...)``). Returns the group's number."""
        if isinstance(ops, str):
            ops = [ops]
        if isinstance(ops, Op) or not isinstance(ops, Sequence):
            raise TypeError(f"recompute takes a list of ops or module paths, got {ops!r}")
        chosen: list[Op] = []
        for item in ops:
            if isinstance(item, str):
                found = self.select(module=item)
                if not found:
                    paths = sorted({op.module_path for op in self.ops if op.module_path})
                    close = difflib.get_close_matches(item, paths, n=4)
                    hint = (f"did you mean one of {close}?" if close
                            else f"module paths of this graph include {paths[:12]}")
                    raise PlanError(f"recompute: no op runs in module {item!r}; {hint}")
                chosen += found
            else:
                chosen.append(self._require(item, "recompute"))
        chosen = list(dict.fromkeys(chosen))
        if not chosen:
            raise PlanError("recompute: no ops given; pass the ops (or module paths) to "
                            "recompute together")
        for op in chosen:
            if op.plan.recompute is not None:
                raise PlanError(f"recompute: {self.describe(op)} is already in recompute group "
                                f"{op.plan.recompute}; an op belongs to one group")
        stages = {op.plan.stage for op in chosen}
        if len(stages) > 1:
            raise PlanError(f"recompute: the ops span the pipeline stages {sorted(stages)}; a "
                            f"recompute group must lie within one stage")
        group = self._recompute_groups
        self._recompute_groups += 1
        for op in chosen:
            op.plan.recompute = group
        return group

    # -- checking -----------------------------------------------------------------------
    def check(self, ndevices: int) -> None:
        """Raise `PlanCheckError` unless the plan is complete on
        ``ndevices`` devices; see `nnscaler.graph.check_plan`."""
        from nnscaler.graph.check import check_plan

        check_plan(self, ndevices)

    def __repr__(self) -> str:
        assigned = sum(op.plan.device is not None for op in self.ops)
        return (f"<IRGraph: {len(self.ops)} op instances ({assigned} assigned), "
                f"{len(self.parameters())} parameters, inputs {list(self.inputs)}>")



def as_irgraph(graph: Graph) -> IRGraph:
    """``graph`` itself when it is an [`IRGraph`][nnscaler.IRGraph], else a copy of it as one."""
    return graph if isinstance(graph, IRGraph) else IRGraph.from_graph(graph)
