"""The layering of the package is a rule, not a drawing.

- The import-linter contract in ``pyproject.toml`` (the layer order of docs/internals/layers.md) holds:
  ``lint-imports`` passes.
- Every sub-package of ``nnscaler`` has a place in that contract.
- The import graph between the packages of ``nnscaler`` (the facade ``nnscaler/__init__``
  aside, which re-exports from all of them) has no cycle.
- No private name (``_x``) is imported from another package.
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


def test_every_package_has_a_layer() -> None:
    listed = set(_layers())
    packages = {m.name for m in pkgutil.iter_modules(nnscaler.__path__) if m.ispkg}
    missing = sorted(packages - listed)
    assert not missing, (
        f"nnscaler packages {missing} are in no layer of the import contract; add each to "
        f"the row of pyproject.toml [tool.importlinter] 'layers' where it belongs"
    )


def package_graph(graph: grimp.ImportGraph, root: str = "nnscaler") -> dict[str, set[str]]:
    """``package -> packages it imports`` between the direct children of ``root``."""
    def top(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[0] == root else None

    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        src = top(module)
        if src is None:
            continue
        edges.setdefault(src, set())
        for imported in graph.find_modules_directly_imported_by(module):
            dst = top(imported)
            if dst is not None and dst != src:
                edges[src].add(dst)
    return edges


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


def test_no_cycle_between_packages() -> None:
    graph = grimp.build_graph("nnscaler", exclude_type_checking_imports=True, cache_dir=None)
    edges = package_graph(graph)
    assert {"anno", "ops", "runtime", "checkpoint"} <= set(edges)
    assert "anno" in edges["ops"]  # the graph is read: ops builds on anno
    cycle = find_cycle(edges)
    assert cycle is None, f"packages import each other: {' -> '.join(cycle)}"


def private_imports_across_packages(root: Path) -> list[str]:
    """``from nnscaler.a.b import _name`` in a module outside package ``a`` (a private
    name taken across packages), as ``file:line: module._name``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        package = parts[1] if len(parts) > 2 else None
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.split(".")[0] == root.name):
                continue
            target = node.module.split(".")
            owner = target[1] if len(target) > 1 else None
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and owner != package:
                    found.append(f"{path}:{node.lineno}: {node.module}.{alias.name}")
    return found


def test_private_import_detector(tmp_path) -> None:
    pkg = tmp_path / "nnscaler"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    (pkg / "a" / "x.py").write_text("from nnscaler.b.y import _hidden, shown\n")
    (pkg / "b" / "z.py").write_text("from nnscaler.b.y import _hidden\n")  # same package
    assert private_imports_across_packages(pkg) == [f"{pkg / 'a' / 'x.py'}:1: nnscaler.b.y._hidden"]


def test_no_private_name_imported_across_packages() -> None:
    found = private_imports_across_packages(Path(nnscaler.__file__).parent)
    assert not found, (
        "private names imported from another package (make them public in their owner, or "
        "move them to the package that uses them): " + "; ".join(found)
    )
