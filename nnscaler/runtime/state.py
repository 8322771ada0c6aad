"""What a ``ParallelModule``'s state dict carries besides its tensors.

``ParallelModule.state_dict()`` holds this rank's pieces under their attribute names
(``fc1_weight``) and, under ``_extra_state`` (torch's key for
`torch.nn.Module.get_extra_state`), a plain dict that `module_extra_state`
builds and `load_module_extra_state` reads back:

- ``nnscaler_checkpoint``: the format version (`FORMAT`); it marks the dict;
- ``module_class``, ``rank``, ``plan_ngpus``, ``runtime_ngpus``: whose pieces these are;
- ``attrs``: one record per attribute (`attr_record`): kind, original name(s), full
  shape, the index range per dim it holds, the value part, dtype, holders, persistence;
- ``nonpersistent``: this rank's pieces of non-persistent buffers and captured constants
  (not in torch's state dict, but needed by a module built with ``init_params=False``);
- ``manifest``: every parameter and buffer of the original module, in its order, with
  kind, shape, dtype, ``requires_grad``/``persistent`` and whether the plan holds it (or
  None when the generated directory has no ``config.json`` to read it from);
- ``unheld``: the full values of the parameters and persistent buffers that no rank holds
  (the traced graph never reads them), by original name (None when unknown);
- ``optimizer``: a descriptor per tensor of ``parameters_for_optimizer()``, in order: a
  parameter piece (``{"kind": "param", "attr": ...}``) or a ZeRO shard of a reducer bucket
  (``{"kind": "zero", "reducer": ranks, "bucket": i, "shard_index", "nshards",
  "shard_numel", "members": [[attr, offset, numel], ...]}``).

Everything is built from ``dict``, ``list``, ``str``, ``int``, ``float``, ``bool``, None
and tensors, so ``torch.load(..., weights_only=True)`` reads it.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nnscaler import gendir
from nnscaler.errors import CheckpointError, StateDictMismatchError
from nnscaler.gendir import FULLMODEL, gencode_name
from nnscaler.runtime import zero3_state

if TYPE_CHECKING:
    from nnscaler.runtime.module import AttrMeta, ParallelModule

__all__ = [
    "EXTRA_KEY",
    "FORMAT",
    "MARKER",
    "attr_record",
    "check_module_state_dict",
    "describe_piece",
    "is_extra_state",
    "load_module_extra_state",
    "module_extra_state",
    "optimizer_descriptors",
    "piece_key",
    "plan_manifest",
    "refresh_zero_shards",
    "unheld_values",
]

FORMAT = 1
MARKER = "nnscaler_checkpoint"
EXTRA_KEY = "_extra_state"
_ADD_CALLS = ("add_param", "add_buffer", "add_constant")
_INFO_ATTR = "_nnscaler_checkpoint_info"
_UNHELD_ATTR = "_nnscaler_unheld"


# -- small helpers -----------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``'float32'``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"{name!r} is not a torch dtype name (e.g. 'float32')")
    return value


def is_extra_state(value: Any) -> bool:
    """Whether ``value`` is the ``_extra_state`` of a ParallelModule's state dict."""
    return isinstance(value, Mapping) and value.get(MARKER) is not None


def check_format(value: Mapping[str, Any], where: str) -> None:
    version = value.get(MARKER)
    if version != FORMAT:
        raise CheckpointError(
            f"{where} was written in checkpoint format {version!r}, this nnscaler reads "
            f"format {FORMAT}; load it with the nnscaler version that saved it and merge it "
            f"(merge_state_dicts) into a plain state dict, which every version loads"
        )


def slicers(index: Sequence[Sequence[int]]) -> tuple[slice, ...]:
    return tuple(slice(int(a), int(b)) for a, b in index)


def sub_shape(index: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(int(b) - int(a) for a, b in index)


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def describe_piece(name: str, shape: Sequence[int], index: Sequence[Sequence[int]],
                   value: Sequence[int] = (0, 1)) -> str:
    """``fc1.weight[0:6, 0:8] of (12, 8)`` (``, value part 1/2`` when split by value)."""
    box = ", ".join(f"{a}:{b}" for a, b in index)
    text = f"{name}[{box}] of {tuple(int(s) for s in shape)}"
    if tuple(value) != (0, 1):
        text += f", value part {value[0]}/{value[1]}"
    return text


def piece_key(record: Mapping[str, Any]) -> str:
    """A string naming one piece of an original tensor: ``fc1.weight[0:6,0:8]v0/1``."""
    box = ",".join(f"{a}:{b}" for a, b in record["index"])
    return f"{record['name']}[{box}]v{record['value'][0]}/{record['value'][1]}"


def attr_record(attr: str, meta: AttrMeta) -> dict[str, Any]:
    """The plain-data record of one attribute (see the module docstring)."""
    return {
        "attr": attr,
        "kind": meta.kind,
        "name": meta.orig_name,
        "names": list(meta.names),
        "shape": list(meta.shape),
        "index": [[a, b] for a, b in meta.index],
        "value": list(meta.value),
        "dtype": dtype_name(meta.dtype),
        "holders": list(meta.holders),
        "persistent": bool(meta.persistent),
        # a parameter held reshaped: checkpoints hold it in the module's own shape
        **({} if meta.model_shape is None else {"model_shape": list(meta.model_shape)}),
    }


def in_state_dict(record: Mapping[str, Any]) -> bool:
    """Parameters and persistent buffers: what torch's state dict holds."""
    return record["kind"] == "parameter" or (record["kind"] == "buffer" and record["persistent"])


def _same_piece(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    fields = ("kind", "name")
    if any(a[f] != b[f] for f in fields):
        return False
    return (tuple(a["shape"]) == tuple(b["shape"])
            and [tuple(r) for r in a["index"]] == [tuple(r) for r in b["index"]]
            and tuple(a["value"]) == tuple(b["value"]))


# -- what the plan holds: the generated files --------------------------------------------
class _PlanInfo:
    """What a module learns once from its generated directory (cached on the module)."""

    def __init__(self, module_class: str | None, manifest: list[dict[str, Any]] | None) -> None:
        self.module_class = module_class
        self.manifest = manifest


def _held_by_plan(gen_dir: Path, plan_ngpus: int) -> list[tuple[str, ...]] | None:
    """The name groups (tied names together) that the devices of one scale unit register,
    read from ``gencode{0..plan_ngpus-1}.py`` (their ``self.add_param('attr', 'name',
    names=(...), ...)`` calls); None when a file is missing or unreadable."""
    groups: list[tuple[str, ...]] = []
    for device in range(plan_ngpus):
        try:
            tree = ast.parse((gen_dir / gencode_name(device)).read_text())
        except (OSError, SyntaxError, ValueError):
            return None
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _ADD_CALLS and len(node.args) >= 2):
                continue
            try:
                name = ast.literal_eval(node.args[1])
                names = next((ast.literal_eval(k.value) for k in node.keywords
                              if k.arg == "names"), (name,))
            except ValueError:
                return None
            groups.append(tuple(str(n) for n in names))
    return groups


def _union(groups: Sequence[Sequence[str]]) -> dict[str, str]:
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for group in groups:
        first = find(group[0])
        for name in group[1:]:
            parent[find(name)] = first
    return {x: find(x) for x in parent}


def _shared_storage_groups(gen_dir: Path, names: set[str]) -> list[tuple[str, ...]]:
    """Names of ``fullmodel.pt`` that share storage (tied tensors), among ``names``."""
    if not names:
        return []
    try:
        state = torch.load(gen_dir / FULLMODEL, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - no weights here: no ties to find
        return []
    by_ptr: dict[tuple[int, int], list[str]] = {}
    for name in names:
        t = state.get(name)
        if isinstance(t, torch.Tensor) and not t.is_meta:  # meta: no storage to compare
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            by_ptr.setdefault(key, []).append(name)
    return [tuple(v) for v in by_ptr.values() if len(v) > 1]


def _build_manifest(pm: ParallelModule) -> _PlanInfo:
    gen_dir = Path(pm.generated_dir())
    config = gendir.read_config(gen_dir, complete=False)
    rows = None if config is None else gendir.saved_state_rows(config)
    if config is None or rows is None:
        return _PlanInfo(None, None)
    module_class = config.get("module_class")
    parameters, buffers = rows
    held_groups = _held_by_plan(gen_dir, int(pm.plan_ngpus))
    own_groups = [tuple(m.names) for m in pm.fullmap.values()]
    held: set[str] | None = None
    groups = list(own_groups)
    if held_groups is not None:
        held = {n for g in held_groups for n in g}
        groups += held_groups
    entries: list[dict[str, Any]] = []
    seen: set[str] = set()
    try:
        all_names = {str(row[0]) for rows in (parameters, buffers) for row in rows}
        groups += _shared_storage_groups(gen_dir, all_names - (held or set()))
        root = _union([g for g in groups if g])
        for kind, rows in (("parameter", parameters), ("buffer", buffers)):
            tied: dict[str, list[str]] = {}  # group root -> its names, in the module's order
            for row in rows:
                tied.setdefault(root.get(str(row[0]), str(row[0])), []).append(str(row[0]))
            for row in rows:
                name, shape, dtype, flag = str(row[0]), row[1], row[2], bool(row[3])
                if name in seen:
                    continue
                group = tied[root.get(name, name)]
                seen.update(group)
                entry: dict[str, Any] = {
                    "names": group, "kind": kind, "shape": [int(s) for s in shape],
                    "dtype": dtype_name(parse_dtype(dtype)),
                    "held": None if held is None else any(n in held for n in group),
                }
                if kind == "parameter":
                    entry["requires_grad"], entry["persistent"] = flag, True
                else:
                    entry["requires_grad"], entry["persistent"] = False, flag
                entries.append(entry)
    except (IndexError, TypeError, ValueError, CheckpointError):
        return _PlanInfo(module_class, None)
    # a stale config.json (another generation) must not describe this module
    by_name = {n: e for e in entries for n in e["names"]}
    for meta in pm.fullmap.values():
        if meta.kind == "constant":
            continue
        entry = by_name.get(meta.orig_name)
        if entry is None or tuple(entry["shape"]) != tuple(meta.model_shape or meta.shape):
            return _PlanInfo(module_class, None)
    return _PlanInfo(module_class, entries)


def plan_info(pm: ParallelModule) -> _PlanInfo:
    info = pm.__dict__.get(_INFO_ATTR)
    if info is None:
        info = _build_manifest(pm)
        pm.__dict__[_INFO_ATTR] = info
    return info


def plan_manifest(pm: ParallelModule) -> list[dict[str, Any]] | None:
    """Every parameter and buffer of the original module (see the module docstring), or
    None when the generated directory does not say."""
    return plan_info(pm).manifest


def unheld_names(manifest: Sequence[Mapping[str, Any]] | None) -> list[str] | None:
    """The state-dict names (parameters, persistent buffers) no rank of the plan holds."""
    if manifest is None or any(e.get("held") is None for e in manifest):
        return None
    return [n for e in manifest if not e["held"] and (e["kind"] == "parameter" or e["persistent"])
            for n in e["names"]]


def unheld_values(pm: ParallelModule) -> dict[str, torch.Tensor] | None:
    """The full values of what no rank holds, by original name: the values last loaded
    from a checkpoint, else the initial ones from ``fullmodel.pt``; None when unknown."""
    cached = pm.__dict__.get(_UNHELD_ATTR)
    if cached is not None:
        return cached
    names = unheld_names(plan_manifest(pm))
    if names is None:
        return None
    values: dict[str, torch.Tensor] = {}
    if names:
        path = Path(pm.generated_dir()) / FULLMODEL
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - weights not on this node: unknown here
            return None
        copies: dict[int, torch.Tensor] = {}
        for name in names:
            t = state.get(name)
            if not isinstance(t, torch.Tensor):
                return None
            key = id(t)
            if key not in copies:
                copies[key] = t.detach().clone()
            values[name] = copies[key]
    pm.__dict__[_UNHELD_ATTR] = values
    return values


def set_unheld_values(pm: ParallelModule, values: Mapping[str, torch.Tensor]) -> None:
    """Remember loaded values of what no rank holds (CPU copies; tied names stay tied)."""
    copies: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in values.items():
        if id(t) not in copies:
            copies[id(t)] = t.detach().to("cpu").clone()
        out[name] = copies[id(t)]
    pm.__dict__[_UNHELD_ATTR] = out


# -- the optimizer's view ----------------------------------------------------------------
def descriptor_map(pm: ParallelModule) -> dict[int, dict[str, Any]]:
    """``id(tensor) -> descriptor`` for every tensor of ``pm.parameters_for_optimizer()``."""
    attr_of = {id(getattr(pm, a)): a for a, m in pm.fullmap.items() if m.kind == "parameter"}
    out: dict[int, dict[str, Any]] = {}
    for reducer in pm.reducers:
        if not getattr(reducer, "zero", False):
            continue
        for bi, bucket in enumerate(reducer.buckets):
            if bucket.shard_param is None:
                continue
            out[id(bucket.shard_param)] = {
                "kind": "zero", "reducer": list(reducer.ranks), "bucket": bi,
                "shard_index": int(bucket.shard_index), "nshards": int(bucket.nshards),
                "shard_numel": int(bucket.shard_numel),
                "members": [[attr_of[id(p)], int(off), int(p.numel())]
                            for p, off in zip(bucket.params, bucket.offsets)],
            }
    for tid, attr in attr_of.items():
        out.setdefault(tid, {"kind": "param", "attr": attr})
    return out


def optimizer_descriptors(pm: ParallelModule) -> list[dict[str, Any]]:
    """A descriptor per tensor of ``pm.parameters_for_optimizer()``, in its order."""
    by_id = descriptor_map(pm)
    out = []
    for t in pm.parameters_for_optimizer():
        desc = by_id.get(id(t))
        if desc is None:
            raise CheckpointError(
                f"internal error: {type(pm).__qualname__}.parameters_for_optimizer() returned "
                f"a tensor of shape {tuple(t.shape)} that is neither a parameter piece nor a "
                f"ZeRO shard"
            )
        out.append(desc)
    return out


def optimizer_entry_id(prefix: str, desc: Mapping[str, Any],
                       records: Mapping[str, Mapping[str, Any]]) -> str:
    """A string naming the optimizer state of one descriptor, equal on every rank that
    holds the same state (replicas)."""
    if desc["kind"] == "zero":
        ranks = ",".join(str(r) for r in desc["reducer"])
        return f"OZ|{prefix}|{ranks}|{desc['bucket']}|{desc['shard_index']}/{desc['nshards']}"
    return f"OP|{prefix}|{piece_key(records[desc['attr']])}"


# -- state dict hooks (called by ParallelModule) -----------------------------------------
def module_extra_state(pm: ParallelModule) -> dict[str, Any]:
    """What ``pm.state_dict()`` stores under ``_extra_state`` (see the module docstring)."""
    info = plan_info(pm)
    nonpersistent = {
        attr: getattr(pm, attr).detach() for attr, m in pm.fullmap.items()
        if m.kind == "constant" or (m.kind == "buffer" and not m.persistent)
    }
    unheld = unheld_values(pm)
    out = {
        MARKER: FORMAT,
        "module_class": info.module_class,
        "rank": int(pm.rank),
        "plan_ngpus": int(pm.plan_ngpus),
        "runtime_ngpus": int(pm.runtime_ngpus),
        "attrs": [attr_record(a, m) for a, m in pm.fullmap.items()],
        "nonpersistent": nonpersistent,
        "manifest": info.manifest,
        "unheld": dict(unheld) if unheld is not None else None,
        "optimizer": optimizer_descriptors(pm),
    }
    if zero3_state.is_saving_shards(pm):
        out[zero3_state.SECTION] = zero3_state.shard_records(pm)
    return out


def load_module_extra_state(pm: ParallelModule, state: Any) -> None:
    """Restore what ``_extra_state`` carries: non-persistent buffers and constants, the
    values of unheld tensors, the manifest (the pieces were checked and copied before)."""
    name = type(pm).__qualname__
    if not is_extra_state(state):
        raise CheckpointError(
            f"{name}: the state dict's _extra_state is {type(state).__name__}, not the "
            f"metadata a ParallelModule's state_dict() writes; load a state dict saved from "
            f"this parallel module (or merge and use load_merged_state_dicts)"
        )
    check_format(state, f"{name}'s state dict")
    nonpersistent = state.get("nonpersistent") or {}
    with torch.no_grad():
        for attr, value in nonpersistent.items():
            meta = pm.fullmap.get(attr)
            target = getattr(pm, attr, None)
            if meta is None or not isinstance(target, torch.Tensor):
                raise StateDictMismatchError(
                    f"{name}: the state dict carries the non-persistent buffer {attr!r} "
                    f"(shape {tuple(value.shape)}), which this module does not have (absent); "
                    f"the state dict belongs to another model or plan"
                )
            if tuple(value.shape) != tuple(target.shape):
                raise StateDictMismatchError(
                    f"{name}: the first mismatching key is the non-persistent buffer {attr!r}: "
                    f"shape {tuple(value.shape)} in the state dict, {tuple(target.shape)} in "
                    f"this module; the state dict belongs to another model or plan"
                )
            target.copy_(value)
    unheld = state.get("unheld")
    if unheld is not None:
        set_unheld_values(pm, unheld)
    manifest = state.get("manifest")
    info = plan_info(pm)
    if info.manifest is None and manifest is not None:
        info.manifest = list(manifest)


def mismatch(where: str, key: str, theirs: str, their_shape: Any, mine: str, my_shape: Any,
             fix: str) -> StateDictMismatchError:
    return StateDictMismatchError(
        f"{where}: the state dict belongs to another model or plan; the first mismatching "
        f"key is {key!r}: the state dict holds {theirs} (shape {their_shape}), this module "
        f"holds {mine} (shape {my_shape}). {fix}"
    )


PER_RANK_FIX = ("Load each rank's own state dict into the module of the same plan and rank; "
                "to change the plan, merge the per-rank state dicts with "
                "nnscaler.merge_state_dicts and load the result with "
                "nnscaler.load_merged_state_dicts.")


def compare_records(pm: ParallelModule, records: Sequence[Mapping[str, Any]], prefix: str,
                    where: str, fix: str = PER_RANK_FIX) -> None:
    """Raise [`StateDictMismatchError`][nnscaler.errors.StateDictMismatchError] at the first
    attribute whose piece differs."""
    theirs = {r["attr"]: r for r in records}
    for attr, meta in pm.fullmap.items():
        mine = attr_record(attr, meta)
        other = theirs.get(attr)
        my_text = describe_piece(meta.orig_name, meta.shape, meta.index, meta.value)
        if other is None:
            raise mismatch(where, prefix + attr, "nothing under it", "absent", my_text,
                           meta.sub_shape, fix)
        if not _same_piece(mine, other):
            their_text = describe_piece(other["name"], other["shape"], other["index"],
                                        other["value"])
            raise mismatch(where, prefix + attr, f"{other['kind']} {their_text}",
                           sub_shape(other["index"]), f"{meta.kind} {my_text}",
                           meta.sub_shape, fix)
    for attr, other in theirs.items():
        if attr not in pm.fullmap:
            their_text = describe_piece(other["name"], other["shape"], other["index"],
                                        other["value"])
            raise mismatch(where, prefix + attr, f"{other['kind']} {their_text}",
                           sub_shape(other["index"]), "nothing under it", "absent", fix)


def check_module_state_dict(pm: ParallelModule, state_dict: Mapping[str, Any], prefix: str,
                            local_metadata: Mapping[str, Any]) -> None:
    """Before torch copies a per-rank state dict into ``pm``: the first key that does not
    fit (another model, plan or rank) is an error naming it and both shapes."""
    where = f"{type(pm).__qualname__} (rank {pm.rank}).load_state_dict"
    extra = state_dict.get(prefix + EXTRA_KEY)
    if is_extra_state(extra):
        check_format(extra, "the state dict")
        if extra.get("deduped"):
            raise CheckpointError(
                f"{where}: this is a deduped state dict (deduped_state_dict keeps each piece on "
                f"one rank only); load it with nnscaler.load_deduped_state_dict(module, "
                f"module_state_dict, ...) on every rank"
            )
        compare_records(pm, extra.get("attrs", []), prefix, where)
        if zero3_state.section_of(extra) is not None and pm._zero3 is None:
            raise CheckpointError(
                f"{where}: the state dict holds ZeRO stage-3 shards (this rank's part of each "
                f"gathering unit), and this module is not stage 3, so it has no shard to put "
                f"them in; load every rank's files with nnscaler.load_resharded(module, "
                f"files, ...), or merge them with nnscaler.merge_state_dicts"
            )
    for attr, meta in pm.fullmap.items():
        if meta.kind == "constant" or (meta.kind == "buffer" and not meta.persistent):
            continue
        key = prefix + attr
        value = state_dict.get(key)
        target = getattr(pm, attr)
        if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(target.shape):
            text = describe_piece(meta.orig_name, meta.shape, meta.index, meta.value)
            raise mismatch(where, key, "a tensor", tuple(value.shape), f"{meta.kind} {text}",
                           tuple(target.shape), PER_RANK_FIX)
    if local_metadata.get("assign_to_params_buffers") and any(
            getattr(r, "zero", False) for r in pm.reducers):
        raise CheckpointError(
            f"{where}: load_state_dict(assign=True) would replace the parameters, which with "
            f"ZeRO are views of the reducer's flat buffers; load with assign=False"
        )


def refresh_zero_shards(pm: ParallelModule) -> None:
    """After the parameters changed in place: copy them into the ZeRO shards (the fp32
    tensors the optimizer updates)."""
    for reducer in pm.reducers:
        reducer.refresh_shards()
