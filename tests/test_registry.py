"""Registries check the values plugins give them, at registration, naming the plugin.

Each bad value is registered by a throwaway plugin given to a new plugin manager (the
way an installed plugin is loaded); loading fails with ``RegistrationError`` naming the
plugin, the entry and the rule. ``register_op`` checks everything it is given, and a
refused registration leaves later ``parallelize`` calls working.
"""

from __future__ import annotations

import types

import attrs
import pytest
import torch

import nnscaler
from nnscaler import ComputeConfig, parallelize
from nnscaler.anno import TransformRule
from nnscaler.errors import (
    DuplicateRegistrationError,
    NNScalerError,
    PluginError,
    RegistrationError,
)
from nnscaler.layout import Primitive
from nnscaler.models.mlp import MLP, MLPConfig
from nnscaler.plugins import NNScalerPluginManager
from nnscaler.registry import Registry, callable_taking


def plugin(name: str, hook: str, register) -> types.ModuleType:
    """A plugin module ``name`` whose ``hook`` calls ``register(registry)``."""
    module = types.ModuleType(name)

    def impl(registry):
        register(registry)

    impl.__name__ = hook
    setattr(module, hook, nnscaler.hookimpl(impl))
    return module


def load(module: types.ModuleType) -> RegistrationError:
    with pytest.raises(RegistrationError) as e:
        NNScalerPluginManager(autoload=False, plugins=[module])
    message = str(e.value)
    assert f"{module.__name__!r}" in message, message  # the plugin is named
    return e.value


def _policy(graph, compute_config):
    return graph


@attrs.frozen(kw_only=True)
class Noisy(Primitive):
    """A primitive for the tests; fields are set per case."""

    name: str = "noisy"
    adjoint: str = "noisy"
    transition: str | None = None


@attrs.frozen(kw_only=True)
class Unhashable(Primitive):
    name: str = "unhashable"
    adjoint: str = "unhashable"
    transition: str | None = None
    sizes: list = attrs.field(factory=list)


# -- policies and schedules ---------------------------------------------------------------


@pytest.mark.parametrize("value, rule", [
    (42, "not a callable"),
    ("tp", "not a callable"),
    (lambda graph: graph, "cannot be called with (graph, compute_config)"),
    (lambda graph, config, extra: graph, "cannot be called with (graph, compute_config)"),
])
def test_bad_policy_fails_at_load_naming_the_plugin(value, rule):
    err = load(plugin("bad_policy_plugin", "nnscaler_register_policies",
                      lambda r: r.register("mine", value)))
    assert "policy 'mine'" in str(err) and rule in str(err)
    assert isinstance(err, NNScalerError) and isinstance(err, ValueError)


def test_good_policies_register():
    pm = NNScalerPluginManager(autoload=False, plugins=[plugin(
        "good_policy_plugin", "nnscaler_register_policies", lambda r: (
            r.register("plain", _policy),
            r.register("defaults", lambda graph, compute_config, extra=1: graph),
            r.register("varargs", lambda *args: args[0]),
        ))])
    assert {"plain", "defaults", "varargs"} <= set(pm.policies)


@pytest.mark.parametrize("value, rule", [
    (None, "not a callable"),
    (lambda nstages, nmicros: [], "cannot be called with (nstages, nmicros, nvirtual)"),
])
def test_bad_schedule_fails_at_load_naming_the_plugin(value, rule):
    err = load(plugin("bad_schedule_plugin", "nnscaler_register_schedules",
                      lambda r: r.register("mine", value)))
    assert "schedule 'mine'" in str(err) and rule in str(err)


# -- adapters -------------------------------------------------------------------------------


@pytest.mark.parametrize("name, value, rule", [
    ("mine", "not a primitive", "not a nnscaler.layout.Primitive"),
    ("noisy", Noisy(transition="V->r"), "transition 'V->r' is not one of"),
    ("other", Noisy(), "registered as 'other' but its name is 'noisy'"),
    ("noisy", Noisy(adjoint=""), "adjoint '' is not the name of a primitive"),
    ("unhashable", Unhashable(), "not hashable"),
])
def test_bad_adapter_fails_at_load_naming_the_plugin(name, value, rule):
    err = load(plugin("bad_adapter_plugin", "nnscaler_register_adapters",
                      lambda r: r.register(name, value)))
    assert rule in str(err)


def test_adapter_whose_adjoint_is_missing_fails_at_load():
    err = load(plugin("nowhere_plugin", "nnscaler_register_adapters",
                      lambda r: r.register("noisy", Noisy(transition="V->R", adjoint="nowhere"))))
    assert "adjoint 'nowhere' no plugin registered" in str(err)


def test_adapter_with_its_adjoint_from_the_same_plugin_registers():
    both = plugin("pair_plugin", "nnscaler_register_adapters", lambda r: (
        r.register("fwd", Noisy(name="fwd", adjoint="bwd", transition="V->R")),
        r.register("bwd", Noisy(name="bwd", adjoint="fwd")),
    ))
    pm = NNScalerPluginManager(autoload=False, plugins=[both])
    assert {"fwd", "bwd"} <= set(pm.adapters)


def test_planner_refuses_a_mapping_with_a_non_primitive():
    from nnscaler.layout import Layout, LayoutError, plan

    src = Layout.parse("R(1)V(2)D(1)", shape=(4,))
    dst = Layout.parse("R(2)V(1)D(1)", shape=(4,))
    with pytest.raises(LayoutError, match="'junk'.*not a nnscaler.layout.Primitive"):
        plan(src, dst, {"junk": object()})


# -- the generic hook -------------------------------------------------------------------


def test_generic_validate_hook_names_the_registrant():
    loggers: Registry = Registry("logger", validate=callable_taking("record", what="logger "
                                                                    "is a callable (record)"))
    with loggers.registering_as("my_logging_plugin"):
        loggers.register("print", print)  # a C builtin: nothing to inspect, accepted
        with pytest.raises(RegistrationError, match="'my_logging_plugin' registered logger "
                                                    "'bad' as 3: it is a int, not a callable"):
            loggers.register("bad", 3)
    assert "bad" not in loggers
    with pytest.raises(RegistrationError, match="names are non-empty strings"):
        loggers.register("", print)


# -- ops -------------------------------------------------------------------------------------


def _triple(x):
    return x * 3


@pytest.mark.parametrize("fn, annotation, options, error, rule", [
    (42, "* -> *", {}, RegistrationError, "the op must be a callable, got int"),
    (_triple, 7, {}, RegistrationError, "annotation must be a string or a callable"),
    (_triple, "a b -> a c", {}, PluginError, "'c'"),  # caused by the AnnotationError
    (_triple, "a, b -> a", {}, RegistrationError, "2 inputs but (x) has only 1 parameters"),
    (_triple, "* -> *", {"code_impl_pattern": "inline"}, RegistrationError, "code_impl_pattern"),
    (_triple, "* -> *", {"transform_rules": ["split"]}, RegistrationError, "not a "
     "nnscaler.anno.TransformRule"),
    (_triple, "* -> *", {"input_gen_fn": 3}, RegistrationError, "input_gen_fn must be a callable"),
    (_triple, "* -> *", {"name": ""}, RegistrationError, "op names are non-empty strings"),
])
def test_bad_op_fails_at_load_naming_op_and_plugin(fn, annotation, options, error, rule):
    module = plugin("bad_op_plugin", "nnscaler_register_ops",
                    lambda r: r.register(fn, annotation, **options))
    with pytest.raises(error) as e:
        NNScalerPluginManager(autoload=False, plugins=[module])
    text = str(e.value)
    assert "'bad_op_plugin'" in text and rule in text, text
    if error is PluginError:
        assert isinstance(e.value.__cause__, nnscaler.AnnotationError)


def test_register_op_validates_at_the_call(fresh_plugins):
    with pytest.raises(RegistrationError, match="op '42' .*registered by 'user code'.*callable"):
        nnscaler.register_op("* -> *")(42)
    with pytest.raises(RegistrationError, match="annotation must be a string"):
        nnscaler.register_op(5)(_triple)
    with pytest.raises(RegistrationError, match="has 2 inputs"):
        nnscaler.register_op("a, a -> a", name="test.arity")(_triple)
    with pytest.raises(RegistrationError, match="transform_rules"):
        nnscaler.register_op("a -> a", name="test.rules", transform_rules=[TransformRule])(_triple)


def test_register_op_duplicate_names_fail_at_the_second_call(fresh_plugins):
    nnscaler.register_op("* -> *", name="test.twice")(_triple)
    with pytest.raises(DuplicateRegistrationError, match="'test.twice'"):
        nnscaler.register_op("* -> *", name="test.twice")(lambda x: x)
    # a name a plugin holds: refused at once when the plugins are loaded ...
    fresh_plugins.get_plugin_manager()
    with pytest.raises(DuplicateRegistrationError, match="torch.nn.functional.linear"):
        nnscaler.register_op("* -> *", name="torch.nn.functional.linear")(lambda x: x)
    # ... else when they load, naming the op and 'user code'; the next load goes without it
    fresh_plugins.reset_plugin_manager()
    nnscaler.register_op("* -> *", name="torch.nn.functional.gelu")(lambda x: x)
    with pytest.raises(PluginError, match="'user code'.*torch.nn.functional.gelu"):
        fresh_plugins.get_plugin_manager()
    ops = fresh_plugins.get_plugin_manager().ops
    assert ops.get("test.twice").fn is _triple
    assert ops.get("torch.nn.functional.gelu").registrant == "nnscaler.ops.builtin"


def test_refused_registrations_leave_parallelize_working(fresh_plugins, tmp_path):
    bad = [
        lambda: nnscaler.register_op("* -> *")(42),
        lambda: nnscaler.register_op(3)(_triple),
        lambda: nnscaler.register_op("a, b -> a", name="test.bad_arity")(_triple),
        lambda: nnscaler.register_op("* -> *", name="torch.nn.functional.linear")(_triple),
    ]
    fresh_plugins.reset_plugin_manager()  # not loaded: checked without the plugins
    for register in bad[:3]:
        with pytest.raises(NNScalerError):
            register()
    fresh_plugins.get_plugin_manager()
    with pytest.raises(NNScalerError):
        bad[3]()
    model = MLP(MLPConfig(d_in=8, d_hidden=16, n_classes=4, n_layers=2))
    batch = {"x": torch.randn(4, 8), "y": torch.randint(0, 4, (4,))}
    result = parallelize(model, {"batch": batch},
                         "dp", ComputeConfig(plan_ngpus=1, runtime_ngpus=1),
                         gen_savedir=tmp_path, load_module=False)
    assert result is None
    assert any(tmp_path.rglob("gencode0.py"))
