"""nnscaler.gendir: the generated folder's names, config.json schema and digests, declared
once (and nowhere else in the kernel)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import nnscaler
from nnscaler import gendir


def test_names():
    assert gendir.gencode_name(3) == "gencode3.py"
    assert gendir.is_gencode("gencode12.py")
    assert not any(gendir.is_gencode(n) for n in ("gencode.py", "gencodex.py", "gencode1.pyc",
                                                  "fullmodel.pt", "config.json"))


def _folder(tmp_path: Path) -> Path:
    (tmp_path / "gencode0.py").write_text("x = 0\n")
    (tmp_path / "gencode1.py").write_text("x = 1\n")
    (tmp_path / gendir.FULLMODEL).write_bytes(b"weights")
    match = {"module": {"parameters": [["w", [2], "torch.float32", True]], "buffers": []}}
    data = gendir.new_config(tmp_path, match, module_class="m.C", instance_name=None,
                             versions={"nnscaler": "0"}, extra={"note": 1})
    gendir.write_config(tmp_path, data)
    return tmp_path


def test_one_writer_one_reader(tmp_path):
    out = _folder(tmp_path)
    data = gendir.read_config(out)
    assert data is not None and data["format"] == gendir.FORMAT_VERSION
    assert data["files"] == ["fullmodel.pt", "gencode0.py", "gencode1.py"]
    assert data["sha256"]["gencode0.py"] == gendir.file_digest(out / "gencode0.py")
    assert data["note"] == 1 and data["versions"] == {"nnscaler": "0"}
    assert sorted(gendir.code_digests(data)) == ["gencode0.py", "gencode1.py"]
    assert gendir.saved_state_rows(data) == ([["w", [2], "torch.float32", True]], [])
    assert gendir.changed_files(out, data) == []
    assert not list(out.glob(".*.tmp"))  # written through a temporary name


def test_an_unfinished_folder_is_not_read_as_complete(tmp_path):
    out = _folder(tmp_path)
    (out / "gencode1.py").write_text("x = 2\n")
    assert gendir.changed_files(out, gendir.read_config(out)) == ["gencode1.py"]
    (out / "gencode1.py").unlink()
    assert gendir.read_config(out) is None  # a listed file is missing
    assert gendir.read_config(out, complete=False)["module_class"] == "m.C"
    (out / gendir.CONFIG_FILE).write_text(json.dumps({"format": 1}))
    assert gendir.read_config(out) is None
    assert gendir.saved_state_rows(gendir.read_config(out, complete=False)) is None
    (out / gendir.CONFIG_FILE).write_text("{not json")
    assert gendir.read_config(out, complete=False) is None


def _literals(path: Path) -> list[str]:
    """The folder's names written as literals in ``path`` (docstrings and messages aside)."""
    names = {gendir.FULLMODEL, gendir.CONFIG_FILE, gendir.GRAPH_FILE}
    tree = ast.parse(path.read_text())
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and node.value in names
                and id(node) not in parts):
            found.append(f"{path}:{node.lineno}: {node.value!r}")
        if (isinstance(node, ast.JoinedStr) and len(node.values) > 1
                and isinstance(node.values[0], ast.Constant)
                and str(node.values[0].value).startswith("gencode")):
            found.append(f"{path}:{node.lineno}: f'gencode{{...}}'")
    return found


#: Literals that name another folder's file: (path under nnscaler/, name) -> why.
OTHER_FOLDERS = {
    ("checkpoint/hub.py", "config.json"): "a Hugging Face Hub folder's model config",
}


def test_the_names_are_written_once():
    root = Path(nnscaler.__file__).parent
    found = [hit for p in sorted(root.rglob("*.py")) if p.name != "gendir.py"
             for hit in _literals(p)
             if (p.relative_to(root).as_posix(), hit.rsplit("'", 2)[-2]) not in OTHER_FOLDERS]
    assert not found, f"use nnscaler.gendir's names instead of literals: {found}"


@pytest.mark.parametrize("source, hits", [
    ('x = "config.json"\n', 1), ('x = f"gencode{r}.py"\n', 1),
    ('"""fullmodel.pt"""\n', 1), ('x = f"read {p} and fullmodel.pt"\n', 0),
])
def test_literal_detector(tmp_path, source, hits):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert len(_literals(path)) == hits
