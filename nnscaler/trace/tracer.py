"""The tracer: run ``forward`` once and record every torch-level call as an op.

How it works. A `torch.overrides.TorchFunctionMode` sees each call the model makes
at the level of ``torch.nn.functional.linear``, ``Tensor.view``, ``torch.cat``, dunders,
property reads and creation functions (what those functions call inside is not seen).
Each call is run, then:

- a call that returns no tensor and changes none (``x.shape``, ``x.size(0)``,
  ``x.item()``) is not recorded: its value flows on as a Python constant (values read
  from tensor data are listed in ``graph.data_dependent``; on ``meta`` they are an error);
- every other call becomes an `Op`, annotated when the op registry
  knows the function, *opaque* otherwise. A call that changes an argument in place
  (detected by the tensor's version counter, so ``x[i] = v``, ``out=`` and
  ``inplace=True`` are covered) gives the changed tensor, and every tracked view of the
  same storage, a new version. Each op keeps the grad mode and the ``torch.autocast``
  state it ran under; a call whose result's *size* depends on data (``torch.nonzero``,
  ``x[mask]``, ``torch.where(cond)``) is listed in ``graph.data_dependent`` too.

With the real strategy the forward runs on the user's module: `SavedState`
(`nnscaler.trace.module_state`) puts back what it changed (buffers, parameters written in
place, the random generators), so tracing leaves the module as it was. The tables that
say what kind of call a function is are in `nnscaler.trace.call_kinds`.

Functions wrapped by [`nnscaler.register_op`][nnscaler.register_op] reach the tracer through
`nnscaler.ops.registry.op_call_interceptor`: one op is recorded and the function
runs with recording off. Global module forward hooks keep the module path; recording
spans the root module's whole call, its own hooks included. Parameters, buffers and
inputs are tracked by object identity (``id``), each mapped to its current IR tensor.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from nnscaler.ir import CURRENT_DEVICE, Graph, Op, SubTensor, TensorKind
from nnscaler.ops.registry import OpDef, op_call_interceptor
from nnscaler.plugins import get_plugin_manager
from nnscaler.registry import USER_REGISTRANT
from nnscaler.trace.call_kinds import (
    DATA_READS,
    DEVICE_MOVES,
    METADATA_CALLS,
    STATE_CALLS,
    autocast_state,
    check_outputs,
    class_name,
    data_sized,
    func_name,
    may_write,
    shapes_str,
    storage_of,
    version_of,
)
from nnscaler.trace.errors import (
    MetaDataDependentError,
    MetaTraceError,
    OpaqueOpWarning,
    TraceError,
)
from nnscaler.trace.forward_args import check_forward_args
from nnscaler.trace.module_state import SavedState
from nnscaler.trace.moe import expert_layers
from nnscaler.trace.moe_weights import view_expert_weights
from nnscaler.trace.source import code_line, model_frame

STRATEGIES = ("real", "meta")

_T = torch.Tensor


class _Mode(TorchFunctionMode):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.tracer.on_call(func, args, kwargs or {})


class Tracer:
    """One trace of one module; use `nnscaler.trace.trace`."""

    def __init__(self, module: torch.nn.Module, strategy: str) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"trace needs a torch.nn.Module, got {type(module).__name__}")
        if strategy not in STRATEGIES:
            raise ValueError(
                f"strategy must be one of {STRATEGIES}, got {strategy!r}: 'real' runs forward "
                f"on the dummy values, 'meta' on the meta device (shapes only, fast)"
            )
        self.module = module
        self.meta = strategy == "meta"
        self.graph = Graph()
        self.registry = get_plugin_manager().ops
        self._ir: dict[int, SubTensor] = {}  # id(tensor) -> its current IR tensor
        self._alive: dict[int, torch.Tensor] = {}  # keeps tracked ids from being reused
        self._views: dict[int, list[torch.Tensor]] = {}  # id(storage root) -> tracked tensors
        self._meta_copy: dict[int, torch.Tensor] = {}  # meta: id(real tensor) -> meta copy
        self._meta_origin: dict[int, torch.Tensor] = {}  # meta: id(meta copy) -> real tensor
        self._stack: list[tuple[str, str]] = []  # (module path, module class)
        self._root = ("", class_name(type(module)))
        self._active = False  # inside the call of the root module (hooks included)
        self._paths: dict[int, list[str]] = {}
        for name, m in module.named_modules(remove_duplicate=False):
            self._paths.setdefault(id(m), []).append(name)
        self._passthrough = 0
        self._warned: set[Any] = set()
        self._saved: SavedState | None = None

    # -- tensors ------------------------------------------------------------------------
    def _track(self, t: torch.Tensor, sub: SubTensor) -> SubTensor:
        key = id(t)
        self._ir[key] = sub
        if key not in self._alive:
            self._alive[key] = t
            root = t._base if t._base is not None else t
            self._views.setdefault(id(root), []).append(t)
        return sub

    def _ir_of(self, t: torch.Tensor) -> SubTensor:
        sub = self._ir.get(id(t))
        if sub is None:  # a tensor the model holds without registering it: a constant
            full = self.graph.new_tensor(
                shape=tuple(t.shape), dtype=t.dtype, requires_grad=t.requires_grad,
                kind=TensorKind.CONSTANT, value=t.detach(),
            )
            sub = self._track(t, full.whole())
        return sub

    def _to_meta(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            return t
        copy = self._meta_copy.get(id(t))
        if copy is None:
            copy = t.detach().to("meta").requires_grad_(t.requires_grad)
            self._meta_copy[id(t)] = copy
            self._meta_origin[id(copy)] = t
            self._track(copy, self._ir_of(t))
        return copy

    def _leaf_to_ir(self, leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return self._ir_of(leaf)
        if isinstance(leaf, torch.device):
            return CURRENT_DEVICE
        return leaf

    def _to_ir(self, tree: Any) -> Any:
        return pytree.tree_map(self._leaf_to_ir, tree)

    # -- module path --------------------------------------------------------------------
    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if module is self.module and not self._active:
            # recording starts with the root's call and ends when it returned, so that the
            # root's own hooks (which run after this global one) are recorded too
            self._active = True
        parent = self._stack[-1][0] if self._stack else ""
        names = self._paths.get(id(module))
        if not names:  # a module created inside forward: its ops belong to the caller
            path = parent
        elif len(names) == 1 or not self._stack:
            path = names[0]
        else:  # one module under several names: the one below the calling module
            below = [n for n in names if not parent or n.startswith(parent + ".")]
            path = min(below or names, key=lambda n: n.count("."))
        self._stack.append((path, class_name(type(module))))

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    # -- calls --------------------------------------------------------------------------
    def on_call(self, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Every torch-level call while the mode is active."""
        if self._passthrough or not self._active or func in METADATA_CALLS or func in STATE_CALLS:
            return func(*args, **kwargs)
        return self._record(func, args, kwargs, self.registry.lookup(func), user_op=False)

    def on_registered_op(self, opdef: OpDef, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A call of a function wrapped by ``register_op``: one op, never traced into."""
        if self._passthrough or not self._active:
            return opdef.fn(*args, **kwargs)
        self._passthrough += 1
        try:
            return self._record(opdef.fn, args, kwargs, opdef, user_op=True)
        finally:
            self._passthrough -= 1

    def _where(self, func: Callable[..., Any] | None = None) -> tuple[str, int, str]:
        filename, line = model_frame(func)
        return filename, line, f"{filename}:{line}"

    def _device_args(self, func: Callable[..., Any], args: tuple,
                     kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """Spell every device as a ``torch.device``, so that it is recorded as
        CURRENT_DEVICE (and, on the meta strategy, replaced by ``meta``)."""
        dev = kwargs.get("device")
        if dev is not None and not isinstance(dev, torch.device):
            kwargs = {**kwargs, "device": torch.device(dev)}
        if func is _T.to and len(args) > 1 and isinstance(args[1], (str, int)) \
                and not isinstance(args[1], bool):
            args = (args[0], torch.device(args[1]), *args[2:])
        return args, kwargs

    def _record(self, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                opdef: OpDef | None, *, user_op: bool) -> Any:
        if func in DATA_READS:
            return self._data_read(func, args, kwargs)
        args, kwargs = self._device_args(func, args, kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self.meta:
            if func in DEVICE_MOVES:
                return args[0]
            flat = [
                self._to_meta(x) if isinstance(x, torch.Tensor)
                else torch.device("meta") if isinstance(x, torch.device) else x
                for x in flat
            ]
            args, kwargs = pytree.tree_unflatten(flat, spec)
        inputs = [x for x in flat if isinstance(x, torch.Tensor)]
        versions = [version_of(t) for t in inputs]
        if self._saved is not None and may_write(func, kwargs):
            self._saved.keep(inputs)
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            if self.meta:
                raise self._meta_error(func, e) from e
            raise
        mutated = {id(t): t for t, v in zip(inputs, versions, strict=True) if version_of(t) != v}
        out_flat, out_spec = pytree.tree_flatten(out)
        if self.meta and any(isinstance(o, torch.Tensor) and o.device.type != "meta"
                             for o in out_flat):
            out_flat = [o.to("meta") if isinstance(o, torch.Tensor) else o for o in out_flat]
            out = pytree.tree_unflatten(out_flat, out_spec)
        outs = [o for o in out_flat if isinstance(o, torch.Tensor)]
        if not outs and not mutated and not user_op:
            return out  # a Python value: flows on as a constant

        filename, line, source = self._where(func)
        name = opdef.name if opdef is not None else func_name(func)
        opdef, anno, ir_inputs, ir_kwargs, keywords = self._annotate(
            func, opdef, name, args, kwargs, inputs, outs, (filename, line, source))
        mutations, ir_outputs = self._ir_results(mutated, out_flat)

        path, cls = self._stack[-1] if self._stack else self._root
        self.graph.add_op(
            Op(
                oid=self.graph.next_op_id(),
                name=name,
                fn=func,
                opdef=opdef,
                anno=anno,
                inputs=tuple(ir_inputs),
                kwargs=dict(ir_kwargs),
                keywords=keywords,
                outputs=tuple(ir_outputs),
                output_spec=out_spec,
                mutations=tuple(mutations),
                module_path=path,
                module_class=cls,
                source_file=filename,
                source_line=line,
                code=code_line(filename, line),
                no_grad=not torch.is_grad_enabled(),
                autocast=autocast_state(),
            )
        )
        if data_sized(func, args, kwargs):
            sizes = ", ".join(str(list(o.shape)) for o in outs)
            sizes = f"({sizes})" if len(outs) > 1 else sizes
            self.graph.data_dependent.append(f"{name} -> size {sizes} at {source}")
        return out

    def _annotate(self, func: Callable[..., Any], opdef: OpDef | None, name: str, args: tuple,
                  kwargs: dict[str, Any], inputs: list[torch.Tensor], outs: list[torch.Tensor],
                  where: tuple[str, int, str]) -> tuple:
        """Bind the call to its op's annotation: (opdef, bound anno, IR inputs, IR kwargs,
        keyword names). A call whose annotation does not fit becomes an opaque op (a user's
        op is an error instead); an op without annotation is opaque, with a warning."""
        filename, line, source = where
        anno, ir_inputs, ir_kwargs = None, None, None
        keywords: frozenset[str] = frozenset()
        annotated = opdef is not None
        if opdef is not None:
            try:
                call = opdef.bind(args, kwargs)
                anno = call.anno.bind(call.shapes(), call.kwargs)
                check_outputs(anno, outs)
            except Exception as e:
                if opdef.registrant == USER_REGISTRANT:
                    raise TraceError(
                        f"the annotation of op {name!r} does not fit its call at {source} "
                        f"(input shapes {shapes_str(inputs)}): {e}. Fix the annotation given to "
                        f"register_op."
                    ) from e
                self._warn_once(
                    (func, "bind"),
                    f"the annotation of {name!r} (registered by {opdef.registrant!r}) does not "
                    f"fit its call at {source} (input shapes {shapes_str(inputs)}): {e}. The call "
                    f"is recorded as an opaque op (replicated only); please report this to "
                    f"the op's registrant.",
                    filename, line,
                )
                opdef, anno = None, None
            else:
                ir_inputs, ir_kwargs = self._to_ir(call.inputs), self._to_ir(call.kwargs)
                keywords = call.keywords
        if opdef is None:
            if not annotated:
                self._warn_once(
                    func,
                    f"{name} has no dim annotation, so it is recorded as an opaque op that "
                    f"can only be replicated (first call at {source}: "
                    f"{code_line(filename, line)!r}). To let policies split it, register an "
                    f"annotation for it: nnscaler.register_op('<annotation>')({name})",
                    filename, line,
                )
            ir_inputs, ir_kwargs = self._to_ir(args), self._to_ir(kwargs)
        return opdef, anno, ir_inputs, ir_kwargs, keywords

    def _ir_results(self, mutated: dict[int, torch.Tensor],
                    out_flat: list[Any]) -> tuple[list, list]:
        """New versions of the tensors the call wrote in place (with their views), and the IR
        of its outputs (an output that is a written input is that input's new version)."""
        mutations = []
        after_of: dict[int, SubTensor] = {}
        for t in self._with_views(mutated):
            before = self._ir_of(t)
            after = self.graph.new_version(
                before.full, shape=tuple(t.shape), requires_grad=t.requires_grad
            ).whole()
            mutations.append((before, after))
            after_of[id(t)] = self._track(t, after)
            origin = self._meta_origin.get(id(t))
            if origin is not None:
                self._track(origin, after)
        ir_outputs = []
        for o in out_flat:
            if not isinstance(o, torch.Tensor):
                ir_outputs.append(self._leaf_to_ir(o))
            elif id(o) in after_of:
                ir_outputs.append(after_of[id(o)])
            else:
                full = self.graph.new_tensor(
                    shape=tuple(o.shape), dtype=o.dtype, requires_grad=o.requires_grad
                )
                ir_outputs.append(self._track(o, full.whole()))
        return mutations, ir_outputs

    def _with_views(self, mutated: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """The mutated tensors and every tracked tensor sharing their storage."""
        out = dict(mutated)
        for t in mutated.values():
            root = t._base if t._base is not None else t
            for view in self._views.get(id(root), ()):
                out.setdefault(id(view), view)
        return list(out.values())

    def _data_read(self, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        filename, line, source = self._where(func)
        name = func_name(func)
        if self.meta and any(isinstance(x, torch.Tensor) and x.device.type == "meta"
                             for x in pytree.tree_leaves((args, kwargs))):
            raise MetaDataDependentError(
                f"{name} reads a Python value from tensor data at {source} "
                f"({code_line(filename, line)!r}): the model's shapes or control flow depend "
                f"on data, which the meta strategy does not compute. Trace with "
                f"strategy='real' (trace_strategy='real' in parallelize), or avoid the read."
            )
        value = func(*args, **kwargs)
        self.graph.data_dependent.append(f"{name} -> {value!r} at {source}")
        return value

    def _meta_error(self, func: Callable[..., Any], e: Exception) -> MetaTraceError:
        filename, line, source = self._where(func)
        return MetaTraceError(
            f"{func_name(func)} failed on the meta device at {source} "
            f"({code_line(filename, line)!r}): {type(e).__name__}: {e}. The meta strategy "
            f"computes shapes, not values: if the model's shapes or control flow depend on "
            f"tensor data, or the call cannot run on 'meta', trace with strategy='real' "
            f"(trace_strategy='real' in parallelize)."
        )

    def _warn_once(self, key: Any, message: str, filename: str, line: int) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        # attributed to the model's line; our own ``_warned`` does the once-per-trace
        module = os.path.splitext(os.path.basename(filename))[0] if filename else "<unknown>"
        warnings.warn_explicit(
            message, OpaqueOpWarning, filename or "<unknown>", line, module=module, registry={}
        )

    # -- the whole trace ----------------------------------------------------------------
    def _register_state(self) -> dict[str, torch.Tensor]:
        """IR tensors for parameters and buffers; on meta, the state to run forward with."""
        groups: dict[int, tuple[torch.Tensor, list[str], TensorKind, bool]] = {}
        owners = dict(self.module.named_modules(remove_duplicate=False))
        for name, p in self.module.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), (p, [], TensorKind.PARAMETER, True))[1].append(name)
        for name, b in self.module.named_buffers(remove_duplicate=False):
            owner, _, attr = name.rpartition(".")
            persistent = attr not in owners[owner]._non_persistent_buffers_set
            groups.setdefault(id(b), (b, [], TensorKind.BUFFER, persistent))[1].append(name)
        state: dict[str, torch.Tensor] = {}
        for t, names, kind, persistent in groups.values():
            full = self.graph.new_tensor(
                shape=tuple(t.shape), dtype=t.dtype, requires_grad=t.requires_grad,
                kind=kind, names=tuple(names), persistent=persistent,
            )
            self._track(t, full.whole())
            if self.meta:
                copy = self._to_meta(t)
                state.update((n, copy) for n in names)
        return state

    def _register_inputs(self, args: dict[str, Any]) -> dict[str, Any]:
        """One graph input per tensor leaf of every argument, and the tensors forward runs on.

        Each leaf runs as a tensor object of its own, so that nothing else the tracer sees
        can be mistaken for it: the same dummy tensor given twice (``{'x': t, 'y': t}``),
        an input that is a parameter or buffer, or a tensor the model also holds as a
        constant, would otherwise share one graph tensor, and the generated code would read
        one argument where the model read another (at run time they can differ). A leaf
        that shares memory with a parameter, a buffer or an earlier input (``y = x[0]``,
        ``x.t()``) runs on a copy, so that an in-place write to one does not reach the other
        while tracing either."""
        call_args = {}
        taken = {storage_of(t) for t in self._alive.values()}  # parameters and buffers
        for name, value in args.items():
            leaves, spec = pytree.tree_flatten_with_path(value)
            ir_leaves, run_leaves = [], []
            for path, leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    full = self.graph.new_tensor(
                        shape=tuple(leaf.shape), dtype=leaf.dtype,
                        requires_grad=leaf.requires_grad, kind=TensorKind.INPUT,
                        names=(name + pytree.keystr(path),),
                    )
                    run = self._input_tensor(leaf, taken)
                    ir_leaves.append(self._track(run, full.whole()))
                    run_leaves.append(run)
                else:
                    ir_leaves.append(self._leaf_to_ir(leaf))
                    run_leaves.append(leaf)
            self.graph.inputs[name] = pytree.tree_unflatten(ir_leaves, spec)
            call_args[name] = pytree.tree_unflatten(run_leaves, spec)
        return call_args

    def _input_tensor(self, leaf: torch.Tensor, taken: set[int]) -> torch.Tensor:
        """A new tensor object for one input leaf (see `_register_inputs`): on meta,
        a meta copy; else the leaf's data, copied when its memory is ``taken`` already."""
        if self.meta:
            run = leaf.detach().to("meta")
        else:
            storage = storage_of(leaf)
            run = leaf.detach().clone() if storage in taken else leaf.detach()
            taken.add(storage)
        if leaf.requires_grad:
            run.requires_grad_(True)
        return run

    def run(self, dummy_forward_args: Any) -> Graph:
        args = check_forward_args(self.module, dummy_forward_args)
        state = self._register_state()
        call_args = self._register_inputs(args)
        # the real strategy runs the user's module: put its state back afterwards (the
        # meta strategy runs on copies)
        self._saved = None if self.meta else SavedState(self.module)
        pre = torch.nn.modules.module.register_module_forward_pre_hook(self._pre_hook)
        post = torch.nn.modules.module.register_module_forward_hook(
            self._post_hook, always_call=True
        )
        token = op_call_interceptor.set(self.on_registered_op)
        try:
            with expert_layers(self.module), _Mode(self), library_trace_signal():
                if self.meta:
                    out = torch.func.functional_call(
                        self.module, state, (), call_args, tie_weights=True, strict=False
                    )
                else:
                    out = self.module(**call_args)
        finally:
            self._active = False
            op_call_interceptor.reset(token)
            pre.remove()
            post.remove()
            self._stack.clear()
            unrestored = self._saved.restore() if self._saved is not None else []
        if unrestored:
            raise TraceError(
                f"forward changed parameter(s) of shape {', '.join(unrestored)} in place in a "
                f"way the tracer cannot undo, so tracing would leave your module changed; "
                f"change parameters outside forward, or with an in-place method "
                f"(p.add_(...), p.copy_(...), p[i] = v) that the tracer sees"
            )
        self.graph.outputs = self._to_ir(out)
        view_expert_weights(self.graph)  # gate_up [E, 2F, H] as [E, 2, F, H]: splittable by F
        self.graph.validate()
        return self.graph


@contextlib.contextmanager
def library_trace_signal() -> Iterator[None]:
    """Tell libraries that a trace is running: ``torch.compiler.is_compiling()`` is true
    inside (as it is under ``torch.compile`` and ``torch.export``).

    Libraries keep shortcuts that read tensor data out of their traced paths with this
    check. Hugging Face transformers, for one, skips a padding mask when
    ``mask.all()`` is true and drops a causal mask it can prove unneeded, unless
    ``transformers.utils.is_tracing()`` says a graph is being captured; that function asks
    ``torch.compiler.is_compiling()``. A trace that took such a shortcut would hold the
    dummy batch's answer for every batch (and `check_data_dependent` refuses it);
    with the signal on, the library computes the mask with tensor ops, which are right
    for every batch. Reads that remain are still recorded and refused.

    ``torch.export`` sets the same flag (``torch.compiler._is_compiling_flag``); torch
    versions without it get ``is_compiling`` itself replaced for the duration. The
    previous state is put back on exit, exceptions included.
    """
    compiler = torch.compiler
    if hasattr(compiler, "_is_compiling_flag"):
        old = compiler._is_compiling_flag
        compiler._is_compiling_flag = True
        try:
            yield
        finally:
            compiler._is_compiling_flag = old
        return
    original = compiler.is_compiling  # pragma: no cover - torch without the flag
    compiler.is_compiling = lambda: True  # pragma: no cover
    try:  # pragma: no cover
        yield
    finally:  # pragma: no cover
        compiler.is_compiling = original


def trace(
    module: torch.nn.Module, dummy_forward_args: Mapping[str, Any], *, strategy: str = "real"
) -> Graph:
    """Run ``module``'s forward once on ``dummy_forward_args`` and return its graph.

    ``dummy_forward_args`` is keyed by ``forward``'s argument names (as ``parallelize``
    takes it); values may be tensors or nested lists, tuples and dicts of them. With
    ``strategy='real'`` forward runs on the given values; with ``'meta'`` it runs on the
    meta device (parameters, buffers and inputs swapped for meta copies): shapes only, no
    arithmetic, so it is fast, but a model that reads values from data cannot be traced.

    Raises `ForwardSignatureError` when the arguments do not fit ``forward``,
    `DataDependentError` / `MetaTraceError` for what the meta strategy cannot
    do, and warns `OpaqueOpWarning` once per torch function with no annotation.
    """
    return Tracer(module, strategy).run(dummy_forward_args)
