"""The layering of the package is a rule, not a drawing.

- The import-linter contract in ``pyproject.toml`` (the layer order of docs/internals/layers.md) holds:
  ``lint-imports`` passes.
- Every sub-package and top-level module of ``nnscaler`` has a place in that contract.
- The import graph between the *rooms* (the packages and top-level modules of
  ``nnscaler``, and each installed plugin package) has no cycle: a module never imports,
  however indirectly, a module of another room that imports it back. The facade
  ``nnscaler/__init__`` is aside (it re-exports from all of them); imports under
  ``if TYPE_CHECKING:`` are not counted.
- No module takes a private name (``_x``) of another room: not by ``from ... import _x``,
  not from a private module (``nnscaler.a._b``), and not as an attribute of a module it
  imported (``files._write``).
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

import nnscaler

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport import-linter depends on there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def _layers() -> list[str]:
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["id"] == "layers"]
    names = []
    for row in contract["layers"]:
        names += [part.strip().strip("()") for part in row.split("|")]
    return names


def test_layer_contract_holds() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run(
        [str(lint), "--config", str(PYPROJECT), "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, (
        "an import points up the layers of docs/internals/layers.md (pyproject.toml [tool.importlinter]); "
        "move the function to the layer that owns it, or hand the object down as an "
        "argument:\n" + result.stdout[-4000:] + result.stderr[-2000:]
    )
    assert "1 kept, 0 broken" in result.stdout


def test_every_package_and_module_has_a_layer() -> None:
    listed = set(_layers())
    rooms = {m.name for m in pkgutil.iter_modules(nnscaler.__path__)}
    assert {"config", "gendir", "parallel"} <= rooms
    missing = sorted(rooms - listed)
    assert not missing, (
        f"nnscaler packages or modules {missing} are in no layer of the import contract; add "
        f"each to the row of pyproject.toml [tool.importlinter] 'layers' where it belongs"
    )


#: The plugin packages shipped under plugins/ (each a room of its own when installed).
PLUGIN_PACKAGES = tuple(sorted(p.name for p in (ROOT / "plugins").glob("*/nnscaler_*")
                               if (p / "__init__.py").is_file()))


def room(module: str, root: str = "nnscaler") -> str | None:
    """The room of a module: ``nnscaler.<child>`` for the kernel (the facade itself is
    aside: None), the top-level package for anything else."""
    parts = module.split(".")
    if parts[0] == root:
        return f"{root}.{parts[1]}" if len(parts) > 1 else None
    return parts[0]


def find_cycle(edges: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle of the directed graph ``edges`` (as a path that returns to its start), or
    None when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.mark.parametrize("edges, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"x": {"y"}, "y": {"y2"}, "y2": {"y"}}, ["y", "y2", "y"]),
])
def test_find_cycle(edges, cycle) -> None:
    assert find_cycle(edges) == cycle


def room_graph(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """``room -> rooms it imports``, over every module of ``graph``."""
    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        src = room(module)
        if src is None:
            continue
        edges.setdefault(src, set())
        for imported in graph.find_modules_directly_imported_by(module):
            dst = room(imported)
            if dst is not None and dst != src:
                edges[src].add(dst)
    return edges


def _installed_plugins() -> list[str]:
    import importlib.util

    return [p for p in PLUGIN_PACKAGES if importlib.util.find_spec(p) is not None]


def test_no_cycle_between_rooms_plugins_included() -> None:
    plugins = _installed_plugins()
    graph = grimp.build_graph("nnscaler", *plugins, exclude_type_checking_imports=True,
                              cache_dir=None)
    edges = room_graph(graph)
    assert {"nnscaler.config", "nnscaler.gendir", *plugins} <= set(edges)
    assert "nnscaler.anno" in edges["nnscaler.ops"]  # ops builds on anno
    for plugin in plugins:  # the graph is read: every plugin builds on the kernel
        assert any(r.startswith("nnscaler.") for r in edges[plugin]), plugin
    cycle = find_cycle(edges)
    assert cycle is None, f"rooms import each other: {' -> '.join(cycle)}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names_across_rooms(packages: Iterable[Path]) -> list[str]:
    """Where a module of one room takes a private name of another (see the module
    docstring), as ``file:line: what``. ``packages``: the package folders to scan (the
    kernel's ``nnscaler`` and plugin packages); imports of anything else are ignored."""
    packages = list(packages)
    tops = {p.name: p for p in packages}

    def exists(parts: list[str]) -> bool:
        base = tops.get(parts[0])
        if base is None or len(parts) == 1:
            return base is not None
        path = base.joinpath(*parts[1:])
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    found: list[str] = []
    for base in packages:
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base.parent).with_suffix("").parts)
            own = room(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
            tree = ast.parse(path.read_text())
            modules: dict[str, str | None] = {}  # local name -> room of the module it is
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    target = node.module.split(".")
                    if not exists(target[:1]):
                        continue
                    for alias in node.names:
                        full = [*target, alias.name]
                        where = room(".".join(full if exists(full) else target))
                        if where == own:
                            continue
                        if any(_private(x) for x in target[1:]) or _private(alias.name):
                            found.append(f"{path}:{node.lineno}: {node.module}.{alias.name}")
                        if exists(full):
                            modules[alias.asname or alias.name] = where
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        target = alias.name.split(".")
                        where = room(alias.name)
                        if not exists(target[:1]) or where == own:
                            continue
                        if any(_private(x) for x in target[1:]):
                            found.append(f"{path}:{node.lineno}: {alias.name}")
                        if alias.asname:
                            modules[alias.asname] = where
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in modules and _private(node.attr)):
                    found.append(f"{path}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_private_names_across_rooms_detector(tmp_path) -> None:
    pkg = tmp_path / "nnscaler"
    for folder in ("a", "b", "b/_impl"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "b" / "y.py").write_text("def _hidden(): pass\ndef shown(): pass\n")
    (pkg / "b" / "_impl" / "z.py").write_text("w = 1\n")
    (pkg / "a" / "x.py").write_text(
        "from nnscaler.b.y import _hidden, shown\n"      # a private name
        "from nnscaler.b._impl.z import w\n"             # from a private module
        "from nnscaler.b import y\n"
        "y._hidden()\n"                                 # through the module
        "import nnscaler.b._impl.z as zz\n")
    (pkg / "b" / "ok.py").write_text("from nnscaler.b.y import _hidden\n")  # its own room
    plugin = tmp_path / "nnscaler_plug"
    plugin.mkdir()
    (plugin / "__init__.py").write_text("from nnscaler.b import _impl\nfrom nnscaler.b import y\n")
    found = [f.replace(str(tmp_path), "") for f in private_names_across_rooms([pkg, plugin])]
    assert found == [
        "/nnscaler/a/x.py:1: nnscaler.b.y._hidden",
        "/nnscaler/a/x.py:2: nnscaler.b._impl.z.w",
        "/nnscaler/a/x.py:5: nnscaler.b._impl.z",
        "/nnscaler/a/x.py:4: y._hidden",
        "/nnscaler_plug/__init__.py:1: nnscaler.b._impl",
    ]


def test_no_private_name_taken_across_rooms() -> None:
    packages = [Path(nnscaler.__file__).parent]
    packages += [p for p in (ROOT / "plugins").glob("*/nnscaler_*") if p.name in PLUGIN_PACKAGES]
    found = private_names_across_rooms(packages)
    assert not found, (
        "private names taken from another room (make them public in their owner, or move "
        "them to the room that uses them): " + "; ".join(found)
    )
