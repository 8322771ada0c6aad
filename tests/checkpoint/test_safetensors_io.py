"""The Hub-format reader and writer (nnscaler.checkpoint.safetensors_io), against the
safetensors library itself: every slice read equals its slice, every folder written
loads, and every broken file is refused naming the file."""

from __future__ import annotations

import json
import os

import pytest
import torch

from nnscaler.checkpoint import safetensors_io as sio
from nnscaler.errors import CheckpointError

st = pytest.importorskip("safetensors.torch")

TENSORS = {
    "scalar": torch.tensor(3.5),
    "vec": torch.arange(10, dtype=torch.float32),
    "mat": torch.randn(12, 7, generator=torch.Generator().manual_seed(0)),
    "cube": torch.randn(5, 6, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    "ids": torch.arange(24, dtype=torch.int64).view(4, 6),
}


@pytest.fixture()
def file(tmp_path):
    path = tmp_path / "model.safetensors"
    st.save_file(TENSORS, path, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("block", [sio.BLOCK_BYTES, 8])  # 8 bytes: one row per read
def test_every_box_reads_its_slice(file, monkeypatch, block):
    monkeypatch.setattr(sio, "BLOCK_BYTES", block)
    specs = sio.SafetensorsFile(file).specs
    assert torch.equal(sio.read_box(specs["scalar"]), TENSORS["scalar"])
    g = torch.Generator().manual_seed(2)
    for name in ("vec", "mat", "cube", "ids"):
        t = TENSORS[name]
        for _ in range(12):
            box = []
            for s in t.shape:
                a = int(torch.randint(0, s, (), generator=g))
                b = int(torch.randint(a + 1, s + 1, (), generator=g))
                box.append((a, b))
            got = sio.read_box(specs[name], box)
            assert torch.equal(got, t[tuple(slice(a, b) for a, b in box)]), (name, box)
        assert torch.equal(sio.read_box(specs[name]), t)


def test_a_folder_written_in_shards_loads_with_safetensors(tmp_path):
    specs = [(k, tuple(v.shape), v.dtype) for k, v in TENSORS.items()]
    tensors = list(TENSORS.values())
    sio.write_hub_folder(tmp_path / "out", specs, lambda i: tensors[i], max_shard_size=100,
                         extra_files={"config.json": b"{}"})
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and "config.json" in files and sio.INDEX_FILE in files
    index = json.loads((tmp_path / "out" / sio.INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(TENSORS)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors)
    loaded = {}
    for shard in shards:
        loaded.update(st.load_file(tmp_path / "out" / shard))
    assert set(loaded) == set(TENSORS)
    for k, v in TENSORS.items():
        assert torch.equal(loaded[k], v), k
    folder = sio.HubFolder(tmp_path / "out")  # and our reader agrees
    assert torch.equal(sio.read_box(folder.specs["cube"]), TENSORS["cube"])


def test_one_shard_is_model_safetensors_without_index(tmp_path):
    sio.write_hub_folder(tmp_path / "out", [("w", (2, 3), torch.float32)],
                         lambda i: torch.ones(2, 3), max_shard_size="5GB")
    assert sorted(os.listdir(tmp_path / "out")) == [sio.SINGLE_FILE]
    assert torch.equal(st.load_file(tmp_path / "out" / sio.SINGLE_FILE)["w"], torch.ones(2, 3))


def test_a_failed_write_leaves_nothing_and_keeps_the_previous_folder(tmp_path):
    sio.write_hub_folder(tmp_path / "out", [("w", (2,), torch.float32)],
                         lambda i: torch.ones(2), max_shard_size=10)

    def fail(i):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        sio.write_hub_folder(tmp_path / "out", [("w", (2,), torch.float32)], fail,
                             max_shard_size=10)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert torch.equal(st.load_file(tmp_path / "out" / sio.SINGLE_FILE)["w"], torch.ones(2))


@pytest.mark.parametrize("size,expected", [(1000, 1000), ("5GB", 5 * 10**9),
                                           ("500MiB", 500 * 2**20), ("20KB", 20000)])
def test_shard_sizes(size, expected):
    assert sio.parse_size(size) == expected


@pytest.mark.parametrize("size", ["", "5 parsecs", -3, 0])
def test_a_bad_shard_size_is_refused(size):
    with pytest.raises(CheckpointError, match="max_shard_size"):
        sio.parse_size(size)


def test_broken_files_are_refused_naming_the_file(file, tmp_path):
    data = file.read_bytes()
    cases = {
        "short.safetensors": data[:5],
        "huge_header.safetensors": (10**9).to_bytes(8, "little") + data[8:],
        "not_json.safetensors": len(b"{nope").to_bytes(8, "little") + b"{nope",
        "truncated.safetensors": data[:-7],
        "padded.safetensors": data + b"\0" * 8,
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError) as info:
            sio.SafetensorsFile(tmp_path / name)
        assert name in str(info.value), (name, str(info.value))
    message = str(pytest.raises(CheckpointError, sio.SafetensorsFile,
                                tmp_path / "truncated.safetensors").value)
    assert "is truncated: tensor '" in message and f"has {len(data) - 7} bytes" in message


def test_a_folder_without_weights_says_what_it_holds(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        sio.HubFolder(tmp_path)
