"""``graph.pkl``: the traced graph, written by `save_graph`, read by a restricted
unpickler (`load_graph`) that never runs code the file chooses.

A plain ``pickle.load`` calls whatever callable the file names (``os.system`` included),
so a ``graph.pkl`` someone else could write would be a way to run code under
``reuse='graph'``. The reader here allows only what nnscaler's graphs hold:

- **values** (kept, never called): classes, functions and method descriptors of the
  modules ``torch``, ``nnscaler``, ``builtins``, ``operator`` and ``math`` (op targets
  such as ``torch.nn.functional.linear``), dtypes, layouts and memory formats;
- **constructors** (the only callables the file may call, by ``REDUCE``/``NEWOBJ``): the
  data classes of ``nnscaler.ir``, ``nnscaler.anno``, ``nnscaler.graph``, ``nnscaler.ops``
  and ``nnscaler.layout``, enums, plain value types (``slice``, ``set``, ...),
  ``torch.Size``, ``torch.device``, the pytree specs, container types registered with
  ``torch.utils._pytree`` (e.g. Hugging Face ``ModelOutput`` classes) and named tuples of
  modules already imported, plus three resolvers of this module: a registered op by name,
  an operator of torch's dispatcher by its qualified name (``torch.ops.aten.add.Tensor``,
  or a library's ``torch.library.custom_op``, found only if the process registered it),
  and a tensor read back with ``torch.load(weights_only=True)``;
- ``getattr(cls, name)`` of an allowed class, when the result is a method (``Tensor.add``).

Modules outside ``torch`` and ``nnscaler`` are never imported by the reader: a class of
theirs is found only if the process imported it already. Anything else is an
`UnsafeGraphFileError` naming it.
"""

from __future__ import annotations

import collections
import enum
import io
import pickle
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import torch

from nnscaler.errors import UnsafeGraphFileError

__all__ = ["UnsafeGraphFileError", "load_graph", "save_graph"]


# -- writing -----------------------------------------------------------------------------
def _opdef_by_name(name: str) -> Any:
    """A registered op, looked up by name (op definitions hold local functions)."""
    from nnscaler.plugins import get_plugin_manager

    return get_plugin_manager().ops.get(name)


def _dispatcher_op(qualified_name: str, overload: str | None) -> Any:
    """``torch.ops.<namespace>.<name>[.<overload>]``, looked up (never imported) by its
    qualified name ``namespace::name``: an op a library defines must be registered in
    this process already (its module imported), else `UnsafeGraphFileError`."""
    namespace, sep, name = qualified_name.partition("::")
    if not sep or not namespace.isidentifier() or not name.isidentifier() or (
            overload is not None and not overload.isidentifier()):
        raise UnsafeGraphFileError(f"{qualified_name!r} is not a torch operator's name")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return packet if overload is None else getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise UnsafeGraphFileError(
            f"the graph calls the operator torch.ops.{namespace}.{name}, which this process "
            f"has not registered: import the module that defines it (the model's library) "
            f"before loading, or regenerate with reuse='override'"
        ) from None


def _tensor_from_bytes(data: bytes) -> torch.Tensor:
    """A tensor written by `torch.save`, read with ``weights_only=True``."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


class _GraphPickler(pickle.Pickler):
    """Pickles registered ops by name and tensors through ``torch.save`` (a plain pickle of
    a tensor unpickles its storage with an unrestricted ``torch.load``)."""

    def reducer_override(self, obj: Any) -> Any:
        from nnscaler.ops.registry import OpDef

        if isinstance(obj, OpDef):
            return (_opdef_by_name, (obj.name,))
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return (_dispatcher_op, (obj._qualified_op_name, None))
        if isinstance(obj, torch._ops.OpOverload):
            return (_dispatcher_op, (obj._overloadpacket._qualified_op_name,
                                     obj._overloadname))
        if isinstance(obj, torch.Tensor):
            buf = io.BytesIO()
            torch.save(obj.detach(), buf)
            return (_tensor_from_bytes, (buf.getvalue(),))
        return NotImplemented


def save_graph(graph: Any, path: Path) -> None:
    """Pickle ``graph`` to ``path`` (what `load_graph` reads back)."""
    buf = io.BytesIO()
    _GraphPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(graph)
    path.write_bytes(buf.getvalue())


# -- reading -----------------------------------------------------------------------------
_LIBRARY_PREFIXES = ("torch", "nnscaler")
_PLAIN_MODULES = frozenset({"builtins", "operator", "_operator", "math", "collections"})
_CONSTRUCTIBLE_PREFIXES = ("nnscaler.ir.", "nnscaler.anno.", "nnscaler.graph.",
                           "nnscaler.ops.", "nnscaler.layout.")
_VALUE_TYPES = frozenset({slice, set, frozenset, complex, range, bytes, bytearray, dict,
                          list, tuple, int, float, bool, str, collections.OrderedDict})
_INERT_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType,
                    types.WrapperDescriptorType, types.ClassMethodDescriptorType,
                    types.MethodWrapperType)
_CONSTANT_TYPES = (torch.dtype, torch.layout, torch.memory_format)
_RESOLVERS = (_opdef_by_name, _dispatcher_op, _tensor_from_bytes)


def _is_library(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in _LIBRARY_PREFIXES)


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def _constructible(obj: Any) -> bool:
    """Whether the file may call ``obj`` (a data class, value type or resolver)."""
    if any(obj is r for r in _RESOLVERS):
        return True
    if not isinstance(obj, type):
        return False
    if obj in _VALUE_TYPES or obj in (torch.Size, torch.device) or issubclass(obj, enum.Enum):
        return True
    from torch.utils import _pytree

    if obj in (_pytree.TreeSpec, _pytree.LeafSpec):
        return True
    if obj in _pytree.SUPPORTED_NODES and obj is not collections.defaultdict:
        return True  # a defaultdict would call its factory, a value the file chose
    if _is_namedtuple(obj):
        return True
    return obj.__module__.startswith(_CONSTRUCTIBLE_PREFIXES)


def _allowed_value(obj: Any, module: str) -> bool:
    """Whether ``obj`` (found as ``module.name``) may be kept as a value."""
    if _constructible(obj) or obj is Ellipsis or obj is NotImplemented:
        return True
    if isinstance(obj, _CONSTANT_TYPES):
        return True
    if not (_is_library(module) or module in _PLAIN_MODULES):
        return False  # another library's function or class: only its containers (above)
    return isinstance(obj, type) or isinstance(obj, _INERT_CALLABLES)


class _RestrictedUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with every opcode that finds or calls something checked
    (``pickle._Unpickler`` is used because the C unpickler cannot be checked per call)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def _refuse(self, what: str) -> UnsafeGraphFileError:
        return UnsafeGraphFileError(
            f"{str(self._path)!r} asks the unpickler for {what}, which a traced graph never "
            f"holds; it was not written by nnscaler (or by another version). It was not "
            f"loaded and nothing in it ran. Regenerate with reuse='override', or delete the "
            f"file"
        )

    def find_class(self, module: str, name: str) -> Any:
        where = f"{module}.{name}"
        if not (_is_library(module) or module in _PLAIN_MODULES):
            mod = sys.modules.get(module)  # never import another library's module here
            if mod is None:
                raise self._refuse(f"{where} (its module is not imported)")
        else:
            __import__(module)
            mod = sys.modules[module]
        obj: Any = mod
        for part in name.split("."):
            if part.startswith("__") and part != name.rsplit(".", 1)[-1]:
                raise self._refuse(where)
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise self._refuse(f"{where} (it does not exist)") from None
        if not _allowed_value(obj, module):
            raise self._refuse(where)
        return obj

    def _call(self, func: Any, args: tuple[Any, ...]) -> Any:
        if func is getattr:
            if (len(args) == 2 and isinstance(args[0], type) and isinstance(args[1], str)
                    and _allowed_value(args[0], args[0].__module__)):
                value = getattr(args[0], args[1], None)
                if isinstance(value, _INERT_CALLABLES):
                    return value
            raise self._refuse(f"getattr{tuple(map(_short, args))}")
        if not _constructible(func):
            raise self._refuse(f"a call of {_short(func)}")
        return func(*args)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        self.stack[-1] = self._call(func, tuple(args))

    dispatch[pickle.REDUCE[0]] = load_reduce

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not _constructible(cls):
            raise self._refuse(f"an instance of {_short(cls)}")
        self.append(cls.__new__(cls, *args))

    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        if not _constructible(cls):
            raise self._refuse(f"an instance of {_short(cls)}")
        self.append(cls.__new__(cls, *args, **kwargs))

    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex

    def load_build(self) -> None:
        inst = self.stack[-2]  # the stack holds [..., inst, state]
        if isinstance(inst, type) or not _constructible(type(inst)):
            raise self._refuse(f"setting the state of {_short(inst)}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def _instantiate(self, klass: Any, args: Any) -> None:  # protocols 0 and 1
        if not _constructible(klass):
            raise self._refuse(f"an instance of {_short(klass)}")
        super()._instantiate(klass, args)


def _short(obj: Any) -> str:
    if isinstance(obj, type) or callable(obj):
        name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
        module = getattr(obj, "__module__", None)
        if name:
            return f"{module}.{name}" if module else name
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."


def load_graph(path: Path) -> Any:
    """Read a graph written by `save_graph`, refusing anything else
    (`UnsafeGraphFileError`)."""
    data = Path(path).read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's pytree specs, unpickled
        return _RestrictedUnpickler(io.BytesIO(data), Path(path)).load()
