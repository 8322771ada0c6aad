"""Full tensors read piece by piece from where they are stored, and written into the
pieces a parallel module holds, without ever putting the whole model in one process.

A *source* names full tensors (``prefix + original name``, as a merged state dict would)
and reads any box (``[start, stop]`` per dim) of one of them:

- `HubSource`: a Hub-format safetensors folder (`safetensors_io`);
- `RankFilesSource`: the per-rank (or deduped) state-dict files of a parallel module
  saved under some plan, memory-mapped; a box is put together from the pieces the files'
  metadata say cover it (replicas taken once, value parts summed);
- `nnscaler.checkpoint.module_source.ModuleSource`: a live parallel module on every
  rank (collective): rank 0 receives the pieces other ranks hold, one tensor at a time.

A ZeRO stage-3 piece is read from, and written into, the shards of several ranks
(`nnscaler.checkpoint.shards`): no unit is gathered.

`load_into` fills a module (a ParallelModule, or a model holding some) from a
source: every rank checks every name and shape first, the ranks agree, then each rank
reads only the boxes of its own pieces, one at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nnscaler.checkpoint.collective import agree, gather
from nnscaler.checkpoint.optimizer import parallel_modules
from nnscaler.checkpoint.safetensors_io import HubFolder, read_box
from nnscaler.checkpoint.shards import ShardCatalog, rank_state_dict, shard_job, shard_slice
from nnscaler.errors import CheckpointError
from nnscaler.gendir import FULLMODEL
from nnscaler.runtime.state import (
    EXTRA_KEY,
    check_format,
    in_state_dict,
    is_extra_state,
    numel,
    parse_dtype,
    plan_manifest,
    refresh_zero_shards,
    set_unheld_values,
    sub_shape,
    unheld_names,
)
from nnscaler.runtime.zero3_state import unit_places

__all__ = ["HubSource", "RankFilesSource", "load_into"]

Box = tuple[tuple[int, int], ...]


def _full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(s)) for s in shape)


def _as_box(index: Sequence[Sequence[int]]) -> Box:
    return tuple((int(a), int(b)) for a, b in index)


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) and out else out


def _rel(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


# -- sources -------------------------------------------------------------------------------
class HubSource:
    """The tensors of a Hub-format folder, by their names in the folder."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.folder = HubFolder(path)

    def names(self) -> list[str]:
        return list(self.folder.specs)

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype, str]:
        s = self.folder.specs[name]
        return s.shape, s.dtype, str(s.path)

    def read(self, name: str, index: Sequence[Sequence[int]] | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
        return read_box(self.folder.specs[name], index, out=out)


class _Entry:
    """One full tensor of a parallel-module checkpoint: its names, shape, dtype and the
    distinct pieces that hold it, ``(box, (part, nparts)) -> (holder, key)``."""

    def __init__(self, names: Sequence[str], shape: Sequence[int], dtype: torch.dtype) -> None:
        self.names = list(names)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.pieces: dict[tuple[Box, tuple[int, int]], tuple[int, str]] = {}

    def add(self, index: Sequence[Sequence[int]], value: Sequence[int], holder: int,
            key: str) -> None:
        self.pieces.setdefault((_as_box(index), (int(value[0]), int(value[1]))), (holder, key))

    def covered(self, box: Box) -> int:
        """How many elements of ``box`` complete pieces cover (every value part there)."""
        parts: dict[Box, set[tuple[int, int]]] = {}
        for index, value in self.pieces:
            parts.setdefault(index, set()).add(value)
        total = 0
        for index, values in parts.items():
            counts = {n for _, n in values}
            inter = _intersect(index, box)
            if inter is not None and len(counts) == 1 and {p for p, _ in values} == set(
                    range(next(iter(counts)))):
                total += numel(sub_shape(inter))
        return total

    def assemble(self, box: Box, fetch: Callable[[int, str], torch.Tensor | None],
                 where: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The box, put together in ``out`` (CPU, the box's shape and this dtype) or a new
        tensor; one piece is fetched at a time."""
        if self.covered(box) != numel(sub_shape(box)):
            raise CheckpointError(
                f"{where}: the files given hold {self.covered(box)} of the "
                f"{numel(sub_shape(box))} elements of {self.names[0]}{list(box)} (shape "
                f"{self.shape}); pass the file of every rank of the saved plan"
            )
        if out is None:
            out = torch.zeros(sub_shape(box), dtype=self.dtype)
        elif any(v[1] > 1 for _, v in self.pieces):
            out.zero_()  # value parts are summed into it
        for (index, value), (holder, key) in self.pieces.items():
            inter = _intersect(index, box)
            if inter is None:
                continue
            piece = fetch(holder, key)
            if piece is None:
                continue
            part = piece[_rel(inter, index)]
            if value[1] == 1:
                out[_rel(inter, box)] = part
            else:
                out[_rel(inter, box)] += part.to(out.device)
            del piece, part  # a memory-mapped piece's pages go with its last reference
        return out


class _Catalog:
    """Full tensors described by ParallelModule state dicts' metadata (and plain entries)."""

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self.alias: dict[str, str] = {}
        self.order: list[str] = []
        self.zero3 = ShardCatalog()

    def entry(self, names: Sequence[str], shape: Sequence[int], dtype: torch.dtype) -> _Entry:
        first = self.alias.get(names[0])
        if first is None:
            first = names[0]
            self.entries[first] = _Entry(names, shape, dtype)
            self.order.append(first)
            for n in names:
                self.alias[n] = first
        return self.entries[first]

    def add_state_dict(self, holder: int, sd: Mapping[str, Any], where: str) -> None:
        prefixes = [k[: -len(EXTRA_KEY)] for k, v in sd.items()
                    if k.endswith(EXTRA_KEY) and is_extra_state(v)]
        prefixes = [p for p in prefixes if p == "" or p.endswith(".")]
        for prefix in prefixes:
            extra = sd[prefix + EXTRA_KEY]
            check_format(extra, where)
            in_shards = self.zero3.add(holder, prefix, extra)  # ZeRO stage 3
            for e in extra.get("manifest") or ():  # the original module's order
                if e["kind"] == "parameter" or e["persistent"]:
                    self.entry([prefix + n for n in e["names"]], e["shape"],
                               parse_dtype(e["dtype"]))
            for rec in extra["attrs"]:
                if not in_state_dict(rec):
                    continue
                key = prefix + rec["attr"]
                if rec["attr"] in in_shards:
                    key = in_shards[rec["attr"]]
                elif key not in sd:
                    if extra.get("deduped"):
                        continue  # another rank's file keeps it
                    raise CheckpointError(f"{where} lacks {key!r}, which its own metadata "
                                          f"lists; the file was edited after it was saved")
                if rec.get("model_shape") is not None:  # held reshaped: the module's boxes
                    entry = self.entry([prefix + n for n in rec["names"]], rec["model_shape"],
                                       parse_dtype(rec["dtype"]))
                    boxes, d = model_boxes(rec["shape"], rec["model_shape"], rec["index"])
                    for j, box in enumerate(boxes):
                        entry.add(box, rec["value"], holder, f"{key}{_VIEW}{d}/{j}")
                    continue
                self.entry([prefix + n for n in rec["names"]], rec["shape"],
                           parse_dtype(rec["dtype"])).add(rec["index"], rec["value"], holder, key)
            for n, t in (extra.get("unheld") or {}).items():
                self.entry([prefix + n], t.shape, t.dtype).add(
                    _full_box(t.shape), (0, 1), holder, f"{prefix}{EXTRA_KEY}/unheld/{n}")
        for key, t in sd.items():
            owned = any(key.startswith(p) and "." not in key[len(p):] for p in prefixes)
            if not owned and isinstance(t, torch.Tensor) and not key.endswith(EXTRA_KEY):
                self.entry([key], t.shape, t.dtype).add(_full_box(t.shape), (0, 1), holder, key)

    def names(self) -> list[str]:
        return [n for first in self.order for n in self.entries[first].names]

    def check_complete(self, hint: str) -> None:
        """Every element of every tensor is held by some piece, else an error naming the
        first tensor that is not."""
        for first in self.order:
            e = self.entries[first]
            box = _full_box(e.shape)
            have = e.covered(box)
            if have != numel(e.shape):
                raise CheckpointError(
                    f"the state dicts given hold {have} of the {numel(e.shape)} elements of "
                    f"{first} (shape {e.shape}); {hint}"
                )


#: ``<key>/view/<d>/<j>``: index ``j`` of dim ``d`` of a piece held reshaped (`model_boxes`)
_VIEW = "/view/"


def model_boxes(shape: Sequence[int], model_shape: Sequence[int],
                index: Sequence[Sequence[int]]) -> tuple[list[Box], int]:
    """The boxes of a module's tensor (``model_shape``) that the box ``index`` of its
    reshaped view (``shape``: one dim ``d`` of ``model_shape`` split in two, as an expert
    ``gate_up_proj [E, 2F, H]`` held as ``[E, 2, F, H]``) covers: one per index of view dim
    ``d`` in the box, in order; and ``d``. Index ``j`` of dim ``d`` of the piece is box
    ``j``."""
    shape, model_shape = tuple(int(s) for s in shape), tuple(int(s) for s in model_shape)
    box = _as_box(index)
    for d in range(len(shape) - 1):
        if shape[:d] + (shape[d] * shape[d + 1],) + shape[d + 2:] == model_shape:
            n, (t0, t1), (f0, f1) = shape[d + 1], box[d], box[d + 1]
            return [box[:d] + ((t * n + f0, t * n + f1),) + box[d + 2:]
                    for t in range(t0, t1)], d
    raise CheckpointError(f"a piece of shape {shape} is recorded as a view of a tensor of shape "
                          f"{model_shape}, which does not split one of its dims in two; the "
                          f"state dict was edited after it was saved")


def zero3_piece(zero3: ShardCatalog, holder: int, key: str, shard: Any) -> torch.Tensor:
    """A stage-3 piece (a box of its view, for a ``<key>/view/<d>/<j>`` key) from the
    slices of its shards."""
    head, _, sel = key.partition(_VIEW)
    piece = zero3.read(holder, head, shard)
    if sel:
        d, j = (int(x) for x in sel.split("/"))
        piece = piece.select(d, j).contiguous()
    return piece


def _lookup(sd: Mapping[str, Any], key: str) -> torch.Tensor:
    if _VIEW in key:
        head, sel = key.split(_VIEW, 1)
        d, j = (int(x) for x in sel.split("/"))
        return _lookup(sd, head).select(d, j).contiguous()
    if f"{EXTRA_KEY}/unheld/" in key:
        head, name = key.split("/unheld/", 1)
        return sd[head]["unheld"][name]
    return sd[key]


REMAP_BYTES = 256 << 20


class RankFilesSource:
    """The per-rank (or deduped) state dicts of a parallel module, saved under any plan:
    file paths (read memory-mapped, so only the pieces asked for are read) or dicts.

    The pages of a memory map that a read touches count as the process's resident memory
    until the map goes: the files are mapped afresh once `REMAP_BYTES` were read from
    them, so reading a whole checkpoint never makes it resident."""

    def __init__(self, files: Sequence[str | os.PathLike[str] | Mapping[str, Any]]) -> None:
        if isinstance(files, (str, os.PathLike, Mapping)) or not files:
            raise CheckpointError(f"pass a list with every rank's state dict (file paths or "
                                  f"dicts), got {type(files).__name__}")
        self.where = [f"state dict {i}" if isinstance(f, Mapping) else repr(str(f))
                      for i, f in enumerate(files)]
        self.paths = [None if isinstance(f, Mapping) else Path(f) for f in files]
        self.sds = [f if isinstance(f, Mapping) else _load_mmap(Path(f)) for f in files]
        self.touched = [0] * len(self.sds)
        self.catalog = _Catalog()
        for i, sd in enumerate(self.sds):
            self.catalog.add_state_dict(i, sd, self.where[i])
        self.catalog.zero3.check(f"{len(self.sds)} files given")

    def names(self) -> list[str]:
        return self.catalog.names()

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype, str]:
        e = self.catalog.entries[self.catalog.alias[name]]
        files = sorted({self.where[h] for h, _ in e.pieces.values()})
        return e.shape, e.dtype, ", ".join(files)

    def read(self, name: str, index: Sequence[Sequence[int]] | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
        e = self.catalog.entries[self.catalog.alias[name]]
        box = _full_box(e.shape) if index is None else _as_box(index)
        return e.assemble(box, self._fetch, "reading the checkpoint", out)

    def _fetch(self, holder: int, key: str) -> torch.Tensor:
        if sum(self.touched) > REMAP_BYTES:
            for i, path in enumerate(self.paths):
                if path is not None and self.touched[i]:
                    self.sds[i] = _load_mmap(path)  # the old map goes with its last reference
                    self.touched[i] = 0
        if self.catalog.zero3.owns(key):
            return zero3_piece(self.catalog.zero3, holder, key, self._shard)
        t = _lookup(self.sds[holder], key)
        if self.paths[holder] is not None:
            self.touched[holder] += t.nbytes
        return t

    def _shard(self, holder: int, prefix: str, pos: int, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of a ZeRO-3 shard of file ``holder``: the ``pos``-th
        record of its ``zero3`` section of the module under ``prefix``."""
        t = shard_slice(self.sds[holder], prefix, pos, lo, hi)
        if self.paths[holder] is not None:
            self.touched[holder] += t.nbytes
        return t


def _load_mmap(path: Path) -> Mapping[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"the checkpoint file {str(path)!r} does not exist; pass the "
                              f"file of every rank of the saved plan")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file: say which
        raise CheckpointError(f"cannot read the checkpoint file {str(path)!r} "
                              f"({type(e).__name__}: {e}); it is truncated or not a state "
                              f"dict saved with torch.save") from e


# -- loading into a module -----------------------------------------------------------------
Job = Callable[[], None]


def _copy_job(target: torch.Tensor, source: Any, name: str, index: Box | None,
              zero: bool) -> Job:
    def run() -> None:
        if zero:  # a value part other than the first: the parts sum to the value
            target.zero_()
            return
        # straight into the piece when it can take the stored bytes: no second copy
        direct = (target.device.type == "cpu" and target.is_contiguous()
                  and target.dtype == source.spec(name)[1])
        value = source.read(name, index, out=target.data if direct else None)
        if not direct:
            target.copy_(value)
    return run


def _read_held(source: Any, name: str, meta: Any) -> torch.Tensor:
    """A piece as the module holds it (a box of its view when it is held reshaped)."""
    if meta.model_shape is None:
        return source.read(name, meta.index)
    held = torch.empty(meta.sub_shape, dtype=meta.dtype)
    _view_job(held, source, name, meta)()
    return held


def _check_spec(what: str, key: str, name: str, source: Any, shape: Sequence[int],
                dtype: torch.dtype) -> None:
    their_shape, their_dtype, where = source.spec(name)
    if tuple(their_shape) != tuple(shape):
        raise CheckpointError(
            f"{what}: {name!r} in {where} has shape {tuple(their_shape)}, but the model's "
            f"{key!r} has shape {tuple(shape)}; the weights belong to another model "
            f"configuration (check the config's sizes)"
        )
    if their_dtype != dtype and not (their_dtype.is_floating_point and dtype.is_floating_point):
        raise CheckpointError(
            f"{what}: {name!r} in {where} is {their_dtype}, but the model's {key!r} is "
            f"{dtype}; only floating-point tensors are converted on load"
        )


def load_into(module: torch.nn.Module, source: Any, to_source: Callable[[str], str | None],
              *, what: str, strict: bool = True) -> None:
    """Fill ``module`` from ``source`` (collective when torch.distributed is initialized).

    ``to_source`` maps a module name (``prefix + original name``) to the source's name
    (None: not in the source). Every name is checked before any value is read; with
    ``strict``, a source name that no module name maps to is an error too."""
    error: BaseException | None = None
    jobs: list[Job] = []
    consumed: set[str] = set()
    try:
        available = set(source.names())
        jobs = _plan(module, source, available, to_source, consumed, what)
    except CheckpointError as e:
        error = e
    agree(error, what)
    error = None
    try:
        wanted = gather(sorted(consumed))
        if strict:
            used = set().union(*wanted)
            extra = [n for n in source.names() if n not in used]
            if extra:
                _, _, where = source.spec(extra[0])
                raise CheckpointError(
                    f"{what}: {extra[0]!r} in {where} (shape {tuple(source.spec(extra[0])[0])}) "
                    f"matches no parameter or buffer of the model ({len(extra)} such names); "
                    f"the weights belong to another model, or pass strict=False to ignore them"
                )
    except CheckpointError as e:
        error = e
    agree(error, what)
    with torch.no_grad():  # ZeRO stage 3: each piece goes into the shard, nothing gathered
        for job in jobs:
            job()
    for _, pm in parallel_modules(module):
        refresh_zero_shards(pm)


def _plan(module: torch.nn.Module, source: Any, available: set[str],
          to_source: Callable[[str], str | None], consumed: set[str], what: str) -> list[Job]:
    pms = parallel_modules(module)
    jobs: list[Job] = []

    def find(key: str, names: Sequence[str]) -> str:
        mapped = [to_source(n) for n in names]
        present = [m for m in mapped if m is not None and m in available]
        if not present:
            raise CheckpointError(
                f"{what}: the model's {key!r} is not in the weights (looked for "
                f"{[m for m in mapped if m is not None] or 'no name'}); the weights belong to "
                f"another model, or name the model's prefix (prefix=...)"
            )
        consumed.update(present)
        return present[0]

    for key, value in rank_state_dict(module).items():  # what lies outside the parallel modules
        if any(key.startswith(p) and "." not in key[len(p):] for p, _ in pms):
            continue
        if not isinstance(value, torch.Tensor):
            continue
        name = find(key, [key])
        _check_spec(what, key, name, source, value.shape, value.dtype)
        jobs.append(_copy_job(_resolve(module, key), source, name, None, False))
    for prefix, pm in pms:
        manifest = plan_manifest(pm)
        places = unit_places(pm)
        for entry in manifest or ():  # every tensor of the original module, held here or not
            if entry["kind"] == "parameter" or entry["persistent"]:
                names = [prefix + n for n in entry["names"]]
                name = find(names[0], names)
                _check_spec(what, names[0], name, source, entry["shape"],
                            parse_dtype(entry["dtype"]))
        for attr, meta in pm.fullmap.items():
            if meta.kind == "constant" or (meta.kind == "buffer" and not meta.persistent):
                continue
            names = [prefix + n for n in meta.names]
            name = find(names[0], names)
            _check_spec(what, names[0], name, source, meta.model_shape or meta.shape,
                        meta.dtype)
            place = places.get(id(getattr(pm, attr)))
            if place is not None:  # in a stage-3 unit: this rank's part of its shard
                jobs.append(shard_job(place, meta, lambda n=name, m=meta: _read_held(source, n, m)))
            elif meta.model_shape is not None:  # held reshaped: cut its box from the view
                jobs.append(_view_job(getattr(pm, attr), source, name, meta))
            else:
                jobs.append(_copy_job(getattr(pm, attr), source, name, meta.index,
                                      meta.value[0] != 0))
        jobs += _plan_unheld(pm, prefix, manifest, source, find)
        jobs += _plan_nonpersistent(pm, what)
    return jobs


def _plan_unheld(pm: Any, prefix: str, manifest: Any, source: Any,
                 find: Callable[[str, Sequence[str]], str]) -> list[Job]:
    """The tensors no rank holds (the graph never reads them) keep the loaded values, so
    that a checkpoint or export of the module carries them."""
    names = unheld_names(manifest)
    if not names:
        return []
    found = {n: find(prefix + n, [prefix + n]) for n in names}
    return [lambda: set_unheld_values(pm, {n: source.read(s) for n, s in found.items()})]


def _plan_nonpersistent(pm: Any, what: str) -> list[Job]:
    """Non-persistent buffers and captured constants are in no checkpoint: they take the
    values ``fullmodel.pt`` recorded when the module was traced."""
    todo = [(a, m) for a, m in pm.fullmap.items()
            if m.kind == "constant" or (m.kind == "buffer" and not m.persistent)]
    if not todo:
        return []
    path = Path(pm.generated_dir()) / FULLMODEL
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - say which file
        raise CheckpointError(f"{what}: the non-persistent buffers and constants of "
                              f"{type(pm).__qualname__} come from {str(path)!r}, which cannot "
                              f"be read ({type(e).__name__}: {e})") from e
    jobs = []
    for attr, meta in todo:
        key = f"__constants__.{meta.orig_name}" if meta.kind == "constant" else meta.orig_name
        full = state.get(key)
        if full is None:
            full = next((state[n] for n in meta.names if n in state), None)
        if full is None or full.is_meta:
            raise CheckpointError(
                f"{what}: the non-persistent buffer {meta.orig_name!r} (shape {meta.shape}) is "
                f"in no checkpoint, and {str(path)!r} holds no value for it "
                f"({'meta tensor' if full is not None else 'absent'}): the model was built "
                f"with its buffers on the meta device. Build it with only its parameters on "
                f"the meta device (nnscaler.meta_parameters())"
            )
        jobs.append(_fill_job(getattr(pm, attr), full, meta))
    return jobs


def _fill_job(target: torch.Tensor, full: torch.Tensor, meta: Any) -> Job:
    def run() -> None:
        if meta.value[0] == 0:
            target.copy_(meta.take(full))
        else:
            target.zero_()
    return run


def _view_job(target: torch.Tensor, source: Any, name: str, meta: Any) -> Job:
    """A piece of a parameter held reshaped: its box of the view is one box of the
    module's tensor per index of the view's split dim, read one by one and stacked."""
    def run() -> None:
        if meta.value[0] != 0:
            target.zero_()
            return
        boxes, d = model_boxes(meta.shape, meta.model_shape, meta.index)
        target.copy_(torch.stack([source.read(name, b) for b in boxes], dim=d))
    return run


def _resolve(module: torch.nn.Module, key: str) -> torch.Tensor:
    owner, _, leaf = key.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf)
