"""Optimizer state moved from the per-rank files of one plan into the optimizer of
another plan, each rank reading only the slices of the state its own tensors need.

The saved optimizer state dicts (one per rank of plan A, files read memory-mapped, or
dicts) are seen as, for every original parameter and every elementwise state key
(Adam's ``exp_avg``, ``exp_avg_sq``, SGD's ``momentum_buffer``, ...), the pieces that hold
it: a parameter piece's state, or a member's range of a ZeRO shard (a member that spans
several shards is put together from them). Scalars (``step``) are one value per
parameter. An optimizer of plan B then gets, for each of its tensors (a parameter piece
or a ZeRO shard), the boxes of its pieces cut from those, one piece at a time; its
parameter groups take the saved hyperparameters as
[`load_merged_state_dicts`][nnscaler.load_merged_state_dicts] gives them. The result is
the one ``merge_state_dicts`` + ``load_merged_state_dicts`` give, without any process
holding the merged state.

`plan_optimizer` checks everything from the files' metadata (no value read);
`OptimizerPlan.local_state` then reads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nnscaler.checkpoint.errors import CheckpointError, OptimizerStateError
from nnscaler.checkpoint.merge import _ModuleView, _same_scalar, parallel_prefixes
from nnscaler.checkpoint.optimizer import (
    OPTIMIZER_KEY,
    is_scalar,
    optimizer_name,
    parallel_modules,
    unmergeable,
)
from nnscaler.checkpoint.optimizer_walk import SavedRanks, hyperparameters, local_groups
from nnscaler.checkpoint.pieces import REMAP_BYTES, Box, _as_box, _Entry, _load_mmap
from nnscaler.runtime.state import (
    EXTRA_KEY,
    describe_piece,
    is_extra_state,
    numel,
    sub_shape,
)

__all__ = ["OptimizerPlan", "OptimizerFilesSource", "plan_optimizer"]

WHAT = "load_resharded"


class _ParamStates:
    """The saved optimizer state of one original parameter: per elementwise key an
    `_Entry` of the pieces holding it, and the scalars."""

    def __init__(self, name: str, shape: Sequence[int]) -> None:
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.keys: list[Any] = []
        self.elementwise: dict[Any, _Entry] = {}
        self.scalars: dict[Any, tuple[Any, str]] = {}  # key -> (value, where)

    def add_key(self, key: Any) -> None:
        if key not in self.keys:
            self.keys.append(key)

    def add_piece(self, key: Any, rec: Mapping[str, Any], dtype: torch.dtype, holder: int,
                  ref: Any, opt: str) -> None:
        self.add_key(key)
        if tuple(rec["value"]) != (0, 1):
            raise OptimizerStateError(
                f"{WHAT}: {opt}'s state {key!r} of "
                f"{describe_piece(rec['name'], rec['shape'], rec['index'], rec['value'])} "
                f"belongs to a value part of a parameter, which cannot be resharded"
            )
        entry = self.elementwise.get(key)
        if entry is None:
            entry = self.elementwise[key] = _Entry([self.name], self.shape, dtype)
        entry.add(rec["index"], (0, 1), holder, ref)

    def add_scalar(self, key: Any, value: Any, where: str) -> None:
        self.add_key(key)
        if key in self.scalars and not _same_scalar(self.scalars[key][0], value):
            raise CheckpointError(
                f"{WHAT}: the optimizer state {key!r} of {self.name} is {self.scalars[key][0]} "
                f"in {self.scalars[key][1]} but {value} in {where}: the files were saved after "
                f"different steps; pass the files of every rank saved after the same step"
            )
        if key not in self.scalars:  # a copy: no reference to a file's memory map
            self.scalars[key] = (value.clone() if isinstance(value, torch.Tensor) else value,
                                 where)


def _metadata_only(sd: Mapping[str, Any]) -> dict[str, Any]:
    """The parallel modules' metadata of a module state dict, without its tensors (which
    would keep a file's memory map, and the pages read from it, alive)."""
    return {k: {f: x for f, x in v.items() if f not in ("nonpersistent", "unheld")}
            for k, v in sd.items() if k.endswith(EXTRA_KEY) and is_extra_state(v)}


class OptimizerFilesSource(SavedRanks):
    """Every rank's optimizer state dict of plan A (paths, memory-mapped, or dicts),
    described with the module files' metadata (``module_sds``, in the same rank order)."""

    def __init__(self, files: Sequence[str | os.PathLike[str] | Mapping[str, Any]],
                 module_sds: Sequence[Mapping[str, Any]]) -> None:
        if isinstance(files, (str, os.PathLike, Mapping)) or not files:
            raise CheckpointError(f"{WHAT}: optimizer_files must be a list with every rank's "
                                  f"optimizer state dict (file paths or dicts), got "
                                  f"{type(files).__name__}")
        if len(files) != len(module_sds):
            raise CheckpointError(
                f"{WHAT}: got {len(module_sds)} module files but {len(files)} optimizer "
                f"files; pass one optimizer state dict per rank of the saved plan, in the "
                f"same rank order as the module files"
            )
        self.where = [f"optimizer state dict {i}" if isinstance(f, Mapping) else repr(str(f))
                      for i, f in enumerate(files)]
        self.paths = [None if isinstance(f, Mapping) else Path(f) for f in files]
        self.osds = [f if isinstance(f, Mapping) else _load_mmap(Path(f)) for f in files]
        self.touched = [0] * len(files)
        module_sds = [_metadata_only(sd) for sd in module_sds]
        prefixes = parallel_prefixes(module_sds[0])
        if not prefixes:
            raise CheckpointError(f"{WHAT}: the module files hold no parallel module state, "
                                  f"so the optimizer state cannot be placed")
        super().__init__([_ModuleView(p, list(module_sds)) for p in prefixes])
        self.params: dict[str, _ParamStates] = {}
        self.opt_name: str | None = None  # the class the files name (tracked ones)
        self.opt_label = "the optimizer"
        for r, osd in enumerate(self.osds):
            try:
                self.add_rank(r, osd)
            except CheckpointError as e:  # say which file
                text = str(e).removeprefix(f"{WHAT}: ")
                if self.where[r] in text:
                    raise
                raise type(e)(f"{WHAT}: {self.where[r]}: {text}") from e
        self._add_zero_shards()

    # -- describing the saved state (metadata and scalars only) --------------------------
    what = WHAT
    given = "optimizer files"
    lead = f"{WHAT}: "

    def rank_name(self, r: int) -> str:
        return self.where[r]

    def _param(self, view: _ModuleView, rec: Mapping[str, Any]) -> _ParamStates:
        name = view.prefix + rec["name"]
        return self.params.setdefault(name, _ParamStates(name, rec["shape"]))

    def add_rank(self, r: int, osd: Mapping[str, Any]) -> str:
        meta = osd.get(OPTIMIZER_KEY)
        if isinstance(meta, Mapping) and meta.get("optimizer"):
            if self.opt_name is not None and self.opt_name != meta["optimizer"]:
                raise CheckpointError(f"{WHAT}: {self.where[r]} was saved by "
                                      f"{meta['optimizer']}, another rank's by {self.opt_name}")
            self.opt_name = str(meta["optimizer"])
        opt = super().add_rank(r, osd)
        self.opt_label = self.opt_name or opt
        return opt

    def on_piece(self, view: _ModuleView, rec: Mapping[str, Any], r: int, i: Any,
                 state: Mapping[Any, Any], opt: str) -> None:
        piece_shape = sub_shape(rec["index"])
        ps = self._param(view, rec)
        for key, value in state.items():
            if (isinstance(value, torch.Tensor) and tuple(value.shape) == piece_shape
                    and (value.dim() > 0 or len(piece_shape) == 0)):
                ps.add_piece(key, rec, value.dtype, r, ("param", i, key), opt)
            elif is_scalar(value):
                ps.add_scalar(key, value, self.where[r])
            else:
                raise unmergeable(opt, key, value, describe_piece(
                    rec["name"], rec["shape"], rec["index"]), piece_shape)

    def _add_zero_shards(self) -> None:
        """Each member of a saved ZeRO bucket becomes a piece of its parameter, read from
        the shards its range of the bucket spans."""
        opt = self.opt_label
        for bucket, view, shards in self.zero_buckets():
            r0, i0, desc0 = shards[0]
            state0 = self.osds[r0]["state"][i0]
            shard_numel = int(desc0["shard_numel"])
            flat = [k for k, v in state0.items() if isinstance(v, torch.Tensor)
                    and v.dim() == 1 and v.numel() == shard_numel]
            for attr, offset, count in desc0["members"]:
                rec = view.records[r0][attr]
                ps = self._param(view, rec)
                for key, value in state0.items():
                    if key in flat:
                        ps.add_piece(key, rec, value.dtype, r0,
                                     ("zero", bucket, int(offset), int(count), key,
                                      sub_shape(rec["index"])), opt)
                    elif is_scalar(value):
                        ps.add_scalar(key, value, self.where[r0])
                    else:
                        raise unmergeable(opt, key, value, describe_piece(
                            rec["name"], rec["shape"], rec["index"]), sub_shape(rec["index"]))

    # -- reading ----------------------------------------------------------------------------
    def _state_tensor(self, r: int, i: Any, key: Any) -> torch.Tensor:
        if sum(self.touched) > REMAP_BYTES:
            for k, path in enumerate(self.paths):
                if path is not None and self.touched[k]:
                    self.osds[k] = _load_mmap(path)  # the old map goes with its last reference
                    self.touched[k] = 0
        t = self.osds[r]["state"][i][key]
        if self.paths[r] is not None:
            self.touched[r] += t.nbytes
        return t

    def fetch(self, holder: int, ref: Any) -> torch.Tensor:
        """The values of one saved piece (its box's shape): a parameter piece's state, or a
        ZeRO member's range, put together from the shards it spans."""
        if ref[0] == "param":
            return self._state_tensor(holder, ref[1], ref[2])
        _, bucket, offset, count, key, shape = ref
        shards = self.zero[bucket]
        shard_numel = int(shards[0][2]["shard_numel"])
        parts = []
        for s in range(offset // shard_numel, (offset + count - 1) // shard_numel + 1):
            r, i, _ = shards[s]
            lo, hi = max(offset, s * shard_numel), min(offset + count, (s + 1) * shard_numel)
            parts.append(self._state_tensor(r, i, key)[lo - s * shard_numel: hi - s * shard_numel])
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(shape)

    def read_box(self, ps: _ParamStates, key: Any, box: Box) -> torch.Tensor:
        """The box of ``ps``'s state ``key``, put together one saved piece at a time."""
        return ps.elementwise[key].assemble(box, self.fetch, f"{WHAT} (optimizer state {key!r})")


class OptimizerPlan:
    """What this rank's optimizer takes: for each of its tensors, the saved parameters'
    states and the boxes to cut from them; checked, nothing read yet."""

    def __init__(self, source: OptimizerFilesSource, groups: list[dict[str, Any]],
                 tensors: list[tuple[int, Mapping[str, Any], list[tuple[_ParamStates, Box]]]]
                 ) -> None:
        self.source = source
        self.groups = groups
        self.tensors = tensors  # (state index, descriptor, [(saved state, box)] per member)

    def local_state(self) -> dict[str, Any]:
        """The optimizer state dict of this rank (reads the slices, one piece at a time)."""
        state: dict[int, dict[Any, Any]] = {}
        for index, desc, members in self.tensors:
            if desc["kind"] == "param":
                ps, box = members[0]
                state[index] = {k: self._value(ps, k, box) for k in ps.keys}
                continue
            shard_numel = int(desc["shard_numel"])
            lo = int(desc["shard_index"]) * shard_numel
            ps0 = members[0][0]
            out: dict[Any, Any] = {}
            for key in ps0.keys:
                if key not in ps0.elementwise:
                    out[key] = self._value(ps0, key, members[0][1])
                    continue
                flat = torch.zeros(shard_numel, dtype=ps0.elementwise[key].dtype)
                for (ps, box), (_, offset, count) in zip(members, desc["members"]):
                    a, b = max(lo, int(offset)), min(lo + shard_numel, int(offset) + int(count))
                    if a >= b:
                        continue
                    piece = self.source.read_box(ps, key, box).reshape(-1)
                    flat[a - lo: b - lo] = piece[a - int(offset): b - int(offset)]
                    del piece
                out[key] = flat
            state[index] = out
        return {"state": state, "param_groups": self.groups}

    def _value(self, ps: _ParamStates, key: Any, box: Box) -> Any:
        if key in ps.elementwise:
            return self.source.read_box(ps, key, box)
        value = ps.scalars[key][0]
        return value.clone() if isinstance(value, torch.Tensor) else value


def _check_type(source: OptimizerFilesSource, optimizer: torch.optim.Optimizer) -> None:
    mine = optimizer_name(optimizer)
    if source.opt_name is not None and source.opt_name != mine:
        raise CheckpointError(
            f"{WHAT}: the optimizer files were saved by {source.opt_name}, this optimizer is "
            f"{mine}; load them into an optimizer of the same class"
        )
    saved = {k for h in source.group_hyper.values() for k in h}
    have = {k for g in optimizer.param_groups for k in hyperparameters(g)}
    if source.group_hyper and saved != have:
        raise CheckpointError(
            f"{WHAT}: the optimizer files' parameter groups have the hyperparameters "
            f"{sorted(saved)}, {mine}'s have {sorted(have)}: they were saved by another "
            f"optimizer class; load them into an optimizer of the same class"
        )


# long: one pass over the groups' tensors; each check names the group and the tensor it reads
def plan_optimizer(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   source: OptimizerFilesSource) -> OptimizerPlan:
    """Check that ``source`` fills ``optimizer`` (built over ``module``'s parallel
    modules) and say which boxes each of its tensors takes; no value is read."""
    _check_type(source, optimizer)
    opt = optimizer_name(optimizer)

    def saved_group(names: list[str]) -> tuple[str, int | None]:
        name = next((n for n in names if n in source.group_of), names[0])
        return name, source.group_of.get(name, 0 if source.group_hyper else None)

    groups: list[dict[str, Any]] = []
    tensors: list[tuple[int, Mapping[str, Any], list[tuple[_ParamStates, Box]]]] = []
    index = 0
    for group, group_tensors, saved in local_groups(
            optimizer, parallel_modules(module), what=WHAT, opt=opt, saved_group=saved_group,
            same_hyper=lambda a, b: source.group_hyper.get(a) == source.group_hyper.get(b)):
        ids: list[int] = []
        for desc, members in group_tensors:
            found = [(name, meta, _saved_states(source, name, names, meta))
                     for name, names, meta in members]
            ids.append(index)
            if any(f[2] is not None for f in found):
                _check_covered(source, opt, found)
                tensors.append((index, desc, [(f[2], _as_box(f[1].index)) for f in found]))
            index += 1
        hyper = (source.group_hyper[saved] if saved is not None
                 and saved in source.group_hyper else hyperparameters(group))
        groups.append({**hyper, "params": ids})
    return OptimizerPlan(source, groups, tensors)


def _saved_states(source: OptimizerFilesSource, name: str, names: list[str],
                  meta: Any) -> _ParamStates | None:
    """The saved state of the parameter ``names`` name, checked to have its shape."""
    ps = next((source.params[n] for n in names if n in source.params), None)
    if ps is not None and ps.shape != tuple(meta.shape):
        raise CheckpointError(
            f"{WHAT}: the optimizer files hold the state of {name} with shape "
            f"{ps.shape}, but this model's has shape {tuple(meta.shape)}; the "
            f"files belong to another model"
        )
    return ps


def _check_covered(source: OptimizerFilesSource, opt: str,
                   found: list[tuple[str, Any, _ParamStates | None]]) -> None:
    """Every member of one tensor has saved state, with the same keys, covering its box."""
    with_state = [f for f in found if f[2] is not None]
    if len(with_state) != len(found):
        missing = next(f[0] for f in found if f[2] is None)
        raise CheckpointError(
            f"{WHAT}: the optimizer files hold state for {with_state[0][0]} but "
            f"none for {missing}, which {opt} updates as one ZeRO shard; the "
            f"optimizer files are incomplete"
        )
    keys = with_state[0][2].keys
    for name, meta, ps in found:
        box = _as_box(meta.index)
        if ps.keys != keys:
            raise CheckpointError(
                f"{WHAT}: the saved state of {name} has the keys {ps.keys}, that "
                f"of {found[0][0]} {keys}; {opt} updates them as one ZeRO shard")
        for key, e in ps.elementwise.items():
            have = e.covered(box)
            if have != numel(sub_shape(box)):
                raise CheckpointError(
                    f"{WHAT}: the optimizer files hold {have} of the "
                    f"{numel(sub_shape(box))} elements of the state {key!r} of "
                    f"{name}{list(box)} (shape {ps.shape}); pass the optimizer "
                    f"file of every rank of the saved plan"
                )
