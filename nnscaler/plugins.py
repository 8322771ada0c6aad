"""The plugin manager: built-in plugins, entry-point plugins, and the registries.

Plugins are found in this order:

1. the built-in plugins (`BUILTIN_PLUGINS`), registered exactly like third-party
   ones (pytest's model);
2. every entry point in the group ``nnscaler`` (skipped when the environment variable
   ``NNSCALER_DISABLE_PLUGIN_AUTOLOAD`` is set to a true value);
3. ops registered from user code with [`nnscaler.register_op`][nnscaler.register_op]
   (`nnscaler.ops.user_ops.user_ops`, replayed into every manager).

The registries validate what plugins give them (`nnscaler.registry`): a policy or
schedule must be a callable of the right parameters, an adapter a
`Primitive` with a known transition whose adjoint is registered,
an op a callable whose annotation parses and fits it. A bad value fails at load with
[`RegistrationError`][nnscaler.errors.RegistrationError] naming the plugin.

The manager hands its registries down to the layers below it (which never import this
module) through `nnscaler.registry.set_registry_provider`.

The manager is created lazily on first use by [`get_plugin_manager`][nnscaler.get_plugin_manager];
the environment is read then, not at import time.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import attrs
import pluggy

from nnscaler import hookspecs
from nnscaler.errors import PluginError, RegistrationError
from nnscaler.layout.primitives import check_adjoints, validate_primitive
from nnscaler.ops.builtin.attention_kernels import validate_kernel
from nnscaler.ops.registry import OpRegistry
from nnscaler.ops.user_ops import user_ops
from nnscaler.registry import USER_REGISTRANT, Registry, callable_taking, set_registry_provider

ENTRY_POINT_GROUP = "nnscaler"
DISABLE_AUTOLOAD_ENV = "NNSCALER_DISABLE_PLUGIN_AUTOLOAD"

#: Built-in plugins, by module name. Each is an ordinary plugin module with hookimpls.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "nnscaler.ops.builtin",
    "nnscaler.schedule.builtin",
    "nnscaler.layout.primitives",
    "nnscaler.graph.ops",
    "nnscaler.policies",
    "nnscaler.cli.loggers",
)

#: The registry hooks and the attribute of `NNScalerPluginManager` they fill.
REGISTRY_HOOKS: dict[str, str] = {
    "nnscaler_register_ops": "ops",
    "nnscaler_register_policies": "policies",
    "nnscaler_register_schedules": "schedules",
    "nnscaler_register_adapters": "adapters",
    "nnscaler_register_loggers": "loggers",
    "nnscaler_register_attention_kernels": "attention_kernels",
}


@attrs.frozen
class PluginInfo:
    name: str
    module: str
    distribution: str | None  # None for built-ins and user code
    version: str | None
    builtin: bool


def _logger_class(name: str, obj: Any) -> None:
    """A ``validate`` for the loggers registry: a class with ``log_metrics``."""
    if not isinstance(obj, type) or not callable(getattr(obj, "log_metrics", None)):
        raise TypeError(
            f"it is {obj!r}, not a logger class; a logger is a class built as "
            f"cls(**LogConfig.args) with log_metrics(metrics, step, tag=...). Fix: register "
            f"the class (see nnscaler.cli.loggers.LoggerBase)"
        )


def _autoload_disabled() -> bool:
    return os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in ("", "0", "false", "no")


class NNScalerPluginManager:
    """A pluggy ``PluginManager`` plus the registries its plugins fill."""

    def __init__(self, *, autoload: bool | None = None, plugins: Sequence[Any] = ()) -> None:
        """Load the built-ins, then (unless ``autoload`` is false, or the environment
        disables it) the entry-point plugins, then ``plugins`` (objects or modules given
        directly), then the ops registered with ``register_op``; fill the registries."""
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.pm.hook.nnscaler_add_hookspecs.call_historic(kwargs={"pluginmanager": self.pm})
        self.ops = OpRegistry()
        self.policies: Registry[Callable] = Registry(
            "policy",
            plural="policies",
            install_hint="Install a policy plugin (e.g. `pip install ./plugins/policy_megatron`) "
            "or pass a callable `(graph, compute_config) -> graph` as pas_policy.",
            validate=callable_taking(
                "graph", "compute_config", what="policy is a callable (graph, compute_config)"
            ),
        )
        self.schedules: Registry[Callable] = Registry(
            "schedule",
            validate=callable_taking(
                "nstages", "nmicros", "nvirtual",
                what="schedule is a callable (nstages, nmicros, nvirtual) -> action lists",
            ),
        )
        self.adapters: Registry[Any] = Registry(
            "adapter", validate=validate_primitive, validate_all=check_adjoints
        )
        self.loggers: Registry[Any] = Registry(
            "logger",
            install_hint="Install a logger plugin, or give the logger's class (or its import "
            "path) as LogConfig.type.",
            validate=_logger_class,
        )
        self.attention_kernels: Registry[Any] = Registry(
            "attention kernel", validate=validate_kernel)
        self.infos: dict[str, PluginInfo] = {}
        self._order: list[str] = []
        for modname in BUILTIN_PLUGINS:
            self._register_plugin(
                modname, lambda m=modname: importlib.import_module(m), builtin=True, dist=None
            )
        if autoload is None:
            autoload = not _autoload_disabled()
        if autoload:
            for ep in _entry_points():
                dist = ep.dist
                self._register_plugin(
                    ep.name,
                    ep.load,
                    builtin=False,
                    dist=(dist.metadata["Name"], dist.version) if dist is not None else None,
                    where=f"entry point {ep.name} = {ep.value}",
                )
        for plugin in plugins:
            name = getattr(plugin, "__name__", None) or type(plugin).__name__
            self._register_plugin(name, lambda p=plugin: p, builtin=False, dist=None)
        self._register_plugin(
            "user-ops", lambda: user_ops, builtin=True, dist=None, name_override=USER_REGISTRANT
        )
        self._fill_registries()

    # -- loading ------------------------------------------------------------------------
    def _register_plugin(
        self,
        name: str,
        load: Callable[[], Any],
        *,
        builtin: bool,
        dist: tuple[str, str] | None,
        where: str = "",
        name_override: str | None = None,
    ) -> None:
        pname = name_override or name
        try:
            plugin = load()
        except Exception as e:
            raise PluginError(
                f"plugin {pname!r} ({where or name}"
                f"{', from ' + dist[0] + ' ' + dist[1] if dist else ''}) failed to load: "
                f"{type(e).__name__}: {e}. Fix or uninstall it, or set "
                f"{DISABLE_AUTOLOAD_ENV}=1 to load the built-in plugins only."
            ) from e
        if self.pm.is_registered(plugin):
            return
        try:
            self.pm.register(plugin, name=pname)
        except pluggy.PluginValidationError as e:
            raise PluginError(f"plugin {pname!r} is invalid: {e}") from e
        module = plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__module__
        self.infos[pname] = PluginInfo(
            name=pname,
            module=module,
            distribution=dist[0] if dist else None,
            version=dist[1] if dist else None,
            builtin=builtin,
        )
        self._order.append(pname)

    def _fill_registries(self) -> None:
        for hook_name, attr in REGISTRY_HOOKS.items():
            registry: Registry = getattr(self, attr)
            hook = getattr(self.pm.hook, hook_name)
            for impl in hook.get_hookimpls():  # registration order: built-ins first
                with registry.registering_as(impl.plugin_name):
                    try:
                        impl.function(**{a: registry for a in impl.argnames})
                    except (PluginError, RegistrationError):
                        raise
                    except Exception as e:
                        raise PluginError(
                            f"plugin {impl.plugin_name!r} raised in hook {hook_name}: "
                            f"{type(e).__name__}: {e}"
                        ) from e
            registry.check_complete()

    # -- queries ------------------------------------------------------------------------
    def plugins(self) -> list[PluginInfo]:
        return [self.infos[n] for n in self._order]

    def contributions(self, plugin: str) -> dict[str, list[str]]:
        """What ``plugin`` registered, by registry attribute."""
        return {
            attr: getattr(self, attr).by_registrant(plugin) for attr in REGISTRY_HOOKS.values()
        }

    def report(self) -> str:
        """A human-readable listing, as printed by ``python -m nnscaler plugins``."""
        lines = []
        for info in self.plugins():
            origin = (
                f"{info.distribution} {info.version}"
                if info.distribution
                else ("built-in" if info.builtin else "unknown distribution")
            )
            lines.append(f"{info.name}  ({origin}; module {info.module})")
            for attr, names in self.contributions(info.name).items():
                if names:
                    shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
                    lines.append(f"    {attr}: {shown}")
        return "\n".join(lines)


def _entry_points() -> Iterator[importlib.metadata.EntryPoint]:
    seen = set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in seen:  # the same distribution found twice on sys.path
            continue
        seen.add(ep.name)
        yield ep


_MANAGER: NNScalerPluginManager | None = None
_LOCK = threading.RLock()


def get_plugin_manager() -> NNScalerPluginManager:
    """The process-wide plugin manager, created (and plugins loaded) on first call."""
    global _MANAGER
    if _MANAGER is None:
        with _LOCK:
            if _MANAGER is None:
                _MANAGER = NNScalerPluginManager()
    return _MANAGER


def _provide(kind: str, load: bool) -> Any:
    """The `nnscaler.registry.active_registry` provider: this process's registries."""
    manager = get_plugin_manager() if load else _MANAGER
    if manager is None:
        return None
    if kind not in REGISTRY_HOOKS.values():
        raise ValueError(f"no registry of kind {kind!r}; kinds: {sorted(REGISTRY_HOOKS.values())}")
    return getattr(manager, kind)


set_registry_provider(_provide)


def reset_plugin_manager() -> None:
    """Forget the loaded plugins; the next [`get_plugin_manager`][nnscaler.get_plugin_manager] loads
    them anew."""
    global _MANAGER
    with _LOCK:
        _MANAGER = None
