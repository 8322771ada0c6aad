"""[`register_op`][nnscaler.register_op], the user-facing decorator, and what it builds on:
`UserOps` (the ops registered from user code, loaded by every plugin manager as the
plugin ``"user code"``) and `make_recording_wrapper` (a function the tracer records as one
op, also used by plugins that wrap a library's kernel).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from nnscaler.anno import TransformRule, parse
from nnscaler.errors import DuplicateRegistrationError
from nnscaler.hookspecs import hookimpl
from nnscaler.ops.registry import OpRegistry, check_op_options, op_call_interceptor
from nnscaler.registry import USER_REGISTRANT, active_registry


class UserOps:
    """Ops registered from user code with [`register_op`][nnscaler.register_op]: a plugin (``"user
    code"``) that every plugin manager loads last, so each new manager gets them too.

    `add` checks a registration at once (`check_op_options`, and against the
    loaded op registry when there is one); a registration that is refused is not kept, so
    it cannot break later ``parallelize`` calls in the process.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[Callable, Any, dict[str, Any]]] = []

    def add(self, fn: Callable, annotation: Any, **options: Any) -> str:
        options = {k: v for k, v in options.items() if v is not None}
        name = check_op_options(fn, annotation, registrant=USER_REGISTRANT, **options)
        options["name"] = name
        if any(entry[2]["name"] == name for entry in self.entries):
            raise DuplicateRegistrationError(
                f"op {name!r} is registered twice from user code. Fix: register it once, or "
                f"give the second one another name=")
        live = active_registry("ops", load=False)
        if live is not None:  # plugins loaded: register now, a clash surfaces now
            live.register(fn, annotation, registrant=USER_REGISTRANT, **options)
        else:  # not loaded: the checks that need no other plugin, on a scratch registry
            scratch = OpRegistry()
            scratch.register(fn, annotation, registrant=USER_REGISTRANT, **options)
        self.entries.append((fn, annotation, options))
        return name

    @hookimpl
    def nnscaler_register_ops(self, registry: OpRegistry) -> None:
        for entry in list(self.entries):
            fn, annotation, options = entry
            try:
                registry.register(fn, annotation, **options)
            except Exception:
                # e.g. a name a plugin loaded later also registers: drop it, so that the
                # next manager (the next parallelize) loads without it
                self.entries.remove(entry)
                raise


#: the ops registered from user code (see `UserOps`)
user_ops = UserOps()


def register_op(
    annotation: str | Callable[..., str],
    name: str | None = None,
    code_impl_pattern: str = "import",
    emit_fn: Callable[..., str] | None = None,
    transform_rules: Sequence[TransformRule] | None = None,
    input_gen_fn: Callable[..., Any] | None = None,
    *,
    collective: bool = False,
):
    """Register a function as an operator with a dim annotation.

    Use as a decorator (``@register_op('a k+, n k+ -> a n')``) or a call
    (``register_op(anno)(MyFunction.apply)``). The tracer records each call of the
    returned function as one node and never traces into it.

    - ``annotation``: the dim annotation, or a callable taking the op's arguments and
      returning one.
    - ``name``: the op's name (default: module and qualified name of the function).
    - ``code_impl_pattern``: ``'import'`` (generated code imports the function) or
      ``'source'`` (generated code carries the function's source).
    - ``emit_fn``: a custom code emitter for the generated code.
    - ``transform_rules``: [`TransformRule`][nnscaler.TransformRule] objects that replace the
      splits the annotation would derive, or a callable taking the call's bound
      annotation and returning them.
    - ``input_gen_fn``: ``input_gen_fn(rng: random.Random) -> (args, kwargs)`` draws one
      random valid call of the op; `nnscaler.ops.verify.verify_op` checks the
      annotation on such calls (the test suite does so for every built-in op).
    - ``collective``: the function is the *part op* of another op's
      [`TransformRule`][nnscaler.TransformRule] (``part_op=``) whose parts talk to each other:
      it takes the keyword ``group``, a `PartGroup`.

    Returns the function to call in models: for a plain function, a wrapper with the same
    name and docstring; for ``SomeFunction.apply``, ``SomeFunction.apply`` itself is
    redirected through the wrapper so that existing call sites are recorded too.
    """
    if isinstance(annotation, str):
        parse(annotation)  # fail at the decorator, with the caret

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        opdef_name = user_ops.add(
            fn,
            annotation,
            name=name,
            code_impl_pattern=code_impl_pattern,
            emit_fn=emit_fn,
            transform_rules=transform_rules,
            input_gen_fn=input_gen_fn,
            collective=collective or None,
        )
        return make_recording_wrapper(fn, opdef_name)

    return decorator


def make_recording_wrapper(fn: Callable[..., Any], opdef_name: str) -> Callable[..., Any]:
    """Wrap ``fn`` so that a running tracer records its calls as one op."""
    self_ = getattr(fn, "__self__", None)
    original = getattr(fn, "__func__", None)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        interceptor = op_call_interceptor.get()
        if interceptor is not None:
            opdef = active_registry("ops").get(opdef_name)
            return interceptor(opdef, args, kwargs)
        return fn(*args, **kwargs)

    wrapper.__wrapped_op__ = opdef_name  # type: ignore[attr-defined]
    if inspect.isclass(self_) and original is not None and fn.__name__ == "apply":
        # torch.autograd.Function.apply: redirect the class attribute so that models that
        # call ``MyFunction.apply(...)`` directly are recorded as well.
        self_.apply = staticmethod(wrapper)  # type: ignore[attr-defined]
    return wrapper
