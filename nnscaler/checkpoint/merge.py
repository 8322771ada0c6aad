"""Merge per-rank state dicts into the original module's.

[`merge_state_dicts`][nnscaler.merge_state_dicts] puts every rank's pieces back together (replicas
once, value parts summed), restores tied names and the tensors no rank holds, and merges the
optimizer state of elementwise optimizers (Adam, AdamW, SGD with momentum, ...), ZeRO shards
included. The result is what the single-device model and optimizer load with their own
``load_state_dict``; the other direction, cutting such a full state dict into the pieces
of any plan, is `nnscaler.checkpoint.reshard`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nnscaler.checkpoint.errors import CheckpointError, OptimizerStateError
from nnscaler.checkpoint.optimizer import is_scalar, unmergeable
from nnscaler.checkpoint.optimizer_walk import SavedRanks
from nnscaler.checkpoint.shards import shard_pieces
from nnscaler.runtime.state import (
    EXTRA_KEY,
    check_format,
    describe_piece,
    in_state_dict,
    is_extra_state,
    numel,
    slicers,
    sub_shape,
    unheld_names,
)
from nnscaler.runtime.zero3_state import section_of, sharded_attrs

__all__ = ["merge_state_dicts", "owned_by", "parallel_prefixes"]


# -- reading per-rank state dicts ----------------------------------------------------------
def parallel_prefixes(state_dict: Mapping[str, Any]) -> list[str]:
    """The prefixes under which ``state_dict`` holds a ParallelModule (``''`` for a
    parallel module saved by itself), in order."""
    out = []
    for key, value in state_dict.items():
        if key.endswith(EXTRA_KEY) and is_extra_state(value):
            prefix = key[: -len(EXTRA_KEY)]
            if prefix == "" or prefix.endswith("."):
                out.append(prefix)
    return out


def owned_by(prefix: str, key: str) -> bool:
    """Whether ``key`` is an entry of the parallel module saved under ``prefix``."""
    return key.startswith(prefix) and "." not in key[len(prefix):]


def _as_list(value: Any, what: str) -> list[Any]:
    if isinstance(value, Mapping) or not isinstance(value, Sequence) or not value:
        raise CheckpointError(
            f"{what} must be a non-empty list with one state dict per rank, got "
            f"{type(value).__name__}"
        )
    for i, sd in enumerate(value):
        if not isinstance(sd, Mapping):
            raise CheckpointError(f"{what}[{i}] must be a state dict (a dict), got "
                                  f"{type(sd).__name__}")
    return list(value)


class _Pieces:
    """The distinct pieces of one full tensor, put back together (in ``model_shape``, the
    module's own, when the plan held it reshaped)."""

    def __init__(self, name: str, shape: Sequence[int],
                 model_shape: Sequence[int] | None = None) -> None:
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.model_shape = None if model_shape is None else tuple(int(s) for s in model_shape)
        self.parts: dict[tuple[tuple[tuple[int, int], ...], tuple[int, int]], torch.Tensor] = {}

    def add(self, index: Sequence[Sequence[int]], value: Sequence[int], t: torch.Tensor) -> None:
        key = (tuple((int(a), int(b)) for a, b in index), (int(value[0]), int(value[1])))
        if tuple(t.shape) != sub_shape(key[0]):
            raise CheckpointError(
                f"{describe_piece(self.name, self.shape, key[0], key[1])} should have shape "
                f"{sub_shape(key[0])}, but the state dict holds shape {tuple(t.shape)}; the "
                f"state dict was edited after it was saved"
            )
        self.parts.setdefault(key, t)

    def assemble(self, what: str, hint: str) -> torch.Tensor:
        first = next(iter(self.parts.values()))
        full = torch.zeros(self.shape, dtype=first.dtype, device=first.device)
        boxes: dict[tuple[tuple[int, int], ...], set[tuple[int, int]]] = {}
        with torch.no_grad():
            for (index, value), t in self.parts.items():
                sl = slicers(index)
                if value[1] == 1:
                    full[sl] = t.to(full.device)
                else:
                    full[sl] += t.to(full.device)
                boxes.setdefault(index, set()).add(value)
        covered = 0
        for index, values in boxes.items():
            nparts = {n for _, n in values}
            if len(nparts) == 1 and {p for p, _ in values} == set(range(next(iter(nparts)))):
                covered += numel(sub_shape(index))
        if covered != numel(self.shape):
            raise CheckpointError(
                f"{what}: the state dicts given hold {covered} of the {numel(self.shape)} "
                f"elements of {self.name} {self.shape}; {hint}"
            )
        return full if self.model_shape is None else full.reshape(self.model_shape)


class _ModuleView:
    """One parallel module (``prefix``) across the given ranks' state dicts."""

    def __init__(self, prefix: str, state_dicts: list[Mapping[str, Any]]) -> None:
        self.prefix = prefix
        self.state_dicts = state_dicts
        self.metas: list[Mapping[str, Any]] = []
        for i, sd in enumerate(state_dicts):
            meta = sd.get(prefix + EXTRA_KEY)
            if not is_extra_state(meta):
                raise CheckpointError(
                    f"state dict {i} has no parallel module under {prefix or '(the top)'!r} "
                    f"but state dict 0 has: the state dicts come from different models"
                )
            check_format(meta, f"state dict {i}")
            self.metas.append(meta)
        self.records = [{r["attr"]: r for r in m["attrs"]} for m in self.metas]
        self.manifest = next((m["manifest"] for m in self.metas if m.get("manifest")), None)
        self.unheld = next((m["unheld"] for m in self.metas if m.get("unheld") is not None),
                           None)
        ngpus = self.metas[0].get("runtime_ngpus")
        self.hint = (f"pass the state dicts of all {ngpus} ranks (a plan spreads its pieces "
                     f"over them), each saved after the same step")

    def merge(self) -> dict[str, torch.Tensor]:
        """``{original name: full tensor}`` with the module's prefix, in the original
        module's order when it is known."""
        pieces: dict[str, _Pieces] = {}
        names: dict[str, list[str]] = {}
        for _, rec, t in shard_pieces(self.metas, "merge_state_dicts"):
            pieces.setdefault(rec["name"], _Pieces(rec["name"], rec["shape"],
                                                   rec.get("model_shape"))).add(
                rec["index"], rec["value"], t)
            names.setdefault(rec["name"], list(rec["names"]))
        for i, (sd, meta) in enumerate(zip(self.state_dicts, self.metas)):
            deduped = bool(meta.get("deduped"))
            in_shards = sharded_attrs(section_of(meta))
            for rec in meta["attrs"]:
                if not in_state_dict(rec) or rec["attr"] in in_shards:
                    continue
                key = self.prefix + rec["attr"]
                t = sd.get(key)
                if t is None:
                    if deduped:
                        continue  # kept by another rank
                    raise CheckpointError(
                        f"state dict {i} lacks {key!r}, which its own metadata lists "
                        f"({describe_piece(rec['name'], rec['shape'], rec['index'])}); the "
                        f"state dict was edited after it was saved"
                    )
                pieces.setdefault(rec["name"], _Pieces(rec["name"], rec["shape"],
                                                       rec.get("model_shape"))).add(
                    rec["index"], rec["value"], t)
                names.setdefault(rec["name"], list(rec["names"]))
        full: dict[str, torch.Tensor] = {}
        for name, ps in pieces.items():
            tensor = ps.assemble("merge_state_dicts", self.hint)
            for n in names[name]:
                full[n] = tensor
        missing_unheld = unheld_names(self.manifest) if self.manifest else None
        if self.unheld is not None:
            for n, t in self.unheld.items():
                full.setdefault(n, t)
        elif missing_unheld:
            warnings.warn(
                f"merge_state_dicts: none of the state dicts carries the values of the "
                f"tensors no rank holds ({missing_unheld[:4]}...): they are missing from the "
                f"merged state dict. Save a state dict on rank 0, which reads them from "
                f"fullmodel.pt",
                stacklevel=3,
            )
        elif self.manifest is None:
            warnings.warn(
                "merge_state_dicts: the state dicts do not list the original module's "
                "parameters and buffers (no config.json beside the generated code), so "
                "parameters that no rank holds (unused by the traced graph) cannot be "
                "restored; parallelize the module with nnscaler.parallelize to record them",
                stacklevel=3,
            )
        out: dict[str, torch.Tensor] = {}
        if self.manifest is not None:
            for entry in self.manifest:
                if entry["kind"] == "buffer" and not entry["persistent"]:
                    continue
                for n in entry["names"]:
                    if n in full:
                        out[self.prefix + n] = full.pop(n)
        out.update((self.prefix + n, t) for n, t in full.items())
        return out

    def param_order(self) -> list[str]:
        """Original parameter names (first name of tied ones), in the original order."""
        if self.manifest is not None:
            return [e["names"][0] for e in self.manifest if e["kind"] == "parameter"]
        order: dict[str, None] = {}
        for meta in self.metas:
            for rec in meta["attrs"]:
                if rec["kind"] == "parameter":
                    order.setdefault(rec["name"], None)
        return list(order)

    def unheld_trainable(self) -> list[str]:
        if self.manifest is None:
            return []
        return [e["names"][0] for e in self.manifest if e["kind"] == "parameter"
                and e.get("held") is False and e.get("requires_grad")]


# -- merging optimizer state ---------------------------------------------------------------
def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a = a.item() if isinstance(a, torch.Tensor) else a
        b = b.item() if isinstance(b, torch.Tensor) else b
    return bool(a == b)


class _ParamState:
    """The optimizer state of one original parameter, gathered from its pieces."""

    def __init__(self, name: str, shape: Sequence[int],
                 model_shape: Sequence[int] | None = None) -> None:
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.model_shape = model_shape
        self.keys: list[Any] = []
        self.elementwise: dict[Any, _Pieces] = {}
        self.scalars: dict[Any, Any] = {}

    def add(self, opt: str, rec: Mapping[str, Any], state: Mapping[Any, Any],
            pieces_of: Mapping[Any, torch.Tensor] | None = None) -> None:
        """Add the state of the piece ``rec``: ``state`` per key (``pieces_of`` gives the
        piece's values of elementwise keys cut out of a ZeRO shard)."""
        piece_shape = sub_shape(rec["index"])
        for key, value in state.items():
            if key not in self.keys:
                self.keys.append(key)
            if pieces_of is not None and key in pieces_of:
                value = pieces_of[key]
            elementwise = (isinstance(value, torch.Tensor)
                           and tuple(value.shape) == piece_shape
                           and (value.dim() > 0 or len(piece_shape) == 0)
                           and (pieces_of is None or key in pieces_of))
            if elementwise:
                if tuple(rec["value"]) != (0, 1):
                    raise OptimizerStateError(
                        f"{opt}: the state {key!r} of "
                        f"{describe_piece(rec['name'], rec['shape'], rec['index'], rec['value'])}"
                        f" belongs to a value part of a parameter, which cannot be merged"
                    )
                self.elementwise.setdefault(
                    key, _Pieces(self.name, self.shape, self.model_shape)).add(
                    rec["index"], rec["value"], value)
            elif is_scalar(value):
                if key in self.scalars and not _same_scalar(self.scalars[key], value):
                    raise CheckpointError(
                        f"the optimizer state {key!r} of {self.name} differs between ranks "
                        f"({self.scalars[key]} and {value}): the state dicts were saved after "
                        f"different steps; save every rank after the same step"
                    )
                self.scalars.setdefault(key, value)
            else:
                raise unmergeable(opt, key, value, describe_piece(
                    rec["name"], rec["shape"], rec["index"]), piece_shape)

    def build(self, hint: str) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for key in self.keys:
            if key in self.elementwise:
                out[key] = self.elementwise[key].assemble(
                    f"merge_state_dicts (optimizer state {key!r})", hint)
            else:
                value = self.scalars[key]
                out[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return out


def merge_optimizer_state_dicts(views: list[_ModuleView], osds: list[Mapping[str, Any]]
                                ) -> dict[str, Any]:
    """The optimizer state dict of the original module, from every rank's (see
    [`merge_state_dicts`][nnscaler.merge_state_dicts])."""
    merge = _OptimizerMerge(views)
    for r, osd in enumerate(osds):
        merge.add_rank(r, osd)
    _add_zero_shards(merge)
    return _build_merged(merge, max(len(osd["param_groups"]) for osd in osds))


class _OptimizerMerge(SavedRanks):
    """The state of each original parameter, gathered rank by rank."""

    def __init__(self, views: list[_ModuleView]) -> None:
        super().__init__(views)
        self.params: dict[str, _ParamState] = {}
        self.osds: dict[int, Mapping[str, Any]] = {}
        self.opt_name = "the optimizer"

    def param_state(self, view: _ModuleView, rec: Mapping[str, Any]) -> _ParamState:
        name = view.prefix + rec["name"]
        return self.params.setdefault(name, _ParamState(name, rec["shape"],
                                                        rec.get("model_shape")))

    def on_piece(self, view: _ModuleView, rec: Mapping[str, Any], r: int, i: Any,
                 state: Mapping[Any, Any], opt: str) -> None:
        self.param_state(view, rec).add(opt, rec, state)

    def add_rank(self, r: int, osd: Mapping[str, Any]) -> str:
        self.osds[r] = osd
        self.opt_name = super().add_rank(r, osd)
        return self.opt_name


def _add_zero_shards(merge: _OptimizerMerge) -> None:
    """Join each reducer bucket's shards and cut them into its parameters' pieces."""
    for key, view, shards in merge.zero_buckets():
        nshards = key[3]
        r0, i0, desc0 = shards[0]
        state0 = merge.osds[r0]["state"][i0]
        flat: dict[Any, torch.Tensor] = {}
        for k, value in state0.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and \
                    value.numel() == int(desc0["shard_numel"]):
                flat[k] = torch.cat([merge.osds[shards[s][0]]["state"][shards[s][1]][k].reshape(-1)
                                     for s in range(nshards)])
        for attr, offset, count in desc0["members"]:
            rec = view.records[r0][attr]
            cut = {k: f[int(offset): int(offset) + int(count)].view(sub_shape(rec["index"]))
                   for k, f in flat.items()}
            merge.param_state(view, rec).add(merge.opt_name, rec, state0, pieces_of=cut)


def _build_merged(merge: _OptimizerMerge, ngroups: int) -> dict[str, Any]:
    """The merged state dict: groups in rank order, parameters in the module's order."""
    order: list[str] = []
    extra_trainable: set[str] = set()
    for view in merge.views:
        order += [view.prefix + n for n in view.param_order()]
        extra_trainable.update(view.prefix + n for n in view.unheld_trainable())
    order += [n for n in merge.group_of if n not in set(order)]
    names_by_group: list[list[str]] = [[] for _ in range(ngroups)]
    for name in order:
        if name in merge.group_of:
            names_by_group[merge.group_of[name]].append(name)
        elif name in extra_trainable:
            names_by_group[0].append(name)  # unused by the graph: no state, first group
    state_out: dict[int, dict[Any, Any]] = {}
    groups_out: list[dict[str, Any]] = []
    index = 0
    hint = merge.views[0].hint
    for g, names in enumerate(names_by_group):
        ids = []
        for name in names:
            ids.append(index)
            if name in merge.params:
                state_out[index] = merge.params[name].build(hint)
            index += 1
        groups_out.append({**merge.group_hyper.get(g, {}), "params": ids,
                           "param_names": names})
    return {"state": state_out, "param_groups": groups_out}


def merge_state_dicts(
    module_state_dicts: Sequence[Mapping[str, Any]],
    optimizer_state_dicts: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Merge the state dicts of every rank into the original module's state dict.

    ``module_state_dicts``: ``model.state_dict()`` of each rank (or the dicts of
    [`deduped_state_dict`][nnscaler.deduped_state_dict]), where ``model`` is a ParallelModule or
    holds some. ``optimizer_state_dicts``: ``optimizer.state_dict()`` of the same ranks, in the same
    order, or None.

    Returns ``(module_state_dict, optimizer_state_dict)``: the first is what the original
    single-device module loads with ``load_state_dict`` (every parameter and persistent
    buffer under each of its names, tied ones included, and the parameters the traced
    graph never used); the second (None without optimizer state dicts) is what an
    optimizer of the same class over the original module's parameters loads: its state
    keyed like torch's (``0, 1, ...`` in group order, each group's parameters in the
    module's order), each group with the hyperparameters the ranks used and
    ``param_names``. Parameters the graph never used are in the first group, without
    state. Tensors stay on the device they were loaded to.
    """
    sds = _as_list(module_state_dicts, "module_state_dicts")
    prefixes = parallel_prefixes(sds[0])
    if not prefixes:
        raise CheckpointError(
            "module_state_dicts[0] holds no parallel module state (no '_extra_state' written "
            "by a ParallelModule): pass the state_dict() of the modules nnscaler.parallelize "
            "made, one per rank"
        )
    for i, sd in enumerate(sds[1:], start=1):
        if parallel_prefixes(sd) != prefixes:
            raise CheckpointError(
                f"module_state_dicts[{i}] holds parallel modules under "
                f"{parallel_prefixes(sd)}, module_state_dicts[0] under {prefixes}: the state "
                f"dicts come from different models"
            )
    views = [_ModuleView(p, sds) for p in prefixes]
    merged: dict[str, Any] = {}
    rest = {k: v for k, v in sds[0].items() if not any(owned_by(p, k) for p in prefixes)}
    for view in views:
        merged.update(view.merge())
    merged.update(rest)
    if optimizer_state_dicts is None:
        return merged, None
    osds = _as_list(optimizer_state_dicts, "optimizer_state_dicts")
    if len(osds) != len(sds):
        raise CheckpointError(
            f"merge_state_dicts takes one optimizer state dict per module state dict, in the "
            f"same rank order; got {len(sds)} module and {len(osds)} optimizer state dicts"
        )
    return merged, merge_optimizer_state_dicts(views, osds)
