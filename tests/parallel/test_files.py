"""The files under gen_savedir: layout, fingerprints, config.json, staging, graph pickles."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from nnscaler import ComputeConfig, gendir
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.parallel import fingerprint, graph_pickle, paths, staging
from nnscaler.trace import trace


class Tiny(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("scale", torch.ones(d), persistent=False)

    def forward(self, x):
        return self.fc(x) * self.scale


def test_outdir_layout(tmp_path):
    out = paths.outdir_for(tmp_path, Tiny, None)
    assert out == tmp_path.joinpath("_parallel_modules", *Tiny.__module__.split("."), "Tiny", "_")

    class Local(nn.Module):
        pass

    out = paths.outdir_for(tmp_path, Local, "tp2")
    assert out.name == "tp2" and out.parent.name == "Local"
    assert out.parent.parent.name == "_locals_"  # '<locals>' made safe
    for bad in ("", ".", "..", ".hidden", "a/b", 3):
        with pytest.raises(ValueError, match="instance_name"):
            paths.check_instance_name(bad)
    paths.check_instance_name("ok-name_1.2")


def test_check_writable(tmp_path):
    paths.check_writable(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").is_dir() and not os.listdir(tmp_path / "new" / "dir")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(paths.GenFilesError, match="cannot be created"):
        paths.check_writable(blocker / "sub")
    with pytest.raises(paths.GenFilesError, match="is not a directory"):
        paths.check_writable(blocker)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(paths.GenFilesError, match="not writable"):
            paths.check_writable(ro)


def test_fingerprints_and_diff():
    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=2)
    a = fingerprint.match_key(cfg, "dp", fingerprint.module_fingerprint(Tiny()),
                        fingerprint.inputs_fingerprint({"x": torch.randn(2, 4)}))
    b = fingerprint.match_key(cfg, "dp", fingerprint.module_fingerprint(Tiny()),
                        fingerprint.inputs_fingerprint({"x": torch.zeros(2, 4)}))
    assert a == b  # values do not matter, shapes do
    c = fingerprint.match_key(ComputeConfig(plan_ngpus=1, runtime_ngpus=4), "tp",
                        fingerprint.module_fingerprint(Tiny(8)),
                        fingerprint.inputs_fingerprint({"x": torch.randn(3, 8)}))
    lines = fingerprint.diff(a, c)
    text = "\n".join(lines)
    assert "compute_config.runtime_ngpus: saved 2, now 4" in text
    assert 'policy.name: saved "dp", now "tp"' in text
    assert "module.parameters[0]" in text and "inputs.x.tensor" in text
    assert fingerprint.diff(a, a) == []
    assert fingerprint.module_fingerprint(Tiny().eval())["training"] is False
    assert fingerprint.module_fingerprint(Tiny())["buffers"] == [["scale", [4], "torch.float32", False]]


def test_source_digest_follows_an_edited_class_file(tmp_path, monkeypatch):
    """A class's source is remembered only while its file is unchanged: an edit (another
    size or modification time) gives another digest, and the same file the same one."""
    import sys

    path = tmp_path / "edited_model.py"
    path.write_text("class Edited:\n    x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "edited_model", None)
    monkeypatch.delitem(sys.modules, "edited_model")  # removed again at teardown
    import edited_model

    first = fingerprint._source_digest([edited_model.Edited])
    assert fingerprint._source_digest([edited_model.Edited]) == first
    path.write_text("class Edited:\n    x = 22\n")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert fingerprint._source_digest([edited_model.Edited]) != first


def test_policy_identity_tracks_source():
    def pol(graph, cfg):
        return graph

    ident = fingerprint.policy_identity(pol)
    assert ident["callable"].endswith("test_policy_identity_tracks_source.<locals>.pol")
    assert "source_sha256" in ident
    assert fingerprint.policy_identity("tp") == {"name": "tp"}


def test_config_json_and_completeness(tmp_path):
    out = tmp_path / "out"
    assert gendir.read_config(out) is None
    with staging.staging_dir(out) as tmp:
        (tmp / "gencode0.py").write_text("x = 1\n")
        gendir.write_config(tmp, gendir.new_config(tmp, {"k": 1}, module_class="m.C",
                                                   instance_name=None, versions={}))
    data = gendir.read_config(out)
    assert data is not None and data["files"] == ["gencode0.py"] and data["match"] == {"k": 1}
    assert not staging.leftover_dirs(out)
    (out / "gencode0.py").unlink()
    assert gendir.read_config(out) is None  # a listed file is missing: incomplete


def test_staging_failure_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), staging.staging_dir(out) as tmp:
        (tmp / "gencode0.py").write_text("x = 1\n")
        raise RuntimeError("boom")
    assert not out.exists() and not staging.leftover_dirs(out)


def test_graph_pickle_round_trip(tmp_path):
    config = GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=8, seq_len=8)
    model = GPTWithLoss(config)
    batch = make_batch(config, batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, {"batch": batch})
    graph_pickle.save_graph(graph, tmp_path / "graph.pkl")
    again = graph_pickle.load_graph(tmp_path / "graph.pkl")
    assert str(again) == str(graph)
    assert [op.opdef is not None for op in again.ops] == [op.opdef is not None for op in graph.ops]
