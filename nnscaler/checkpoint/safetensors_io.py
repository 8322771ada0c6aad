"""Hugging Face Hub-format weight folders, read and written one tensor at a time.

A folder holds ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` with
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map":
{name: file}}``). A safetensors file is an 8-byte little-endian header length ``n``, a
JSON header of ``n`` bytes (``{name: {"dtype": "F32", "shape": [...], "data_offsets":
[begin, end]}, "__metadata__": {...}}``) and the tensors' bytes, row-major.

Reading uses positioned reads (``os.preadv``) straight into the destination tensor, in
row blocks of at most `BLOCK_BYTES`: a rank reads only the rows of its slice, and
neither the file nor a whole tensor is ever resident in the process (pages of a memory
map would count against the process's resident memory as they are touched; the page
cache does not). Writing streams each tensor's bytes after a header computed from the
shapes, so a shard never sits in memory either. Every file is checked when opened: a
header that does not parse, offsets that do not tile the data, or a file shorter than
its header says (truncated) is a [`CheckpointError`][nnscaler.errors.CheckpointError] naming the
file, the tensor and the sizes.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from nnscaler.errors import CheckpointError

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "HubFolder",
    "SafetensorsFile",
    "TensorSpec",
    "parse_size",
    "write_hub_folder",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BLOCK_BYTES = 16 << 20  # the most a read of rows outside the slice costs in memory
_MAX_HEADER = 100 << 20

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_CODES = {v: k for k, v in _DTYPES.items()}


@attrs.frozen(kw_only=True)
class TensorSpec:
    """One tensor of a folder: its shape and dtype, and where its bytes lie."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    path: Path
    offset: int  # of its first byte in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_code(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``'F32'`` (the safetensors name)."""
    code = _CODES.get(dtype)
    if code is None:
        raise CheckpointError(f"safetensors has no dtype for {dtype}; convert the tensor to one "
                              f"of {sorted(str(d) for d in _CODES)}")
    return code


# -- one file ----------------------------------------------------------------------------
class SafetensorsFile:
    """The header of one safetensors file, checked against the file's size."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.specs: dict[str, TensorSpec] = {}
        self.metadata: dict[str, str] = {}
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._bad(f"it has {size} bytes, fewer than the 8 of a header length")
                (n,) = struct.unpack("<Q", head)
                if n > min(size - 8, _MAX_HEADER):
                    raise self._bad(f"its header length says {n} bytes but the file has {size} "
                                    f"(truncated, or not a safetensors file)")
                header = json.loads(f.read(n))
        except OSError as e:
            raise CheckpointError(
                f"cannot read the safetensors file {str(self.path)!r}: {e}") from e
        except (ValueError, UnicodeDecodeError) as e:
            raise self._bad(f"its header is not JSON ({e})") from e
        if not isinstance(header, dict):
            raise self._bad("its header is not a JSON object")
        self._parse(header, 8 + n, size)

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{str(self.path)!r} is not a readable safetensors file: {why}. "
                               f"Copy the file again from its source")

    def _parse(self, header: dict[str, Any], start: int, size: int) -> None:
        entries = []
        for name, entry in header.items():
            if name == "__metadata__":
                self.metadata = dict(entry or {})
                continue
            try:
                dtype = _DTYPES[entry["dtype"]]
                shape = tuple(int(s) for s in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise self._bad(f"the header entry of {name!r} is {entry!r}") from e
            expected = math.prod(shape) * _itemsize(dtype)
            if end - begin != expected:
                raise self._bad(f"tensor {name!r} of shape {shape} ({entry['dtype']}) needs "
                                f"{expected} bytes, its offsets span {end - begin}")
            entries.append((begin, end, name, shape, dtype, entry["dtype"]))
        at = 0
        for begin, end, name, shape, dtype, code in sorted(entries):  # in the file's order
            if start + end > size:
                raise CheckpointError(
                    f"{str(self.path)!r} is truncated: tensor {name!r} (shape {shape}, "
                    f"{code}) ends at byte {start + end}, the file has {size} bytes. Copy the "
                    f"file again from its source"
                )
            if begin != at:
                raise self._bad(f"its tensors' offsets leave a gap or overlap at byte {at}")
            at = end
            self.specs[name] = TensorSpec(name=name, shape=shape, dtype=dtype, path=self.path,
                                          offset=start + begin)
        if start + at != size:
            raise self._bad(f"its header accounts for {start + at} bytes, the file has {size}")


def read_box(spec: TensorSpec, index: Sequence[Sequence[int]] | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The slice ``index`` (``[start, stop]`` per dim; None: all) of one stored tensor,
    read with positioned reads into ``out`` (a contiguous CPU tensor of the slice's shape
    and the stored dtype) or a new tensor; memory beyond it is at most one row block."""
    shape = spec.shape
    box = [(0, s) for s in shape] if index is None else [(int(a), int(b)) for a, b in index]
    if len(box) != len(shape) or any(not 0 <= a <= b <= s for (a, b), s in zip(box, shape)):
        raise CheckpointError(f"the slice {box} does not fit {spec.name!r} of shape {shape} in "
                              f"{str(spec.path)!r}")
    if out is None:
        out = torch.empty([b - a for a, b in box], dtype=spec.dtype)
    if out.numel() == 0:
        return out
    fd = os.open(spec.path, os.O_RDONLY)
    try:
        if not shape:
            _pread_into(fd, out, spec.offset, spec)
            return out
        row = math.prod(shape[1:]) * _itemsize(spec.dtype)
        a0, b0 = box[0]
        if all(box[d] == (0, shape[d]) for d in range(1, len(shape))):
            _pread_into(fd, out, spec.offset + a0 * row, spec)
            return out
        per = max(1, BLOCK_BYTES // max(row, 1))
        rest = tuple(slice(a, b) for a, b in box[1:])
        tmp = torch.empty((min(per, b0 - a0), *shape[1:]), dtype=spec.dtype)
        for i in range(a0, b0, per):
            k = min(per, b0 - i)
            _pread_into(fd, tmp[:k], spec.offset + i * row, spec)
            out[i - a0:i - a0 + k] = tmp[:k][(slice(None), *rest)]
        return out
    finally:
        os.close(fd)


def _pread_into(fd: int, t: torch.Tensor, offset: int, spec: TensorSpec) -> None:
    view = memoryview(t.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{str(spec.path)!r} ended while reading {spec.name!r} (byte "
                                  f"{offset + done}): the file was truncated after it was opened")
        done += n


# -- a folder ----------------------------------------------------------------------------
class HubFolder:
    """The tensors of a Hub-format folder (one file, or shards with their index), by name.
    Every file the index names is opened and checked here, so an error comes before any
    value is read."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.index: dict[str, str] | None = None
        if self.path.is_file() and self.path.suffix == ".safetensors":
            files = [self.path]
        elif (self.path / INDEX_FILE).is_file():
            files = self._indexed(self.path / INDEX_FILE)
        elif (self.path / SINGLE_FILE).is_file():
            files = [self.path / SINGLE_FILE]
        else:
            found = (sorted(p.name for p in self.path.iterdir())[:8] or "nothing"
                     if self.path.is_dir() else "nothing: no such folder")
            raise CheckpointError(
                f"{str(self.path)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE} (it holds "
                f"{found}); pass a folder written by save_pretrained with safe_serialization (the "
                f"default), or one safetensors file"
            )
        self.specs: dict[str, TensorSpec] = {}
        for f in files:
            for name, spec in SafetensorsFile(f).specs.items():
                if name in self.specs:
                    raise CheckpointError(f"tensor {name!r} is stored twice: in "
                                          f"{str(self.specs[name].path)!r} and {str(f)!r}")
                self.specs[name] = spec
        if self.index is not None:
            for name, file in self.index.items():
                spec = self.specs.get(name)
                if spec is None or spec.path.name != file:
                    raise CheckpointError(
                        f"{str(self.path / INDEX_FILE)!r} puts {name!r} in {file!r}, which "
                        f"does not hold it; the folder is incomplete or mixes two saves"
                    )

    def _indexed(self, index_path: Path) -> list[Path]:
        try:
            data = json.loads(index_path.read_text())
            weight_map = {str(k): str(v) for k, v in data["weight_map"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{str(index_path)!r} is not a safetensors index (a JSON "
                                  f"object with a weight_map): {e}") from e
        self.index = weight_map
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (self.path / n).is_file()]
        if missing:
            wanting = [k for k, v in weight_map.items() if v == missing[0]]
            raise CheckpointError(
                f"the shard file {str(self.path / missing[0])!r} is missing ({len(missing)} of "
                f"the {len(names)} files that {INDEX_FILE} names are); it holds "
                f"{len(wanting)} tensors, e.g. {wanting[0]!r}. Copy every shard of the folder"
            )
        return [self.path / n for n in names]


# -- writing -----------------------------------------------------------------------------
def parse_size(size: int | str) -> int:
    """``'2GB'`` -> 2e9 bytes, ``'500MiB'`` -> 500 * 2**20, an int as it is."""
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", str(size), re.IGNORECASE)
    if not match:
        raise CheckpointError(f"max_shard_size must be a positive number of bytes or a size "
                              f"like '5GB' or '500MiB', got {size!r}")
    number, unit, binary = match.groups()
    power = "KMGT".find(unit.upper()) + 1 if unit else 0
    return max(1, int(float(number) * (1024 if binary else 1000) ** power))


def shard_plan(specs: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
               max_bytes: int) -> list[list[int]]:
    """Indices of ``specs`` per shard, in order: a shard takes tensors until the next one
    would pass ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, dtype) in enumerate(specs):
        n = math.prod(shape) * _itemsize(dtype)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return shards


def _header(entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, shape, dtype in entries:
        n = math.prod(shape) * _itemsize(dtype)
        header[name] = {"dtype": dtype_code(dtype), "shape": list(shape),
                        "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_hub_folder(out_dir: str | os.PathLike[str],
                     specs: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                     tensor: Callable[[int], torch.Tensor | None], *, max_shard_size: int | str,
                     extra_files: Mapping[str, bytes] | None = None,
                     writer: bool = True) -> None:
    """Write ``specs`` (name, shape, dtype) as a Hub-format folder, asking ``tensor(i)``
    for each tensor's value in order. Written into a temporary folder beside ``out_dir``
    and renamed at the end (replacing a previous folder); a failure leaves nothing.

    ``writer=False`` only asks for the tensors (the ranks that send their pieces to the
    writing one call it the same way)."""
    plan = shard_plan(specs, parse_size(max_shard_size))
    if not writer:
        for shard in plan:
            for i in shard:
                tensor(i)
        return
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        names = ([SINGLE_FILE] if len(plan) == 1 else
                 [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))])
        weight_map: dict[str, str] = {}
        total = 0
        for file, shard in zip(names, plan):
            entries = [specs[i] for i in shard]
            with open(tmp / file, "wb") as f:
                f.write(_header(entries))
                for i in shard:
                    name, shape, dtype = specs[i]
                    t = tensor(i)
                    if t is None or tuple(t.shape) != tuple(shape):
                        raise CheckpointError(
                            f"internal error: tensor {name!r} came as "
                            f"{None if t is None else tuple(t.shape)}, expected {tuple(shape)}")
                    t = t.detach().to("cpu", dtype).contiguous()
                    f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
                    weight_map[name] = file
                    total += t.nbytes
                f.flush()
                os.fsync(f.fileno())
        if len(plan) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        if out.exists():
            old = out.parent / f".{out.name}.{os.getpid()}.old"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
