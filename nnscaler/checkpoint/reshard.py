"""Reshard: cut a full state dict into the pieces of any plan, and load them (the
direction opposite to `nnscaler.checkpoint.merge`).

[`load_merged_state_dicts`][nnscaler.load_merged_state_dicts] takes the state dict of the original
module (its own, or one [`merge_state_dicts`][nnscaler.merge_state_dicts] made from the ranks'
pieces) and the full optimizer state, and gives each rank the pieces of its plan: every parameter
and buffer cut to the rank's box, the optimizer's elementwise state cut alike (ZeRO shards
rebuilt from the cut pieces), scalars copied. A key that does not fit is an error naming
it and both shapes, raised before anything is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nnscaler.checkpoint.errors import CheckpointError
from nnscaler.checkpoint.merge import owned_by
from nnscaler.checkpoint.optimizer import (
    is_scalar,
    optimizer_name,
    parallel_modules,
    unmergeable,
)
from nnscaler.checkpoint.optimizer_walk import hyperparameters, local_groups
from nnscaler.checkpoint.shards import rank_state_dict
from nnscaler.runtime.state import (
    EXTRA_KEY,
    FORMAT,
    MARKER,
    attr_record,
    is_extra_state,
    plan_info,
    unheld_names,
)

__all__ = ["load_merged_state_dict", "load_merged_state_dicts", "load_sharded_state_dict"]

_ANOTHER = ("the state dict belongs to another model or plan")


def _full_of(state: Mapping[str, Any], prefix: str, names: Sequence[str]) -> tuple[str, Any]:
    for n in names:
        if prefix + n in state:
            return prefix + n, state[prefix + n]
    return prefix + names[0], None


def _cut(full: torch.Tensor, meta: Any, device: torch.device | None) -> torch.Tensor:
    if meta.value[0] == 0:
        piece = meta.take(full)
    else:
        piece = torch.zeros(meta.sub_shape, dtype=full.dtype, device=full.device)
    return piece.to(device) if device is not None else piece


def _merged_fix(cls: str) -> str:
    return (f"Pass the state dict merged from {cls}'s own checkpoints (merge_state_dicts), "
            f"or the original module's state_dict().")


def load_merged_state_dicts(
    module: torch.nn.Module,
    module_state_dict: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state_dict: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device | None = None,
) -> None:
    """Load a full state dict (from [`merge_state_dicts`][nnscaler.merge_state_dicts], or the
    original module's own) into ``module``, a ParallelModule of any plan or a model holding some,
    and optionally the full optimizer state into ``optimizer`` (built over the module, e.g.
    by [`nnscaler.build_optimizer`][nnscaler.build_optimizer]).

    Every rank calls it with the same full state dicts and takes its own pieces. A key that
    does not fit (another model: a missing key or a different shape) is an error naming
    the first such key and both shapes. ``device``: where the pieces are cut (the module's
    tensors are updated in place wherever they live); None cuts them where the state dict
    lies.
    """
    _check_load_args(module, module_state_dict, optimizer, optimizer_state_dict)
    dev = torch.device(device) if device is not None else None
    pms = parallel_modules(module)
    if not pms:
        module.load_state_dict(module_state_dict)
        if optimizer is not None and optimizer_state_dict is not None:
            optimizer.load_state_dict(optimizer_state_dict)
        return
    local = _local_module_state(module, pms, module_state_dict, dev)
    local_opt = None
    if optimizer is not None and optimizer_state_dict is not None:
        local_opt = _local_optimizer_state(pms, optimizer, optimizer_state_dict, dev)
    # everything checked: load (a failure above changed nothing)
    module.load_state_dict(local, strict=True)
    if optimizer is not None and local_opt is not None:
        optimizer.load_state_dict(local_opt)


def _check_load_args(module: Any, module_state_dict: Any, optimizer: Any,
                     optimizer_state_dict: Any) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"load_merged_state_dicts takes the module first, got "
                        f"{type(module).__name__}")
    if not isinstance(module_state_dict, Mapping):
        raise TypeError(f"module_state_dict must be a state dict (a dict), got "
                        f"{type(module_state_dict).__name__}")
    if (optimizer is None) != (optimizer_state_dict is None):
        raise CheckpointError(
            "load_merged_state_dicts: pass both optimizer and optimizer_state_dict, or "
            "neither"
        )


def _local_module_state(module: torch.nn.Module, pms: list[tuple[str, Any]],
                        full: Mapping[str, Any], dev: torch.device | None) -> dict[str, Any]:
    """This rank's state dict of ``module``, cut from the full one; every key of ``full``
    is used and every key of the module found, else the first misfit is an error."""
    if any(is_extra_state(v) for k, v in full.items() if k.endswith(EXTRA_KEY)):
        raise CheckpointError(
            "load_merged_state_dicts takes a merged (full) state dict, but this one is a "
            "rank's own state dict (it carries parallel-module metadata); merge the ranks' "
            "state dicts with merge_state_dicts first, or load it with load_state_dict into "
            "the same plan"
        )
    local: dict[str, Any] = {}
    consumed: set[str] = set()
    cls = type(module).__qualname__
    for key, value in rank_state_dict(module).items():  # the keys outside the parallel modules
        if any(owned_by(p, key) for p, _ in pms):
            continue
        given = full.get(key)
        if given is None:
            raise _mismatch(cls, key, "absent", tuple(getattr(value, "shape", ())))
        if isinstance(value, torch.Tensor) and (not isinstance(given, torch.Tensor)
                                                or tuple(given.shape) != tuple(value.shape)):
            raise _mismatch(cls, key, tuple(getattr(given, "shape", ())), tuple(value.shape))
        local[key] = given
        consumed.add(key)
    open_prefixes = [prefix for prefix, pm in pms
                     if not _take_parallel_module(prefix, pm, full, dev, local, consumed)]
    unexpected = [k for k in full if k not in consumed]
    for prefix in open_prefixes:  # the plan's full list of names is unknown: keep the rest
        taken = {k: full[k] for k in unexpected if k.startswith(prefix)}
        if taken:
            local[prefix + EXTRA_KEY]["unheld"] = {k[len(prefix):]: v for k, v in taken.items()}
            unexpected = [k for k in unexpected if k not in taken]
    if unexpected:
        key = unexpected[0]
        raise _mismatch(cls, key, tuple(getattr(full[key], "shape", ())), "absent")
    return local


def _take_parallel_module(prefix: str, pm: Any, full: Mapping[str, Any],
                          dev: torch.device | None, local: dict[str, Any],
                          consumed: set[str]) -> bool:
    """Put the pieces and metadata of the parallel module ``pm`` (at ``prefix``) into
    ``local``, and the keys of ``full`` used into ``consumed``. False when the plan does
    not list the original module's names (the caller then keeps the rest as unheld)."""
    name = f"{type(pm).__qualname__} (rank {pm.rank})"
    info = plan_info(pm)
    for entry in info.manifest or ():  # the whole original module, held here or not
        if entry["kind"] == "buffer" and not entry["persistent"]:
            continue
        for n in entry["names"]:
            value = full.get(prefix + n)
            shape = tuple(getattr(value, "shape", ()))
            if value is None or shape != tuple(entry["shape"]):
                raise _mismatch(name, prefix + n, "absent" if value is None else shape,
                                entry["shape"])
            consumed.add(prefix + n)
    for attr, meta in pm.fullmap.items():
        if meta.kind == "constant" or (meta.kind == "buffer" and not meta.persistent):
            continue
        key, value = _full_of(full, prefix, meta.names)
        want = meta.model_shape or meta.shape  # a weight held reshaped: the module's shape
        if value is None:
            raise _mismatch(name, key, "absent", want)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) not in (
                tuple(meta.shape), want):
            raise _mismatch(name, key, tuple(getattr(value, "shape", ())), want)
        consumed.update(prefix + n for n in meta.names)
        local[prefix + attr] = _cut(value, meta, dev)
    extra: dict[str, Any] = {MARKER: FORMAT,
                             "attrs": [attr_record(a, m) for a, m in pm.fullmap.items()]}
    local[prefix + EXTRA_KEY] = extra
    names = unheld_names(info.manifest)
    if names is None:
        return False
    unheld = {}
    for n in names:
        value = full.get(prefix + n)
        if value is None:
            raise _mismatch(name, prefix + n, "absent", _manifest_shape(info.manifest, n))
        unheld[n] = value
        consumed.add(prefix + n)
    extra["unheld"] = unheld
    return True


def _manifest_shape(manifest: Any, name: str) -> tuple[int, ...]:
    for entry in manifest or ():
        if name in entry["names"]:
            return tuple(entry["shape"])
    return ()


def _mismatch(where: str, key: str, theirs: Any, mine: Any) -> CheckpointError:
    from nnscaler.checkpoint.errors import StateDictMismatchError

    their_text = "absent" if theirs == "absent" else f"shape {tuple(theirs)}"
    my_text = "absent" if mine == "absent" else f"shape {tuple(mine)}"
    return StateDictMismatchError(
        f"load_merged_state_dicts into {where}: {_ANOTHER}; the first mismatching key is "
        f"{key!r}: {their_text} in the state dict, {my_text} in the module. "
        f"{_merged_fix(where)}"
    )


def _full_optimizer_state(osd: Mapping[str, Any], pms: list[tuple[str, Any]]
                          ) -> tuple[dict[str, Any], dict[str, int]]:
    """``{parameter name: state}`` and ``{parameter name: group}`` of a full optimizer
    state dict (by its ``param_names``, or by the original parameter order)."""
    groups = osd.get("param_groups")
    if not isinstance(groups, list) or not isinstance(osd.get("state"), Mapping):
        raise CheckpointError("optimizer_state_dict is not an optimizer state dict (it needs "
                              "'state' and 'param_groups')")
    by_name: dict[str, Any] = {}
    group_of: dict[str, int] = {}
    if all("param_names" in g for g in groups):
        for g, group in enumerate(groups):
            for i, name in zip(group["params"], group["param_names"]):
                group_of[name] = g
                if i in osd["state"]:
                    by_name[name] = osd["state"][i]
        return by_name, group_of
    if len(groups) != 1:
        raise CheckpointError(
            f"optimizer_state_dict has {len(groups)} parameter groups without 'param_names', "
            f"so which parameter each entry is cannot be told; pass the optimizer state dict "
            f"of merge_state_dicts (it names them), or build the single-device optimizer "
            f"over named parameters (torch.optim.Adam(model.named_parameters()))"
        )
    order: list[str] = []
    for prefix, pm in pms:
        manifest = plan_info(pm).manifest
        if manifest is None:
            raise CheckpointError(
                "optimizer_state_dict has no 'param_names' and the module does not know the "
                "original parameter order (no config.json beside the generated code); pass "
                "the optimizer state dict of merge_state_dicts"
            )
        order += [prefix + e["names"][0] for e in manifest if e["kind"] == "parameter"
                  and e.get("requires_grad", True)]
    ids = groups[0]["params"]
    if len(ids) != len(order):
        raise CheckpointError(
            f"optimizer_state_dict has {len(ids)} parameters, the original module "
            f"{len(order)} that require grad; pass the state dict of an optimizer over "
            f"[p for p in model.parameters() if p.requires_grad], or of merge_state_dicts"
        )
    for i, name in zip(ids, order):
        group_of[name] = 0
        if i in osd["state"]:
            by_name[name] = osd["state"][i]
    return by_name, group_of


def _split_state(opt: str, name: str, meta: Any, state: Mapping[Any, Any],
                 device: torch.device | None, copy: bool = True
                 ) -> tuple[dict[Any, torch.Tensor], dict[Any, Any]]:
    """A full parameter's state as ``(elementwise pieces of meta's box, scalars)``;
    ``copy``: the pieces are copies (the optimizer updates its state in place, the
    caller's dict must not change), else views."""
    pieces: dict[Any, torch.Tensor] = {}
    scalars: dict[Any, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and tuple(value.shape) in (
                tuple(meta.shape), meta.model_shape) and (
                value.dim() > 0 or len(meta.shape) == 0):
            piece = meta.take(value)
            if device is not None:
                piece = piece.to(device, copy=copy)
            pieces[key] = piece.clone() if copy and device is None else piece
        elif is_scalar(value):
            scalars[key] = value.clone() if isinstance(value, torch.Tensor) else value
        else:
            raise unmergeable(opt, key, value, f"{name} {tuple(meta.shape)}", meta.shape)
    return pieces, scalars


def _local_optimizer_state(pms: list[tuple[str, Any]], optimizer: torch.optim.Optimizer,
                           osd: Mapping[str, Any], device: torch.device | None
                           ) -> dict[str, Any]:
    """``optimizer``'s state dict cut out of the full one ``osd``."""
    opt = optimizer_name(optimizer)
    by_name, group_of = _full_optimizer_state(osd, pms)
    saved_groups = osd["param_groups"]

    def saved_group(names: list[str]) -> tuple[str, int | None]:
        name = next((n for n in names if n in group_of), names[0])
        return name, group_of.get(name)

    local_state: dict[int, dict[Any, Any]] = {}
    local_groups_: list[dict[str, Any]] = []
    index = 0
    for group, tensors, source in local_groups(
            optimizer, pms, what="load_merged_state_dicts", opt=opt, saved_group=saved_group,
            same_hyper=lambda a, b: (hyperparameters(saved_groups[a])
                                     == hyperparameters(saved_groups[b]))):
        ids: list[int] = []
        for desc, members in tensors:
            states = [(name, meta, next((by_name[n] for n in names if n in by_name), None))
                      for name, names, meta in members]
            ids.append(index)
            local = _local_state(opt, desc, states, device)
            if local:
                local_state[index] = local
            index += 1
        hyper = hyperparameters(saved_groups[source] if source is not None else group)
        local_groups_.append({**hyper, "params": ids})
    return {"state": local_state, "param_groups": local_groups_}


def _local_state(opt: str, desc: Mapping[str, Any], states: list[tuple[str, Any, Any]],
                 device: torch.device | None) -> dict[Any, Any]:
    with_state = [s for s in states if s[2]]
    if not with_state:
        return {}
    if len(with_state) != len(states):
        missing = next(s[0] for s in states if not s[2])
        raise CheckpointError(
            f"load_merged_state_dicts: the optimizer state dict has state for "
            f"{with_state[0][0]} but none for {missing}, which {opt} updates as one ZeRO "
            f"shard; the optimizer state dict is incomplete"
        )
    if desc["kind"] == "param":
        name, meta, full = states[0]
        pieces, scalars = _split_state(opt, name, meta, full, device)
        return {k: pieces[k] if k in pieces else scalars[k] for k in full}
    nshards, shard_numel = int(desc["nshards"]), int(desc["shard_numel"])
    lo = int(desc["shard_index"]) * shard_numel
    out: dict[Any, Any] = {}
    split = [(name, meta, full, *_split_state(opt, name, meta, full, device, copy=False))
             for name, meta, full in states]
    keys = list(states[0][2])
    for key in keys:
        if key in split[0][3]:
            ref = split[0][3][key]
            flat = torch.zeros(nshards * shard_numel, dtype=ref.dtype, device=ref.device)
            for (_, meta, _, pieces, _), (_, offset, count) in zip(split, desc["members"]):
                if key not in pieces:
                    raise CheckpointError(f"load_merged_state_dicts: the optimizer state "
                                          f"{key!r} is missing for {meta.orig_name}")
                flat[int(offset): int(offset) + int(count)] = pieces[key].reshape(-1)
            out[key] = flat[lo: lo + shard_numel].clone()
        else:
            out[key] = split[0][4][key]
    return out


#: nnScaler's name (its package exports the singular): the same function.
load_merged_state_dict = load_merged_state_dicts


def load_sharded_state_dict(
    module: torch.nn.Module,
    module_state_dict: Mapping[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state_dict: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device | None = None,
) -> None:
    """nnScaler's ``load_sharded_state_dict``: load this rank's own state dicts (what
    ``module.state_dict()`` and ``optimizer.state_dict()`` returned on this rank, for the
    same plan and world size) into ``module`` and ``optimizer``. Either part may be None.

    ``device``: where the loaded tensors are moved first (None: where they lie; the
    module's tensors are updated in place wherever they live). A state dict of another
    plan or rank is refused by the module's own check; merge it and use
    `load_merged_state_dict` instead.
    """
    if not isinstance(module, torch.nn.Module):
        raise CheckpointError(f"load_sharded_state_dict loads into a torch.nn.Module, got "
                              f"{type(module).__name__}")
    if optimizer_state_dict is not None and optimizer is None:
        raise CheckpointError("load_sharded_state_dict got an optimizer_state_dict but no "
                              "optimizer to load it into; pass the optimizer as well")
    if module_state_dict is not None:
        if device is not None:
            module_state_dict = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                                 for k, v in module_state_dict.items()}
        module.load_state_dict(module_state_dict)
    if optimizer is not None and optimizer_state_dict is not None:
        optimizer.load_state_dict(dict(optimizer_state_dict))
