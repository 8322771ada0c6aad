"""The graph: ops in program order, the tensors they connect, inputs and outputs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from nnscaler.errors import GraphError
from nnscaler.ir.op import Op, tensors_in
from nnscaler.ir.tensor import FullTensor, SubTensor, TensorKind


class Graph:
    """Ops in the order they ran, with producers and consumers of every full tensor.

    ``inputs`` maps each forward argument name to its value's structure, with a
    `SubTensor` for every tensor and constants elsewhere; ``outputs`` is the value
    ``forward`` returned, in the same form. ``data_dependent`` lists the Python values that
    the trace read from tensor *data* (``x.item()``, ``if x.any():``) and the calls whose
    result's size depends on data (``torch.nonzero``): the graph holds the values and sizes
    seen then, as constants (``parallelize`` refuses such a graph unless allowed).
    """

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.tensors: list[FullTensor] = []
        self.inputs: dict[str, Any] = {}
        self.outputs: Any = None
        self.data_dependent: list[str] = []
        self._next_tensor_id = 0
        self._next_op_id = 0
        self._producers: dict[FullTensor, list[Op]] = {}
        self._consumers: dict[FullTensor, list[Op]] = {}

    # -- building -----------------------------------------------------------------------
    def next_op_id(self) -> int:
        self._next_op_id += 1
        return self._next_op_id - 1

    def _next_tid(self) -> int:
        self._next_tensor_id += 1
        return self._next_tensor_id - 1

    def new_tensor(self, **fields: Any) -> FullTensor:
        """A new `FullTensor` of this graph (``tid`` is assigned)."""
        t = FullTensor(tid=self._next_tid(), **fields)
        self.tensors.append(t)
        return t

    def new_version(self, tensor: FullTensor, *, shape: tuple[int, ...] | None = None,
                    requires_grad: bool | None = None) -> FullTensor:
        """The next version of ``tensor`` (after an in-place op)."""
        t = tensor.new_version(self._next_tid(), shape=shape, requires_grad=requires_grad)
        self.tensors.append(t)
        return t

    def add_op(self, op: Op) -> Op:
        """Append ``op``; its inputs must already be produced (or be leaves)."""
        self._index(op)
        self.ops.append(op)
        return op

    def _index(self, op: Op) -> None:
        for full in dict.fromkeys(t.full for t in op.input_tensors()):  # once per op
            self._consumers.setdefault(full, []).append(op)
        for full in dict.fromkeys(t.full for t in op.output_tensors()):
            self._producers.setdefault(full, []).append(op)

    def reindex(self) -> None:
        """Recompute producers and consumers from `ops` (after editing the list)."""
        self._producers, self._consumers = {}, {}
        for op in self.ops:
            self._index(op)

    def reindex_replaced(self, op: Op, instances: list[Op]) -> None:
        """Update producers and consumers after ``op`` was replaced, at its place in
        `ops`, by ``instances`` that read and write the same full tensors (a
        partition or a replication): linear in the size of the lists touched, where
        `reindex` is linear in the graph."""

        def fulls(ops: list[Op], kind: str) -> list[dict[FullTensor, None]]:
            attr = "input_tensors" if kind == "in" else "output_tensors"
            return [dict.fromkeys(t.full for t in getattr(o, attr)()) for o in ops]

        for kind, index in (("in", self._consumers), ("out", self._producers)):
            (mine,) = fulls([op], kind)
            theirs = fulls(instances, kind)
            if any(f.keys() != mine.keys() for f in theirs):
                self.reindex()  # the instances touch other tensors: rebuild everything
                return
            for full in mine:
                ops = index[full]
                at = ops.index(op)
                ops[at:at + 1] = instances

    # -- queries ------------------------------------------------------------------------
    def producers(self, tensor: FullTensor | SubTensor) -> list[Op]:
        """The ops that write ``tensor`` (one in a traced graph; several once partitioned)."""
        full = tensor.full if isinstance(tensor, SubTensor) else tensor
        return list(self._producers.get(full, ()))

    def consumers(self, tensor: FullTensor | SubTensor) -> list[Op]:
        """The ops that read ``tensor``, in program order."""
        full = tensor.full if isinstance(tensor, SubTensor) else tensor
        return list(self._consumers.get(full, ()))

    def _of_kind(self, kind: TensorKind) -> list[FullTensor]:
        return [t for t in self.tensors if t.kind is kind and t.version == 0]

    def parameters(self) -> list[FullTensor]:
        """Every parameter once (a tied parameter is one tensor with several names)."""
        return self._of_kind(TensorKind.PARAMETER)

    def buffers(self) -> list[FullTensor]:
        return self._of_kind(TensorKind.BUFFER)

    def constants(self) -> list[FullTensor]:
        return self._of_kind(TensorKind.CONSTANT)

    def input_tensors(self) -> list[SubTensor]:
        return list(tensors_in(self.inputs))

    def output_tensors(self) -> list[SubTensor]:
        return list(tensors_in(self.outputs))

    def opaque_ops(self) -> list[Op]:
        return [op for op in self.ops if op.is_opaque]

    def named_parameters(self) -> dict[str, FullTensor]:
        """Every qualified name of every parameter (tied ones appear under each name)."""
        return {name: t for t in self.parameters() for name in t.names}

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    # -- checks and text ----------------------------------------------------------------
    def validate(self) -> None:
        """Raise `GraphError` if an op reads a tensor that nothing produced before it."""
        ready = {t.full for t in self.input_tensors()}
        ready |= {t for t in self.tensors if t.is_leaf}
        for op in self.ops:
            for t in op.input_tensors():
                if t.full not in ready:
                    raise GraphError(
                        f"op #{op.oid} {op.name} ({op.short_source}) reads {t.full.name}, which "
                        f"no earlier op produces and which is not an input, parameter, buffer "
                        f"or constant; producers: {[p.oid for p in self.producers(t)]}"
                    )
            ready |= {t.full for t in op.output_tensors()}
        for t in self.output_tensors():
            if t.full not in ready:
                raise GraphError(f"the graph outputs {t.full.name}, which no op produces")

    def __str__(self) -> str:
        from nnscaler.ir.format import format_graph

        return format_graph(self)

    def __repr__(self) -> str:
        return (f"<Graph: {len(self.ops)} ops, {len(self.parameters())} parameters, "
                f"inputs {list(self.inputs)}>")
