"""Named registries that plugins fill through their ``nnscaler_register_*`` hooks.

A registry maps a name to an object and remembers which plugin registered it (the
*registrant*), so that a clash names both plugins and ``python -m nnscaler plugins`` can
say what each plugin contributed. A registry may validate each value when it is
registered (``validate=``) and the whole set once every plugin has registered
(``validate_all=``): a wrong registration fails when it is made, naming the plugin, not
three layers later.

The layers below the plugin manager (ops, layout, schedule, graph) never import it: they
take a registry argument, and when a caller passes none they ask `active_registry`
for the process-wide one, which `nnscaler.plugins` provides (handed down with
`set_registry_provider`, not looked up from above).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from nnscaler.errors import (
    DuplicateRegistrationError,
    NNScalerError,
    RegistrationError,
    UnknownNameError,
)

T = TypeVar("T")

#: registrant used for registrations made outside any plugin hook (e.g. ``register_op``
#: called from user code after the plugins were loaded).
USER_REGISTRANT = "user code"


class Registry(Generic[T]):
    """An insertion-ordered ``name -> object`` map with registrants and good errors.

    ``kind`` is the singular noun used in messages ("op", "policy", ...).
    ``install_hint`` is appended to unknown-name errors (e.g. which package provides
    optional entries). ``validate(name, obj)`` checks one value as it is registered: it
    raises ``TypeError`` or ``ValueError`` stating the rule and the fix, and the registry
    re-raises it as [`RegistrationError`][nnscaler.errors.RegistrationError] naming the entry and
    the registering plugin. ``validate_all(registry)`` checks what entries need of each other
    (an adapter's adjoint is registered) once every plugin has registered; it raises
    [`RegistrationError`][nnscaler.errors.RegistrationError] itself.
    """

    def __init__(
        self,
        kind: str,
        *,
        plural: str | None = None,
        install_hint: str = "",
        validate: Callable[[str, Any], None] | None = None,
        validate_all: Callable[[Registry[T]], None] | None = None,
    ) -> None:
        self.kind = kind
        self.plural = plural or kind + "s"
        self.install_hint = install_hint
        self.validate = validate
        self.validate_all = validate_all
        self._items: dict[str, T] = {}
        self._registrants: dict[str, str] = {}
        self._current_registrant = USER_REGISTRANT

    # -- registration -------------------------------------------------------------------
    def register(self, name: str, obj: T, *, registrant: str | None = None) -> T:
        """Add ``obj`` under ``name``; a clash or a value ``validate`` refuses raises here."""
        who = registrant or self._current_registrant
        if not isinstance(name, str) or not name:
            raise RegistrationError(
                f"{who!r} registered a {self.kind} under the name {name!r}: names are "
                f"non-empty strings. Fix: registry.register('my_{self.kind}', value)."
            )
        if self.validate is not None:
            try:
                self.validate(name, obj)
            except (TypeError, ValueError) as e:
                if isinstance(e, RegistrationError):
                    raise
                raise RegistrationError(
                    f"{who!r} registered {self.kind} {name!r} as {_short(obj)}: {e}"
                ) from None
        if name in self._items:
            raise DuplicateRegistrationError(
                f"{self.kind} {name!r} is registered twice: first by {self._registrants[name]!r}, "
                f"then by {who!r}. Rename one of them, or disable one plugin "
                f"(NNSCALER_DISABLE_PLUGIN_AUTOLOAD=1 loads the built-ins only)."
            )
        self._items[name] = obj
        self._registrants[name] = who
        return obj

    @contextlib.contextmanager
    def registering_as(self, registrant: str) -> Iterator[None]:
        """Attribute every registration made inside the block to ``registrant``."""
        previous, self._current_registrant = self._current_registrant, registrant
        try:
            yield
        finally:
            self._current_registrant = previous

    def check_complete(self) -> None:
        """Run ``validate_all`` (the plugin manager calls it once every plugin has
        registered)."""
        if self.validate_all is not None:
            self.validate_all(self)

    def unregister(self, name: str) -> T:
        self._registrants.pop(name, None)
        return self._items.pop(name)

    # -- lookup -------------------------------------------------------------------------
    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self._unknown_message(name)) from None

    def _unknown_message(self, name: Any) -> str:
        names = sorted(self._items)
        msg = f"no {self.kind} named {name!r} is registered."
        close = difflib.get_close_matches(str(name), names, n=3)
        if close:
            msg += f" Did you mean {', '.join(map(repr, close))}?"
        shown = ", ".join(names) if len(names) <= 60 else ", ".join(names[:60]) + ", ..."
        msg += f" Registered {self.plural}: {shown or '(none)'}."
        if self.install_hint:
            msg += " " + self.install_hint
        return msg

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def items(self):
        return self._items.items()

    def names(self) -> list[str]:
        return list(self._items)

    def registrant(self, name: str) -> str:
        return self._registrants[name]

    def by_registrant(self, registrant: str) -> list[str]:
        return [n for n, r in self._registrants.items() if r == registrant]

    def __repr__(self) -> str:
        return f"<Registry {self.kind}: {len(self)} entries>"


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def callable_taking(*params: str, what: str) -> Callable[[str, Any], None]:
    """A ``validate`` for registries of callables: the value must be callable and, where
    `inspect.signature` can see its parameters, accept ``params`` positionally.
    ``what`` names the expected form in the error (``"a policy (graph, compute_config)
    -> graph"``)."""

    def validate(name: str, obj: Any) -> None:
        if not callable(obj):
            raise TypeError(
                f"it is a {type(obj).__name__}, not a callable; a {what}. Fix: register "
                f"the function itself"
            )
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):  # a C builtin: nothing to check
            return
        try:
            sig.bind(*params)
        except TypeError as e:
            raise TypeError(
                f"its signature {sig} cannot be called with ({', '.join(params)}): {e}; a "
                f"{what}. Fix: give it exactly these positional parameters (more only "
                f"with defaults)"
            ) from None

    return validate


# ---------------------------------------------------------------------------------------
# The process-wide registries, handed down by the plugin layer
# ---------------------------------------------------------------------------------------

#: ``provider(kind, load)`` returns the process-wide registry of ``kind`` (``"ops"``,
#: ``"policies"``, ``"schedules"``, ``"adapters"``, ``"loggers"``,
#: ``"attention_kernels"``), loading the plugins first when ``load`` is true, else None
#: when they are not loaded yet.
RegistryProvider = Callable[[str, bool], Any]

_provider: RegistryProvider | None = None


def set_registry_provider(provider: RegistryProvider | None) -> None:
    """Install the function that gives the process-wide registries. `nnscaler.plugins`
    installs its plugin manager's when it is imported (``import nnscaler`` does that)."""
    global _provider
    _provider = provider


def active_registry(kind: str, *, load: bool = True) -> Any:
    """The process-wide registry of ``kind`` (the plugin manager's; loaded on first use).

    With ``load=False``, None when the plugins are not loaded yet. Layers below the plugin
    manager call this only when their caller passed no registry.
    """
    if _provider is None:
        raise NNScalerError(
            f"no plugin manager provides the {kind} registry: import nnscaler (which loads "
            f"nnscaler.plugins) or pass the registry explicitly"
        )
    return _provider(kind, load)
