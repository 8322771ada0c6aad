"""Named registries that plugins fill through their ``nnscaler_register_*`` hooks.

A registry maps a name to an object and remembers which plugin registered it (the
*registrant*), so that a clash names both plugins and ``python -m nnscaler plugins`` can
say what each plugin contributed.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from nnscaler.errors import DuplicateRegistrationError, UnknownNameError

T = TypeVar("T")

#: registrant used for registrations made outside any plugin hook (e.g. ``register_op``
#: called from user code after the plugins were loaded).
USER_REGISTRANT = "user code"


class Registry(Generic[T]):
    """An insertion-ordered ``name -> object`` map with registrants and good errors.

    ``kind`` is the singular noun used in messages ("op", "policy", ...).
    ``install_hint`` is appended to unknown-name errors (e.g. which package provides
    optional entries).
    """

    def __init__(self, kind: str, *, plural: str | None = None, install_hint: str = "") -> None:
        self.kind = kind
        self.plural = plural or kind + "s"
        self.install_hint = install_hint
        self._items: dict[str, T] = {}
        self._registrants: dict[str, str] = {}
        self._current_registrant = USER_REGISTRANT

    # -- registration -------------------------------------------------------------------
    def register(self, name: str, obj: T, *, registrant: str | None = None) -> T:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} names must be non-empty strings, got {name!r}")
        who = registrant or self._current_registrant
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
