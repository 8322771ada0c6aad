"""The plugin system: built-ins, entry-point plugins, errors, and the listing command."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import nnscaler
from nnscaler.errors import DuplicateRegistrationError, PluginError, UnknownNameError
from nnscaler.plugins import NNScalerPluginManager

PLUGIN_SOURCE = '''
import torch
import nnscaler


def triple(x):
    return x * 3


def my_policy(graph, compute_config):
    return graph


@nnscaler.hookimpl
def nnscaler_register_ops(registry):
    registry.register(triple, "* -> *", name="throwaway.triple")


@nnscaler.hookimpl
def nnscaler_register_policies(registry):
    registry.register("throwaway_policy", my_policy)
'''


def make_distribution(tmp_path, name: str, source: str, version: str = "0.3.1") -> str:
    """A throwaway installed distribution: a package plus its dist-info on sys.path."""
    pkg = f"{name}_pkg"
    (tmp_path / f"{pkg}.py").write_text(textwrap.dedent(source))
    info = tmp_path / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[nnscaler]\n{name} = {pkg}\n")
    return str(tmp_path)


@pytest.fixture
def throwaway(tmp_path, monkeypatch):
    path = make_distribution(tmp_path, "throwaway", PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(path)
    yield "throwaway"
    sys.modules.pop("throwaway_pkg", None)


def test_builtin_plugin_registers_ops():
    pm = NNScalerPluginManager(autoload=False)
    info = pm.plugins()[0]
    assert info.name == "nnscaler.ops.builtin" and info.builtin
    assert "torch.nn.functional.linear" in pm.ops
    assert pm.ops.lookup(torch.nn.functional.linear).name == "torch.nn.functional.linear"


def test_entry_point_plugin_is_discovered(throwaway, monkeypatch):
    monkeypatch.delenv("NNSCALER_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pm = NNScalerPluginManager()
    info = {p.name: p for p in pm.plugins()}["throwaway"]
    assert (info.distribution, info.version, info.builtin) == ("throwaway", "0.3.1", False)
    assert pm.contributions("throwaway") == {
        "ops": ["throwaway.triple"],
        "policies": ["throwaway_policy"],
        "schedules": [],
        "adapters": [],
        "loggers": [],
        "attention_kernels": [],
    }
    opdef = pm.ops.get("throwaway.triple")
    assert opdef.registrant == "throwaway"
    assert torch.equal(opdef.call([torch.ones(2)], {}), torch.full((2,), 3.0))
    assert "throwaway 0.3.1" in pm.report()


def test_autoload_disabled_loads_builtins_only(throwaway, monkeypatch):
    monkeypatch.setenv("NNSCALER_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = NNScalerPluginManager()
    assert "throwaway" not in {p.name for p in pm.plugins()}
    assert "throwaway.triple" not in pm.ops
    assert "throwaway_policy" not in pm.policies
    assert "torch.matmul" in pm.ops


def test_unknown_name_lists_registered(throwaway, monkeypatch):
    monkeypatch.delenv("NNSCALER_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pm = NNScalerPluginManager()
    with pytest.raises(UnknownNameError) as e:
        pm.policies.get("throwaway_polcy")
    msg = str(e.value)
    assert "no policy named 'throwaway_polcy'" in msg
    assert "Did you mean 'throwaway_policy'" in msg
    assert "throwaway_policy" in msg and "pip install" in msg
    assert isinstance(e.value, LookupError)


def test_plugin_failing_to_load_is_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(make_distribution(tmp_path, "broken", "raise RuntimeError('boom')\n"))
    with pytest.raises(PluginError) as e:
        NNScalerPluginManager(autoload=True)
    assert "'broken'" in str(e.value) and "boom" in str(e.value) and "broken 0.3.1" in str(e.value)
    sys.modules.pop("broken_pkg", None)


def test_plugin_failing_in_hook_is_named_with_hook(tmp_path, monkeypatch):
    source = """
import nnscaler

@nnscaler.hookimpl
def nnscaler_register_policies(registry):
    raise ValueError("bad policy table")
"""
    monkeypatch.syspath_prepend(make_distribution(tmp_path, "badhook", source))
    with pytest.raises(PluginError) as e:
        NNScalerPluginManager(autoload=True)
    assert "'badhook'" in str(e.value) and "nnscaler_register_policies" in str(e.value)
    assert "bad policy table" in str(e.value)
    sys.modules.pop("badhook_pkg", None)


def test_duplicate_names_name_both_registrants(tmp_path, monkeypatch):
    source = """
import torch
import nnscaler

@nnscaler.hookimpl
def nnscaler_register_ops(registry):
    registry.register(torch.nn.functional.linear, "a k^, n k^ -> a n", name="torch.nn.functional.linear")
"""
    monkeypatch.syspath_prepend(make_distribution(tmp_path, "clash", source))
    with pytest.raises(PluginError) as e:
        NNScalerPluginManager(autoload=True)
    cause = e.value.__cause__
    assert isinstance(cause, DuplicateRegistrationError)
    assert "'nnscaler.ops.builtin'" in str(cause) and "'clash'" in str(cause)
    sys.modules.pop("clash_pkg", None)


def test_duplicate_policy_in_one_registry():
    pm = NNScalerPluginManager(autoload=False)
    with pm.policies.registering_as("first"):
        pm.policies.register("p", lambda g, c: g)
    with pytest.raises(DuplicateRegistrationError, match="first by 'first', then by 'second'"):
        pm.policies.register("p", lambda g, c: g, registrant="second")


def test_cli_lists_plugins(throwaway):
    env = {"PYTHONPATH": throwaway_path(), "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-m", "nnscaler", "plugins"],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, **env},
    ).stdout
    assert "nnscaler.ops.builtin  (built-in" in out
    assert "ops: " in out
    assert "throwaway  (throwaway 0.3.1" in out
    assert "policies: throwaway_policy" in out


def throwaway_path() -> str:
    return next(p for p in sys.path if p and __import__("os").path.exists(p + "/throwaway_pkg.py"))


def test_register_op_decorator_and_call_forms(fresh_plugins):
    @nnscaler.register_op("a k+, k+ n -> a n", name="test.mymatmul")
    def mymatmul(x, w):
        return x @ w

    x, w = torch.randn(4, 6), torch.randn(6, 8)
    assert torch.equal(mymatmul(x, w), x @ w)
    pm = fresh_plugins.get_plugin_manager()
    opdef = pm.ops.get("test.mymatmul")
    assert opdef.registrant == "user code"

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    nnscaler.register_op("* -> *")(Double.apply)
    assert any(n.endswith("Double.apply") for n in pm.ops.by_registrant("user code"))
    assert torch.equal(Double.apply(torch.ones(3)), torch.full((3,), 2.0))


def test_register_op_rejects_malformed_annotation_at_decorator(fresh_plugins):
    with pytest.raises(nnscaler.AnnotationError):
        nnscaler.register_op("a b -> a c")


def test_register_op_replayed_into_new_manager(fresh_plugins):
    @nnscaler.register_op("* -> *", name="test.replayed")
    def f(x):
        return x

    fresh_plugins.reset_plugin_manager()
    assert "test.replayed" in fresh_plugins.get_plugin_manager().ops


def _kernel_imports(source: str) -> list[str]:
    """The names a plugin module takes from nnscaler other than through `nnscaler.extend`,
    `nnscaler.errors` and the public names of `nnscaler` (``nnscaler.__all__``)."""
    import ast

    allowed_modules = {"nnscaler.extend", "nnscaler.errors"}
    public = set(nnscaler.__all__) | {"extend", "errors"}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "nnscaler":
                found += [f"nnscaler.{a.name}" for a in node.names if a.name not in public]
            elif node.module.startswith("nnscaler.") and node.module not in allowed_modules:
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("nnscaler.")
                      and a.name not in allowed_modules]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "nnscaler" and node.attr not in public):
            found.append(f"nnscaler.{node.attr}")
    return found


def test_the_import_check_sees_kernel_imports():
    source = textwrap.dedent("""
        import nnscaler
        import nnscaler.runtime
        from nnscaler import parallelize, hookimpl
        from nnscaler.extend import IRGraph
        from nnscaler.errors import PolicyError
        from nnscaler.graph.blocks import layer_path

        def f():
            from nnscaler.ir import Op
            return nnscaler.ComputeConfig, nnscaler.plugins
    """)
    assert sorted(_kernel_imports(source)) == sorted([
        "nnscaler.runtime", "nnscaler.hookimpl", "nnscaler.graph.blocks", "nnscaler.ir",
        "nnscaler.plugins"])


def test_plugin_packages_import_the_kernel_through_nnscaler_extend():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "plugins"
    files = sorted(root.glob("*/nnscaler_*/**/*.py"))
    assert len(files) > 10
    bad = [f"{f.relative_to(root)}: {name}" for f in files
           for name in _kernel_imports(f.read_text())]
    assert not bad, ("a plugin package takes kernel names from nnscaler.extend (or the public "
                     "names of nnscaler, or nnscaler.errors); add what it needs to "
                     "nnscaler/extend.py instead of importing a kernel module:\n"
                     + "\n".join(bad))


def test_docs_list_what_nnscaler_extend_exports():
    import re
    from pathlib import Path

    import nnscaler.extend

    doc = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()
    section = doc.split("## What a plugin imports")[1].split("\n## ")[0]
    listed = set(re.findall(r"`(\w+)`", section))
    assert not set(nnscaler.extend.__all__) - listed, sorted(set(nnscaler.extend.__all__) - listed)
