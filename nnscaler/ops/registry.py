"""The operator registry: which callables are operators, and their dim annotations.

An *operator* is a callable that the tracer records as one node of the graph, never
looking inside it, and whose annotation says how it can be split. Built-in torch
functions are registered by family in `nnscaler.ops.builtin`; users add their own
with [`register_op`][nnscaler.register_op] (or a plugin's ``nnscaler_register_ops`` hook);
the decorator and the user ops it keeps are in `nnscaler.ops.user_ops`.

Calling convention. An op's annotation has one entry per *annotated parameter*: the
first ``len(anno.inputs)`` parameters of the op's signature, in order. Every other
parameter is a keyword argument of the op (it may give hidden-dim sizes, and transforms
may rewrite it). `OpDef.bind` turns a concrete call ``fn(*args, **kwargs)`` into
that form.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from nnscaler.anno import AnnotationError, OpAnno, TransformRule, parse
from nnscaler.errors import DuplicateRegistrationError, RegistrationError
from nnscaler.registry import USER_REGISTRANT, Registry

#: Set by the tracer while it records a model: ``interceptor(opdef, args, kwargs)``
#: replaces the call of every function wrapped by [`register_op`][nnscaler.register_op].
op_call_interceptor: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar(
    "nnscaler_op_call_interceptor", default=None
)

CODE_IMPL_PATTERNS = ("import", "source")


def _signature_of(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # many torch builtins carry no signature
        return None


@attrs.frozen(kw_only=True)
class OpCall:
    """One call of an op in the annotation's calling convention."""

    opdef: OpDef
    anno: OpAnno
    inputs: tuple[Any, ...]  # values of the annotated parameters, in order
    kwargs: dict[str, Any]  # every other parameter that was given, by name
    keywords: frozenset[str] = frozenset()  # parameters the original call passed by keyword

    def shapes(self) -> list[tuple[int, ...] | None]:
        return [tuple(x.shape) if _is_tensor(x) else None for x in self.inputs]

    def run(self, inputs: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None):
        """Call the op with (possibly replaced) inputs and keyword arguments."""
        return self.opdef.call(
            tuple(self.inputs if inputs is None else inputs),
            dict(self.kwargs if kwargs is None else kwargs),
            keywords=self.keywords,
        )


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


#: Where `OpDef.replay` puts an argument.
_ARG, _KW, _STAR, _STARSTAR = object(), object(), object(), object()


@attrs.frozen(kw_only=True, eq=False)
class OpDef:
    """A registered operator.

    ``annotation`` is a string, or a callable that receives the call's arguments exactly
    as the op does and returns the annotation string for that call (for ops whose
    annotation depends on arguments, e.g. ``view`` or ``sum(dim=...)``).
    ``signature`` binds calls; it defaults to the signature of ``fn``, else of a callable
    annotation; for C builtins with neither, the first positional arguments are the
    annotated ones. ``update_kwargs(kwargs, transform, part) -> kwargs`` lets an op whose
    arguments encode sizes (``view``, ``expand``, ``split``, ...) rewrite them for part
    ``part`` of a partition; it runs after the transform's own keyword updates.
    ``collective=True`` marks an op whose calls are the parts of one split that talk to
    each other (a [`TransformRule`][nnscaler.TransformRule] names it as its ``part_op``): it
    takes the keyword ``group``, a `PartGroup` of the
    parts, which generated code, the plan simulator and ``verify_op`` supply.
    """

    name: str
    fn: Callable[..., Any]
    annotation: str | Callable[..., str]
    signature: inspect.Signature | None = None
    code_impl_pattern: str = "import"
    emit_fn: Callable[..., str] | None = None
    transform_rules: tuple[TransformRule, ...] | Callable[[Any], Sequence[TransformRule]] = ()
    input_gen_fn: Callable[..., Any] | None = None
    update_kwargs: Callable[..., dict[str, Any]] | None = None
    collective: bool = False
    registrant: str = ""
    source: str = ""  # where it was registered, for messages
    #: `replay`'s routes by argument names (and the signature's parameter names)
    _routes: dict[Any, Any] = attrs.field(factory=dict, init=False, repr=False)

    def rules_for(self, bound: Any) -> tuple[TransformRule, ...]:
        """The custom transform rules for one bound call (``BoundAnno``).

        ``transform_rules`` is a sequence, or a callable taking the bound annotation and
        returning one (for rules that depend on the call's ranks, e.g. linear's bias).
        """
        if callable(self.transform_rules):
            return tuple(self.transform_rules(bound))
        return tuple(self.transform_rules)

    def part_kwargs(self, transform: Any, kwargs: Mapping[str, Any], part: int) -> dict[str, Any]:
        """The keyword arguments of part ``part`` when the op is split by ``transform``."""
        kw = transform.part_kwargs(kwargs, part)
        if self.update_kwargs is not None:
            kw = self.update_kwargs(dict(kw), transform, part)
        return kw

    def annotation_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> OpAnno:
        """The parsed annotation of one concrete call."""
        if isinstance(self.annotation, str):
            return parse(self.annotation)
        text = self.annotation(*args, **kwargs)
        if not isinstance(text, str):
            raise TypeError(
                f"the annotation function of op {self.name!r} returned {text!r}; it must return "
                f"an annotation string such as 'a k+, n k+ -> a n'"
            )
        try:
            return parse(text)
        except AnnotationError as e:
            raise AnnotationError(
                f"op {self.name!r}: its annotation function returned a malformed annotation: "
                f"{e.reason}",
                annotation=e.annotation,
                position=e.position,
            ) from None

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> OpCall:
        """Bring a concrete call into the annotation's calling convention."""
        anno = self.annotation_for(args, kwargs)
        n = len(anno.inputs)
        if self.signature is None:
            if len(args) < n:
                raise TypeError(
                    f"op {self.name!r} is annotated {str(anno)!r} ({n} inputs) but was called "
                    f"with {len(args)} positional arguments; pass the annotated inputs "
                    f"positionally"
                )
            extra = args[n:]
            kw = dict(kwargs)
            if extra:
                kw["*args"] = tuple(extra)
            return OpCall(opdef=self, anno=anno, inputs=tuple(args[:n]), kwargs=kw)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"op {self.name!r} called with arguments it does not take: {e}") from None
        params = list(self.signature.parameters.values())
        if n > len(params):
            raise AnnotationError(
                f"op {self.name!r}: the annotation has {n} inputs but the op's signature has "
                f"only {len(params)} parameters",
                annotation=str(anno),
                position=None,
            )
        inputs = []
        for p in params[:n]:
            if p.name in bound.arguments:
                inputs.append(bound.arguments[p.name])
            elif p.default is not inspect.Parameter.empty:
                inputs.append(p.default)
            else:
                inputs.append(None)
        rest = {k: v for k, v in bound.arguments.items() if k not in {p.name for p in params[:n]}}
        keywords = frozenset(k for k in kwargs if k in self.signature.parameters)
        return OpCall(opdef=self, anno=anno, inputs=tuple(inputs), kwargs=rest, keywords=keywords)

    def call(
        self,
        inputs: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        keywords: frozenset[str] = frozenset(),
    ) -> Any:
        """Call ``fn`` from the annotation's calling convention.

        Parameters named in ``keywords`` (those the original call passed by keyword) and
        keyword-only ones are passed by keyword, the others positionally, so that the
        call is replayed the way it was written.
        """
        if self.signature is None:
            kw = dict(kwargs)
            extra = kw.pop("*args", ())
            return self.fn(*inputs, *extra, **kw)
        args, kw = self.replay(inputs, kwargs, keywords=keywords)
        return self.fn(*args, **kw)

    def replay(
        self,
        inputs: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        keywords: frozenset[str] = frozenset(),
    ) -> tuple[list[Any], dict[str, Any]]:
        """The positional and keyword arguments that call ``fn`` (used by codegen too)."""
        if self.signature is None:
            kw = dict(kwargs)
            extra = kw.pop("*args", ())
            return [*inputs, *extra], kw
        names = tuple(kwargs)
        key = (len(inputs), names, keywords)
        route = self._routes.get(key)
        if route is None:  # where each argument goes depends on their names only
            route = self._routes[key] = self._route(len(inputs), names, keywords)
        params = self._param_names
        arguments = dict(zip(params, inputs))
        arguments.update(kwargs)
        args: list[Any] = []
        kw: dict[str, Any] = {}
        for name, where in route:
            value = arguments[name]
            if where is _ARG:
                args.append(value)
            elif where is _KW:
                kw[name] = value
            elif where is _STAR:
                args.extend(value)
            else:
                kw.update(value)
        return args, kw

    def _route(self, ninputs: int, names: tuple[str, ...], keywords: frozenset[str]
               ) -> tuple[tuple[str, object], ...]:
        """Per present argument, in the signature's order: positional, keyword, ``*args``
        or ``**kwargs`` (`replay`'s rule, computed once per argument names)."""
        P = inspect.Parameter
        present = set(self._param_names[:ninputs]) | set(names)
        route: list[tuple[str, object]] = []
        positional = True
        for p in self.signature.parameters.values():  # type: ignore[union-attr]
            if p.name not in present:
                if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
                    positional = False
                continue
            if p.kind == P.VAR_POSITIONAL:
                route.append((p.name, _STAR))
            elif p.kind == P.VAR_KEYWORD:
                route.append((p.name, _STARSTAR))
            elif p.kind == P.POSITIONAL_ONLY or (
                p.kind == P.POSITIONAL_OR_KEYWORD and positional and p.name not in keywords
            ):
                route.append((p.name, _ARG))
            else:
                route.append((p.name, _KW))
                positional = False
        return tuple(route)

    @property
    def _param_names(self) -> tuple[str, ...]:
        names = self._routes.get(None)
        if names is None:
            names = self._routes[None] = tuple(self.signature.parameters)  # type: ignore[union-attr]
        return names

    def __repr__(self) -> str:
        ann = self.annotation if isinstance(self.annotation, str) else "<fn>"
        return f"OpDef({self.name!r}, {ann!r}, registrant={self.registrant!r})"


class OpRegistry(Registry[OpDef]):
    """Ops by name, and by the callable that the tracer sees."""

    def __init__(self) -> None:
        super().__init__(
            "op",
            install_hint="Register it with nnscaler.register_op, or install the plugin that "
            "provides it (e.g. `pip install ./plugins/ops_flash_attn`).",
        )
        self._by_fn: dict[Any, OpDef] = {}

    def register(  # type: ignore[override]
        self,
        fn: Callable[..., Any],
        annotation: str | Callable[..., str],
        *,
        name: str | None = None,
        code_impl_pattern: str = "import",
        emit_fn: Callable[..., str] | None = None,
        transform_rules: Sequence[TransformRule] | Callable[[Any], Sequence[TransformRule]]
        | None = None,
        input_gen_fn: Callable[..., Any] | None = None,
        signature: inspect.Signature | Callable | None = None,
        update_kwargs: Callable[..., dict[str, Any]] | None = None,
        aliases: Sequence[Callable[..., Any]] = (),
        collective: bool = False,
        registrant: str | None = None,
    ) -> OpDef:
        """Register ``fn`` (and the other callables in ``aliases``) as one op.

        Everything given is checked here, so that a wrong registration fails when it is
        made (naming the op and the registering plugin), not at trace or codegen time:
        see `check_op_options`.
        """
        who = registrant or self._current_registrant
        name = check_op_options(
            fn, annotation, name=name, code_impl_pattern=code_impl_pattern, emit_fn=emit_fn,
            transform_rules=transform_rules, input_gen_fn=input_gen_fn, signature=signature,
            update_kwargs=update_kwargs, aliases=aliases, registrant=who,
        )
        if signature is None:
            sig = _signature_of(fn)
            if sig is None and callable(annotation):
                sig = _signature_of(annotation)
        elif isinstance(signature, inspect.Signature):
            sig = signature
        else:
            sig = _signature_of(signature)
        opdef = OpDef(
            name=name,
            fn=fn,
            annotation=annotation,
            signature=sig,
            code_impl_pattern=code_impl_pattern,
            emit_fn=emit_fn,
            transform_rules=transform_rules
            if callable(transform_rules)
            else tuple(transform_rules or ()),
            input_gen_fn=input_gen_fn,
            update_kwargs=update_kwargs,
            collective=bool(collective),
            registrant=who,
        )
        _check_arity(opdef)
        for f in (fn, *aliases):
            other = self._by_fn.get(_fn_key(f))
            if other is not None:
                raise DuplicateRegistrationError(
                    f"{f!r} is registered twice as an op: as {other.name!r} by "
                    f"{other.registrant!r}, then as {name!r} by {opdef.registrant!r}"
                )
        super().register(name, opdef, registrant=opdef.registrant)
        for f in (fn, *aliases):
            self._by_fn[_fn_key(f)] = opdef
        return opdef

    def unregister(self, name: str) -> OpDef:
        opdef = super().unregister(name)
        for k in [k for k, v in self._by_fn.items() if v is opdef]:
            del self._by_fn[k]
        return opdef

    def lookup(self, fn: Any) -> OpDef | None:
        """The op registered for the callable ``fn`` (as the tracer sees it), or None."""
        try:
            return self._by_fn.get(_fn_key(fn))
        except TypeError:  # unhashable callable
            return None


def _fn_key(fn: Any) -> Any:
    # Bound methods (e.g. ``MyFunction.apply``) compare equal but are new objects each time.
    self_ = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", None)
    if func is not None and inspect.isclass(self_):
        return (self_, func)
    return fn


def check_op_options(
    fn: Any,
    annotation: Any,
    *,
    name: Any = None,
    code_impl_pattern: Any = "import",
    emit_fn: Any = None,
    transform_rules: Any = None,
    input_gen_fn: Any = None,
    signature: Any = None,
    update_kwargs: Any = None,
    aliases: Any = (),
    collective: Any = False,
    registrant: str = USER_REGISTRANT,
) -> str:
    """Check the arguments of an op registration; returns the op's name.

    Raises [`RegistrationError`][nnscaler.errors.RegistrationError] (or
    `AnnotationError` for a malformed annotation, with the caret)
    naming the op and ``registrant``.
    """
    if name is not None and (not isinstance(name, str) or not name):
        raise RegistrationError(
            f"{registrant!r} registered an op under the name {name!r}: op names are "
            f"non-empty strings. Fix: name='mypkg.my_op', or leave name out"
        )
    shown = name or (op_name_of(fn) if callable(fn) else repr(fn))

    def refuse(rule: str, fix: str) -> RegistrationError:
        return RegistrationError(f"op {shown!r} (registered by {registrant!r}): {rule}. Fix: {fix}")

    if not callable(fn):
        raise refuse(f"the op must be a callable, got {type(fn).__name__} {fn!r}",
                     "register the function (or autograd.Function.apply) itself")
    if isinstance(annotation, str):
        try:
            parse(annotation)
        except AnnotationError as e:
            raise AnnotationError(f"op {shown!r} (registered by {registrant!r}): {e.reason}",
                                  annotation=e.annotation, position=e.position) from None
    elif not callable(annotation):
        raise refuse(f"the annotation must be a string or a callable returning one, got "
                     f"{type(annotation).__name__} {annotation!r}",
                     "pass a dim annotation such as 'a k+, n k+ -> a n'")
    if code_impl_pattern not in CODE_IMPL_PATTERNS:
        raise refuse(f"code_impl_pattern must be one of {CODE_IMPL_PATTERNS}, got "
                     f"{code_impl_pattern!r}", "'import' (generated code imports the function) "
                     "or 'source' (it carries the function's source)")
    for option, value in (("emit_fn", emit_fn), ("input_gen_fn", input_gen_fn),
                          ("update_kwargs", update_kwargs)):
        if value is not None and not callable(value):
            raise refuse(f"{option} must be a callable or None, got {type(value).__name__} "
                         f"{value!r}", f"pass a function as {option}, or leave it out")
    if transform_rules is not None and not callable(transform_rules):
        if isinstance(transform_rules, (str, bytes)) or not hasattr(transform_rules, "__iter__"):
            raise refuse(f"transform_rules must be a sequence of TransformRule or a callable "
                         f"returning one, got {transform_rules!r}",
                         "transform_rules=[TransformRule(...)]")
        for rule in transform_rules:
            if not isinstance(rule, TransformRule):
                raise refuse(f"transform_rules holds {rule!r}, which is not a "
                             f"nnscaler.anno.TransformRule", "build each rule with TransformRule")
    if signature is not None and not isinstance(signature, inspect.Signature) \
            and not callable(signature):
        raise refuse(f"signature must be an inspect.Signature or a callable, got {signature!r}",
                     "pass inspect.signature(f), a function with the op's parameters, or None")
    for alias in aliases:
        if not callable(alias):
            raise refuse(f"aliases holds {alias!r}, which is not callable",
                         "list the other callables the tracer may see for this op")
    return name or op_name_of(fn)


def _check_arity(opdef: OpDef) -> None:
    """A string annotation's inputs must fit the parameters the signature shows."""
    if not isinstance(opdef.annotation, str) or opdef.signature is None:
        return
    P = inspect.Parameter
    params = list(opdef.signature.parameters.values())
    if any(p.kind == P.VAR_POSITIONAL for p in params):
        return
    takes = [p for p in params if p.kind != P.VAR_KEYWORD]
    n = len(parse(opdef.annotation).inputs)
    if n > len(takes):
        raise RegistrationError(
            f"op {opdef.name!r} (registered by {opdef.registrant!r}): its annotation "
            f"{opdef.annotation!r} has {n} inputs but {opdef.signature} has only "
            f"{len(takes)} parameters; the annotation names the parameters in order, one "
            f"entry each ('?' for a non-tensor). Fix: drop the extra entries, or register "
            f"the function whose parameters they describe"
        )


def op_name_of(fn: Callable) -> str:
    self_ = getattr(fn, "__self__", None)
    if inspect.isclass(self_):  # autograd.Function.apply
        return f"{self_.__module__}.{self_.__qualname__}.{fn.__name__}"
    module = getattr(fn, "__module__", None) or "builtins"
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    return f"{module}.{qualname}"


#: Names that lived here before `nnscaler.ops.user_ops` took them; still importable from
#: this module (the decorator's module imports this one, so they are looked up late).
_MOVED_TO_USER_OPS = frozenset({"UserOps", "user_ops", "register_op", "make_recording_wrapper"})


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_USER_OPS:
        from nnscaler.ops import user_ops

        return getattr(user_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
