"""Source for one op call: ``torch.nn.functional.linear(t5, self.fc_weight, None)``.

Registered ops are called through ``opdef.fn`` in the op's calling convention
(`replay`), spelled by the op's name when that name
resolves to the function; ``torch.Tensor`` methods read as methods (``t5.view(4, 8)``),
their operator dunders as operators (``t5[0:2]``, ``2.0 / t5``) and their properties as
attributes (``t5.T``); tensor-list ops take their list (``torch.cat([t1, t2], dim=1)``).
An opaque op is called as it was recorded: ``op.fn(*op.inputs, **op.kwargs)``. A
function no import path reaches is a `CodegenError`, unless it was registered
with ``code_impl_pattern='source'`` (its source is copied into the generated file).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import textwrap
from collections.abc import Sequence
from typing import Any

import attrs

from nnscaler.codegen.errors import CodegenError
from nnscaler.codegen.literals import Code, index_literal, literal
from nnscaler.ir import Op

_BINARY = {
    "__add__": "+", "__sub__": "-", "__mul__": "*", "__truediv__": "/", "__floordiv__": "//",
    "__mod__": "%", "__pow__": "**", "__matmul__": "@", "__and__": "&", "__or__": "|",
    "__xor__": "^", "__lshift__": "<<", "__rshift__": ">>", "__eq__": "==", "__ne__": "!=",
    "__lt__": "<", "__le__": "<=", "__gt__": ">", "__ge__": ">=",
}
_REFLECTED = {f"__r{k[2:]}": v for k, v in _BINARY.items() if k[2:-2] in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
    "lshift", "rshift")}
_UNARY = {"__neg__": "-", "__pos__": "+", "__invert__": "~"}
_SIMPLE = re.compile(r"^(?:[A-Za-z_][A-Za-z_0-9.]*|\d[\d.e+]*|'[^']*')$")


@attrs.frozen
class CallSource:
    """``expr`` computes the op's result; ``stmts`` run first (``x[k] = v``);
    ``imports`` are the modules the source names; ``defs`` are function sources to put at
    module level (``code_impl_pattern='source'``)."""

    expr: str
    stmts: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()
    defs: tuple[str, ...] = ()


@functools.lru_cache(maxsize=4096)
def resolve(name: str) -> tuple[Any, str] | None:
    """The object a dotted ``name`` names and the module it is imported from, or None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - any import failure means: not this prefix
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj, module_name
    return None


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects that cannot be compared are not the same
        return False


def _operand(text: str) -> str:
    return text if _SIMPLE.match(text) else f"({text})"


def _args_source(args: Sequence[Any], kwargs: dict[str, Any], where: str) -> str:
    parts = [literal(a, where=where) for a in args]
    parts += [f"{k}={literal(v, where=where)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _method(name: str, args: list[Any], kwargs: dict[str, Any], where: str) -> CallSource | None:
    """``torch.Tensor.<name>`` called on ``args[0]`` as a method or an operator."""
    if not args or not isinstance(args[0], Code):
        return None
    this, rest = args[0].text, args[1:]
    if name == "__getitem__" and len(rest) == 1 and not kwargs:
        return CallSource(f"{this}[{index_literal(rest[0], where=where)}]")
    if name == "__setitem__" and len(rest) == 2 and not kwargs:
        key, value = rest
        stmt = f"{this}[{index_literal(key, where=where)}] = {literal(value, where=where)}"
        return CallSource(this, stmts=(stmt,))
    if name in _BINARY and len(rest) == 1 and not kwargs:
        other = _operand(literal(rest[0], where=where))
        return CallSource(f"{_operand(this)} {_BINARY[name]} {other}")
    if name in _REFLECTED and len(rest) == 1 and not kwargs:
        other = _operand(literal(rest[0], where=where))
        return CallSource(f"{other} {_REFLECTED[name]} {_operand(this)}")
    if name in _UNARY and not rest and not kwargs:
        return CallSource(f"{_UNARY[name]}{_operand(this)}")
    if name.startswith("__"):
        return None
    return CallSource(f"{this}.{name}({_args_source(rest, kwargs, where)})")


def _is_property_get(obj: Any, fn: Any) -> bool:
    """``fn`` is the getter of the descriptor ``obj`` (``torch.Tensor.T.__get__``)."""
    if not (inspect.isgetsetdescriptor(obj) or isinstance(obj, property)
            or inspect.ismemberdescriptor(obj)):
        return False
    getter = getattr(obj, "__get__", None)
    return _same(getter, fn) or _same(getattr(fn, "__self__", None), obj)


#: Where generated code finds nnscaler's own op implementations (a public module).
PUBLIC_OPS = "nnscaler.runtime.ops"
_INTERNAL = ("nnscaler.ops.", "nnscaler.graph.", "nnscaler.codegen.")


def _public(fn: Any) -> tuple[str, str] | None:
    """``nnscaler.runtime.ops.<name>`` for an op implementation of nnscaler's own that
    lives in an internal module (``nnscaler.ops.builtin.nn``); None for any other."""
    module = getattr(fn, "__module__", None) or ""
    if not module.startswith(_INTERNAL):
        return None
    name = getattr(fn, "__name__", "")
    found = resolve(f"{PUBLIC_OPS}.{name}") if name else None
    if found is not None and _same(found[0], fn):
        return f"{PUBLIC_OPS}.{name}", PUBLIC_OPS
    return None


def _spell(fn: Any, name: str) -> tuple[str, str] | None:
    """An expression that names ``fn`` and the module to import: its public name in
    `nnscaler.runtime.ops` for nnscaler's own implementations, else ``name`` if it
    resolves to ``fn``, else ``fn``'s own module and qualified name."""
    public = _public(fn)
    if public is not None:
        return public
    found = resolve(name)
    if found is not None and _reaches(found[0], fn):
        return name, found[1]
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if module and qualname and "<" not in qualname:
        path = f"{module}.{qualname}"
        found = resolve(path)
        if found is not None and _reaches(found[0], fn):
            return path, found[1]
    return None


def _dispatcher_op(fn: Any) -> tuple[str, tuple[str, ...]] | None:
    """``torch.ops.<namespace>.<name>[.<overload>]`` for an operator of torch's
    dispatcher (``torch.ops.aten.add.Tensor``, or a library's ``torch.library.custom_op``
    such as ``torch.ops.transformers.grouped_mm_fallback``), with the modules to import:
    ``torch``, and the module whose ``custom_op`` defines it, so that a fresh process has
    the op registered before the generated code calls it. None for anything else."""
    import torch

    packet = fn._overloadpacket if isinstance(fn, torch._ops.OpOverload) else fn
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    namespace, _, op_name = packet._qualified_op_name.partition("::")
    expr = f"torch.ops.{namespace}.{op_name}"
    if packet is not fn:
        expr += f".{fn._overloadname}"
    imports = ["torch"]
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover - a torch without torch.library.custom_op
        OPDEFS = {}
    definition = OPDEFS.get(packet._qualified_op_name)
    module = getattr(getattr(definition, "_init_fn", None), "__module__", None)
    if module and module != "__main__":
        imports.append(module)
    return expr, tuple(imports)


def _reaches(obj: Any, fn: Any) -> bool:
    """``obj`` is ``fn``, or the function ``@register_op`` put in ``fn``'s place (the
    decorator form): calling it outside a trace calls ``fn``."""
    return _same(obj, fn) or (hasattr(obj, "__wrapped_op__")
                              and _same(getattr(obj, "__wrapped__", None), fn))


def _without_register_op(source: str) -> str:
    """``source`` of a function less its ``@register_op(...)`` decorators (the generated
    file calls the plain function; registering it again there would fail)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return source
    lines = source.splitlines(keepends=True)
    drop: set[int] = set()
    for deco in node.decorator_list:
        call = deco.func if isinstance(deco, ast.Call) else deco
        name = call.attr if isinstance(call, ast.Attribute) else getattr(call, "id", "")
        if name == "register_op":
            drop.update(range(deco.lineno - 1, (deco.end_lineno or deco.lineno)))
    return "".join(line for i, line in enumerate(lines) if i not in drop)


def _source_def(fn: Any, where: str) -> tuple[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise CodegenError(
            f"{where}: the op was registered with code_impl_pattern='source', but the source "
            f"of {fn!r} cannot be read ({e}); register it with code_impl_pattern='import' "
            f"and a name its module can be imported under"
        ) from None
    if not inspect.isfunction(fn) or not source.lstrip().startswith(("def ", "@")):
        raise CodegenError(f"{where}: code_impl_pattern='source' needs a plain function, got "
                           f"{fn!r}")
    try:
        names = inspect.getclosurevars(fn)
    except (TypeError, ValueError):
        names = None
    imports = []
    if names is not None:
        modules = {n: v for n, v in names.globals.items() if inspect.ismodule(v)}
        foreign = sorted([n for n in names.globals if n not in modules] + list(names.nonlocals))
        if foreign:
            raise CodegenError(
                f"{where}: the op was registered with code_impl_pattern='source', which copies "
                f"the function {fn.__name__!r} alone into the generated file (with the modules "
                f"it names), but it uses {', '.join(map(repr, foreign))} from around it. "
                f"Make the function self-contained (import inside it), or register it with "
                f"code_impl_pattern='import' at the top level of an importable module"
            )
        for alias, module in sorted(modules.items()):  # e.g. import torch.nn.functional as F
            if module.__name__ != "torch" or alias != "torch":
                imports.append(f"import {module.__name__}" if alias == module.__name__
                               else f"import {module.__name__} as {alias}")
    body = _without_register_op(source)
    return fn.__name__, "\n".join(imports) + "\n\n\n" + body if imports else body


_PLAIN = (type(None), bool, int, float, str)


def _no_signature(fn: Any) -> bool:
    try:
        inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    return False


def _own_signature(fn: Any, registered: inspect.Signature | None) -> inspect.Signature | None:
    """``fn``'s signature as ``inspect`` sees it, else the one the op was registered with
    (C builtins such as ``scaled_dot_product_attention`` carry none)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return registered


def _without_defaults(sig: inspect.Signature | None, fn: Any, kwargs: dict[str, Any],
                      written: frozenset[str]) -> dict[str, Any]:
    """``kwargs`` less the arguments equal to their default, where both the op's
    signature and the function's own agree on that default (plain values only); an
    argument the model's call passed by keyword (``written``) stays, as it was written."""
    if sig is None:
        return kwargs
    own = _own_signature(fn, sig)
    if own is None:
        return kwargs
    out = {}
    for k, v in kwargs.items():
        p, q = sig.parameters.get(k), own.parameters.get(k)
        if (k not in written and p is not None and q is not None and isinstance(v, _PLAIN)
                and type(p.default) is type(v) and type(q.default) is type(v)
                and p.default == v and q.default == v):
            continue
        out[k] = v
    return out


def _keywords(fn: Any, kwargs: dict[str, Any], written: frozenset[str]) -> frozenset[str]:
    """The arguments to pass by keyword: those the function's own signature takes by that
    name; for a function ``inspect`` cannot see into (a C builtin), those the model's call
    passed by keyword (``written``), the others positionally, as `OpDef.call` does."""
    try:
        own = inspect.signature(fn)
    except (TypeError, ValueError):
        return frozenset(k for k in kwargs if k in written)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(k for k in kwargs
                     if k in own.parameters and own.parameters[k].kind in named)


def _drop_trailing_defaults(sig: inspect.Signature | None, args: list[Any]) -> list[Any]:
    """``args`` less the trailing ``None`` arguments whose parameter defaults to ``None``
    (an annotated input the call left out: ``linear(x, w)``, not ``linear(x, w, None)``)."""
    if sig is None:
        return args
    P = inspect.Parameter
    params = list(sig.parameters.values())
    if any(p.kind is P.VAR_POSITIONAL for p in params) or len(args) > len(params):
        return args
    out = list(args)
    while out and out[-1] is None and params[len(out) - 1].default is None \
            and params[len(out) - 1].kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
        out.pop()
    return out


def call_source(op: Op, inputs: Sequence[Any], kwargs: dict[str, Any], *,
                where: str = "") -> CallSource:
    """The source that calls ``op`` with ``inputs``/``kwargs`` laid out as ``op.inputs``/
    ``op.kwargs`` (tensors replaced by `Code` variables)."""
    opdef = op.opdef
    if opdef is None:
        fn, name = op.fn, op.name
        args, kw = list(inputs), dict(kwargs)
    else:
        fn, name = opdef.fn, opdef.name
        # what the call passed by keyword, where the trace saw the call as written: a C
        # builtin (a Python function dispatching through __torch_function__ passes all
        # by keyword, whatever the model wrote)
        written = frozenset(getattr(op, "keywords", ())) if _no_signature(fn) else frozenset()
        kwargs = _without_defaults(opdef.signature, fn, dict(kwargs), written)
        args, kw = opdef.replay(list(inputs), kwargs,
                                keywords=_keywords(fn, kwargs, written))
        args = _drop_trailing_defaults(opdef.signature, args)
        if opdef.emit_fn is not None:
            return _custom(op, args, kw, where)
        if opdef.code_impl_pattern == "source":
            fn_name, source = _source_def(fn, where)
            return CallSource(f"{fn_name}({_args_source(args, kw, where)})", defs=(source,))
        if type(opdef.signature).__name__ == "TensorListSignature":
            found = resolve(name)
            if found is not None and callable(found[0]):
                lst = Code("[" + ", ".join(literal(a, where=where) for a in args) + "]")
                return CallSource(f"{name}({_args_source([lst], kw, where)})",
                                  imports=(found[1],))
    if name.startswith("torch.Tensor."):
        attr = name.removeprefix("torch.Tensor.")
        if attr.endswith(".__get__"):
            attr = attr.removesuffix(".__get__")
        obj = getattr(__import__("torch").Tensor, attr, None)
        if obj is not None and "." not in attr:
            if _is_property_get(obj, fn) and len(args) == 1 and not kw \
                    and isinstance(args[0], Code):
                return CallSource(f"{args[0].text}.{attr}")
            if _same(obj, fn) or attr == "__setitem__":  # the registered setitem returns self
                method = _method(attr, list(args), kw, where)
                if method is not None:
                    return method
    dispatcher_op = _dispatcher_op(fn)
    if dispatcher_op is not None:
        expr, imports = dispatcher_op
        return CallSource(f"{expr}({_args_source(args, kw, where)})", imports=imports)
    spelled = _spell(fn, name)
    if spelled is None:
        raise CodegenError(
            f"{where}: generated code must call {fn!r} (op {name!r}), but no import path "
            f"reaches it: neither {name!r} nor its module and qualified name resolve to it. "
            f"Fix: define the function at the top level of an importable module, register "
            f"it with a name that resolves to it, or with code_impl_pattern='source'"
        )
    expr, module = spelled
    return CallSource(f"{expr}({_args_source(args, kw, where)})", imports=(module,))


def _custom(op: Op, args: list[Any], kw: dict[str, Any], where: str) -> CallSource:
    opdef = op.opdef
    if opdef is None or opdef.emit_fn is None:
        raise CodegenError(f"{where}: internal error: no emit_fn")
    arg_src = [literal(a, where=where) for a in args]
    kw_src = {k: literal(v, where=where) for k, v in kw.items()}
    try:
        text = opdef.emit_fn(op, arg_src, kw_src)
    except Exception as e:
        raise CodegenError(f"{where}: the emit_fn of op {opdef.name!r} failed: "
                           f"{type(e).__name__}: {e}") from e
    if not isinstance(text, str):
        raise CodegenError(f"{where}: the emit_fn of op {opdef.name!r} returned {text!r}; it "
                           f"must return the source of an expression")
    spelled = _spell(opdef.fn, opdef.name)
    # the emitted text may name the op's own module (``my_kernels.fused(...)``)
    needs = spelled is not None and f"{spelled[1]}." in text
    return CallSource(text, imports=(spelled[1],) if needs and spelled else ())
