"""An operator of the IR: one call of a torch function (or a registered op) in forward."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.utils._pytree as pytree

from nnscaler.ir.tensor import SubTensor

if TYPE_CHECKING:
    from nnscaler.anno import BoundAnno
    from nnscaler.ops.registry import OpDef


def autocast_context(autocast: Sequence[tuple[str, torch.dtype]]) -> Any:
    """``torch.autocast`` for each recorded ``(device_type, dtype)``, nested (a null
    context for none)."""
    if not autocast:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for device_type, dtype in autocast:
        stack.enter_context(torch.autocast(device_type, dtype=dtype))
    return stack


@attrs.define(kw_only=True)
class OpPlan:
    """How a policy runs one op instance; filled by `nnscaler.graph`, empty when traced.

    - ``device``: the device of the scale unit that runs the instance;
    - ``stage``: its pipeline stage ([`nnscaler.graph.IRGraph.staging`][nnscaler.IRGraph.staging]);
    - ``recompute``: the activation-recomputation group it belongs to.

    Unlike the `Op` that holds it, a plan is mutable: ``attrs.evolve(op, ...)``
    shares it, so pass ``plan=`` a new one when copying an op.
    """

    device: int | None = None
    stage: int | None = None
    recompute: int | None = None

    def copy(self) -> OpPlan:
        return OpPlan(device=self.device, stage=self.stage, recompute=self.recompute)


#: Leaves that are never containers: skipped without asking pytree.
_ATOMS = frozenset({int, float, bool, complex, str, bytes, type(None), type(Ellipsis), slice,
                    torch.dtype, torch.device, torch.layout, torch.memory_format})


def _collect(tree: Any, out: list[SubTensor]) -> None:
    kind = type(tree)
    if kind is SubTensor:
        out.append(tree)
    elif kind is list or kind is tuple:
        for item in tree:
            _collect(item, out)
    elif kind is dict:
        for item in tree.values():
            _collect(item, out)
    elif kind not in _ATOMS:  # anything else as pytree flattens it (namedtuples, ...)
        out.extend(leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, SubTensor))


def tensors_in(tree: Any) -> Iterator[SubTensor]:
    """Every `SubTensor` in a nested structure of lists, tuples and dicts, in the order of
    ``torch.utils._pytree.tree_leaves`` (plain lists, tuples and dicts are walked here:
    pytree's generic flattening was most of the time of code generation at scale)."""
    out: list[SubTensor] = []
    _collect(tree, out)
    return iter(out)


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``pytree.tree_map(fn, tree)``, walking plain lists, tuples and dicts itself (code
    generation maps the arguments of every op instance)."""
    kind = type(tree)
    if kind is list:
        return [map_leaves(fn, x) for x in tree]
    if kind is tuple:
        return tuple(map_leaves(fn, x) for x in tree)
    if kind is dict:
        return {k: map_leaves(fn, v) for k, v in tree.items()}
    if kind is SubTensor or kind in (int, float, bool, str, type(None)):
        return fn(tree)  # a leaf
    return pytree.tree_map(fn, tree)


@attrs.frozen(kw_only=True, eq=False)
class Op:
    """One recorded call.

    - ``opdef``: the registered op, or ``None`` for an *opaque* op (a torch function with
      no annotation): it can only be replicated;
    - ``anno``: the annotation bound to this call's shapes (``None`` when opaque);
    - ``inputs``: aligned with ``anno.inputs`` (the annotated parameters, in order); for an
      opaque op, the positional arguments. Tensors are `SubTensor`, possibly inside
      lists (``torch.cat``); everything else is a constant;
    - ``kwargs``: every other argument, by name (constants; a tensor here is an input too);
    - ``keywords``: the parameters the model's call passed by keyword (generated code
      passes them by keyword again, as the user wrote them);
    - ``outputs``: the leaves of the value the function returned (a `SubTensor` per
      tensor, constants otherwise) and ``output_spec``, how they nest;
    - ``mutations``: ``(before, after)`` per tensor the op changed in place: later ops see
      ``after``, a new version of the same tensor;
    - where it came from: ``module_path`` (``'layers.0.self_attn'``; ``''`` for the root),
      ``module_class``, the model's ``source_file``/``source_line`` and its ``code``;
    - ``no_grad``: the call ran with gradients disabled;
    - ``autocast``: ``(device_type, dtype)`` for every device type whose ``torch.autocast``
      was on during the call (``()``: none); `call` and generated code run the op
      under the same autocast, so it computes in the dtypes eager did;
    - ``plan``: where a policy placed this instance (device, pipeline stage, recompute
      group); see `OpPlan`.
    """

    oid: int
    name: str
    fn: Callable[..., Any] = attrs.field(repr=False)
    opdef: OpDef | None = attrs.field(repr=False)
    anno: BoundAnno | None
    inputs: tuple[Any, ...] = attrs.field(converter=tuple)
    kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    keywords: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    outputs: tuple[Any, ...] = attrs.field(converter=tuple)
    output_spec: pytree.TreeSpec = attrs.field(repr=False)
    mutations: tuple[tuple[SubTensor, SubTensor], ...] = attrs.field(default=(), converter=tuple)
    module_path: str = ""
    module_class: str = ""
    source_file: str = ""
    source_line: int = 0
    code: str = ""
    no_grad: bool = False
    autocast: tuple[tuple[str, torch.dtype], ...] = attrs.field(default=(), converter=tuple)
    plan: OpPlan = attrs.field(factory=OpPlan, repr=False)

    @property
    def device(self) -> int | None:
        """The device a policy assigned this instance to (``None``: not assigned)."""
        return self.plan.device

    @property
    def stage(self) -> int | None:
        """The pipeline stage of this instance (``None``: not staged)."""
        return self.plan.stage

    @property
    def recompute(self) -> int | None:
        """The recompute group of this instance (``None``: activations are kept)."""
        return self.plan.recompute

    @property
    def is_opaque(self) -> bool:
        """No annotation: the op can only be replicated."""
        return self.opdef is None

    @property
    def inplace(self) -> bool:
        return bool(self.mutations)

    @property
    def source(self) -> str:
        """``file:line`` of the model's code that made the call."""
        return f"{self.source_file}:{self.source_line}" if self.source_file else ""

    @property
    def short_source(self) -> str:
        return f"{os.path.basename(self.source_file)}:{self.source_line}" if self.source_file else ""

    def input_tensors(self) -> list[SubTensor]:
        """Every tensor the op reads (inputs, then keyword arguments)."""
        out: list[SubTensor] = []
        _collect(self.inputs, out)
        for value in self.kwargs.values():
            _collect(value, out)
        return out

    def output_tensors(self) -> list[SubTensor]:
        """Every tensor the op produces: its results and the new versions it writes."""
        outs: list[SubTensor] = []
        _collect(self.outputs, outs)
        if not self.mutations:
            return outs
        seen = {id(t.full) for t in outs}
        outs += [after for _, after in self.mutations if id(after.full) not in seen]
        return outs

    def result(self) -> Any:
        """The returned value's structure with IR tensors as leaves."""
        return pytree.tree_unflatten(list(self.outputs), self.output_spec)

    def call(self, inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Run the op on concrete ``inputs``/``kwargs`` laid out as `inputs`/`kwargs`."""
        with autocast_context(self.autocast):
            if self.opdef is not None:
                return self.opdef.call(inputs, kwargs)
            return self.fn(*inputs, **kwargs)

    def __str__(self) -> str:
        from nnscaler.ir.format import format_op

        return format_op(self)
