"""Deduped checkpoints: every distinct piece saved once across the ranks.

In parallel training most pieces are held by several ranks (data-parallel replicas,
replicated weights inside a scale unit, ZeRO shards replicated across ZeRO groups), with
equal values. [`deduped_state_dict`][nnscaler.deduped_state_dict] keeps each piece (and each piece's
optimizer state) on the lowest rank that holds it;
[`load_deduped_state_dict`][nnscaler.load_deduped_state_dict] sends every rank the pieces it lacks
from the rank that kept them. Both are collective: every rank calls them.

Pieces are named by strings equal on every rank that holds the same values:

- ``M|prefix|fc1.weight[0:6,0:8]v0/1``: a piece of a parameter or persistent buffer;
- ``N|prefix|...``: a piece of a non-persistent buffer or captured constant;
- ``U|prefix|name``: a tensor no rank holds (the traced graph never reads it);
- ``K|key``: a state dict entry outside every parallel module;
- ``Z|prefix|ranks|bucket|i/n``: a ZeRO stage-3 shard of a gathering unit (the rank
  saves shards, not gathered pieces: `nnscaler.runtime.zero3_state`);
- ``O|OP|i|...`` / ``O|OZ|i|...``: the optimizer state of a parameter piece / a ZeRO shard
  (``i``: the parallel module's index in the model).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.checkpoint.collective import agree, comm_device, gather, world
from nnscaler.checkpoint.errors import CheckpointError
from nnscaler.checkpoint.merge import owned_by
from nnscaler.checkpoint.optimizer import (
    OPTIMIZER_KEY,
    check_optimizer_metadata,
    optimizer_metadata,
    optimizer_name,
    parallel_modules,
)
from nnscaler.checkpoint.shards import rank_state_dict
from nnscaler.runtime.state import (
    EXTRA_KEY,
    check_format,
    compare_records,
    dtype_name,
    in_state_dict,
    is_extra_state,
    numel,
    parse_dtype,
    piece_key,
)
from nnscaler.runtime.zero3_state import SECTION, section_of, sharded_attrs

__all__ = ["deduped_state_dict", "load_deduped_state_dict"]

_DEDUP_FIX = ("Load the deduped state dicts of this model and plan, each rank its own (every "
              "rank calls load_deduped_state_dict); to change the plan, merge them with "
              "nnscaler.merge_state_dicts and load with nnscaler.load_merged_state_dicts.")


def _compact(t: Any) -> Any:
    """A view into a larger storage (ZeRO flat buffers) as its own tensor, so that saving
    it does not write the whole storage."""
    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.nbytes:
        return t.detach().clone()
    return t


def _with_metadata(pms: list[tuple[str, Any]], optimizer: torch.optim.Optimizer
                   ) -> dict[str, Any]:
    osd = optimizer.state_dict()
    osd[OPTIMIZER_KEY] = optimizer_metadata([pm for _, pm in pms], optimizer)
    return osd


def _shard_ident(prefix: str, shard: Mapping[str, Any]) -> str:
    ranks = ",".join(str(r) for r in shard["reducer"])
    return f"Z|{prefix}|{ranks}|{shard['bucket']}|{shard['shard_index']}/{shard['nshards']}"


def _optimizer_ids(osd: Mapping[str, Any]) -> list[tuple[Any, str | None]]:
    """``(state index, entry id or None)`` in the optimizer's order."""
    indices = [i for g in osd["param_groups"] for i in g["params"]]
    params = osd[OPTIMIZER_KEY]["params"]
    return [(i, None if p is None else f"O|{p[2]}") for i, p in zip(indices, params)]


def deduped_state_dict(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """This rank's state dicts with every piece that a lower rank also holds left out
    (collective: every rank calls it, then saves what it returns).

    Returns ``(module_state_dict, optimizer_state_dict)``; the second is None without an
    optimizer. Summed over the ranks they hold each distinct piece once, so they are
    smaller than the per-rank state dicts by the replication factor. Restore with
    [`load_deduped_state_dict`][nnscaler.load_deduped_state_dict], or merge them with
    [`merge_state_dicts`][nnscaler.merge_state_dicts].
    """
    pms = parallel_modules(module)
    if not pms:
        raise CheckpointError(
            f"deduped_state_dict: {type(module).__qualname__} holds no ParallelModule; save "
            f"its state_dict() as it is"
        )
    sd = rank_state_dict(module)  # ZeRO stage 3: this rank's shards, nothing gathered
    osd = _with_metadata(pms, optimizer) if optimizer is not None else None
    removers: dict[str, Callable[[], Any]] = {}
    extras = []
    for prefix, _ in pms:
        extra = dict(sd[prefix + EXTRA_KEY])
        sd[prefix + EXTRA_KEY] = extra
        extras.append(extra)
        nonpersistent = dict(extra.get("nonpersistent") or {})
        extra["nonpersistent"] = nonpersistent
        section = section_of(extra) or []
        for shard in section:
            removers[_shard_ident(prefix, shard)] = lambda d=shard: d.__setitem__("shard", None)
        in_shards = sharded_attrs(section)
        for rec in extra["attrs"]:
            ident = f"{prefix}|{piece_key(rec)}"
            if rec["attr"] in in_shards:
                continue  # its values are in the shards
            if in_state_dict(rec):
                removers[f"M|{ident}"] = lambda k=prefix + rec["attr"]: sd.pop(k, None)
            elif rec["attr"] in nonpersistent:
                removers[f"N|{ident}"] = lambda a=rec["attr"], d=nonpersistent: d.pop(a, None)
        if extra.get("unheld") is not None:
            removers[f"U|{prefix}"] = lambda e=extra: e.__setitem__("unheld", None)
    for key in list(sd):
        if isinstance(sd[key], torch.Tensor) and not any(owned_by(p, key) for p, _ in pms):
            removers[f"K|{key}"] = lambda k=key: sd.pop(k, None)
    if osd is not None:
        state = osd["state"]
        for i, ident in _optimizer_ids(osd):
            if ident is not None:  # a tensor of no parallel module: kept on every rank
                removers[ident] = lambda i=i: state.pop(i, None)
    held = gather(sorted(removers))
    owner: dict[str, int] = {}
    for r, idents in enumerate(held):
        for ident in idents:
            owner.setdefault(ident, r)
    _, rank, _ = world()
    for ident, remove in removers.items():
        if owner[ident] != rank:
            remove()
    for extra in extras:
        extra["deduped"] = True
        extra["nonpersistent"] = {k: _compact(v) for k, v in extra["nonpersistent"].items()}
    for key in list(sd):
        sd[key] = _compact(sd[key])
    if osd is not None:
        osd[OPTIMIZER_KEY]["deduped"] = True
    return sd, osd


# -- loading -------------------------------------------------------------------------------
def _spec(t: torch.Tensor) -> tuple[list[int], str]:
    return [int(s) for s in t.shape], dtype_name(t.dtype)



def _exchange(plan: list[tuple[int, int, str]], have: Mapping[str, torch.Tensor],
              specs: Mapping[str, tuple[list[int], str]]) -> dict[str, torch.Tensor]:
    """Point-to-point: for each ``(src, dst, id)`` the source sends its tensor ``id``
    (as raw bytes); returns what this rank received."""
    distributed, rank, _ = world()
    if not distributed or not plan:
        return {}
    device = comm_device()
    nccl = device.type == "cuda"
    ops: list[Any] = []
    sent: list[torch.Tensor] = []
    received: dict[str, tuple[torch.Tensor, list[int], torch.dtype]] = {}
    for tag, (src, dst, ident) in enumerate(plan):
        shape, dtype_text = specs[ident]
        dtype = parse_dtype(dtype_text)
        nbytes = numel(shape) * torch.empty((), dtype=dtype).element_size()
        if src == rank:
            if nbytes == 0:
                continue
            buf = have[ident].detach().contiguous().reshape(-1).view(torch.uint8).to(device)
            sent.append(buf)
            ops.append(dist.P2POp(dist.isend, buf, dst, tag=tag))
        elif dst == rank:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            received[ident] = (buf, shape, dtype)
            if nbytes:
                ops.append(dist.P2POp(dist.irecv, buf, src, tag=tag))
    if ops:
        if nccl:
            works = dist.batch_isend_irecv(ops)
        else:
            works = [op.op(op.tensor, op.peer, tag=op.tag) for op in ops]
        for work in works:
            if work is not None:
                work.wait()
    return {ident: buf.view(dtype).reshape(shape) for ident, (buf, shape, dtype)
            in received.items()}


class _Restore:
    """What one rank has and lacks; fills the gaps once the others sent them."""

    def __init__(self, module: torch.nn.Module, pms: list[tuple[str, Any]],
                 sd: Mapping[str, Any], optimizer: torch.optim.Optimizer | None,
                 osd: Mapping[str, Any] | None) -> None:
        self.module, self.pms, self.optimizer = module, pms, optimizer
        self.sd = dict(sd)
        self.tensors: dict[str, torch.Tensor] = {}
        self.catalog: dict[str, Any] = {}
        self.fills: list[tuple[str, Callable[[Any], None]]] = []
        self.open_unheld: list[tuple[str, dict[str, Any]]] = []
        self.open_entries: list[tuple[str, Any]] = []
        self._module_side()
        self.osd: dict[str, Any] | None = None
        if optimizer is not None and osd is not None:
            self._optimizer_side(osd)

    def _have(self, ident: str, t: torch.Tensor) -> None:
        self.tensors[ident] = t
        self.catalog[ident] = ("t", *_spec(t))

    def _module_side(self) -> None:
        sd = self.sd
        for prefix, pm in self.pms:
            where = f"load_deduped_state_dict into {type(pm).__qualname__} (rank {pm.rank})"
            extra = sd.get(prefix + EXTRA_KEY)
            if not is_extra_state(extra):
                raise CheckpointError(
                    f"{where}: the state dict has no parallel-module metadata under "
                    f"{prefix + EXTRA_KEY!r}; pass what deduped_state_dict returned on this "
                    f"rank"
                )
            check_format(extra, "the state dict")
            compare_records(pm, extra.get("attrs", []), prefix, where, _DEDUP_FIX)
            extra = dict(extra)
            extra.pop("deduped", None)
            sd[prefix + EXTRA_KEY] = extra
            nonpersistent = dict(extra.get("nonpersistent") or {})
            extra["nonpersistent"] = nonpersistent
            section = [dict(r) for r in section_of(extra) or ()]
            if section:
                extra[SECTION] = section
            for shard in section:
                ident = _shard_ident(prefix, shard)
                if shard["shard"] is not None:
                    self._have(ident, shard["shard"])
                else:
                    self.fills.append((ident, lambda t, d=shard: d.__setitem__("shard", t)))
            in_shards = sharded_attrs(section)
            for rec in extra["attrs"]:
                ident = f"{prefix}|{piece_key(rec)}"
                if rec["attr"] in in_shards:
                    continue  # its values are in the shards
                if in_state_dict(rec):
                    key = prefix + rec["attr"]
                    if key in sd:
                        self._have(f"M|{ident}", sd[key])
                    else:
                        self.fills.append((f"M|{ident}", lambda t, k=key: sd.__setitem__(k, t)))
                elif rec["attr"] in nonpersistent:
                    self._have(f"N|{ident}", nonpersistent[rec["attr"]])
                elif rec["kind"] == "constant" or rec["kind"] == "buffer":
                    self.fills.append((f"N|{ident}", lambda t, a=rec["attr"], d=nonpersistent:
                                       d.__setitem__(a, t)))
            unheld = extra.get("unheld")
            if unheld is not None:
                for name, t in unheld.items():
                    self._have(f"U|{prefix}|{name}", t)
            else:
                self.open_unheld.append((prefix, extra))
        for key, value in rank_state_dict(self.module).items():  # no unit gathered
            if any(owned_by(p, key) for p, _ in self.pms):
                continue
            if key in sd:
                if isinstance(sd[key], torch.Tensor):
                    self._have(f"K|{key}", sd[key])
            elif isinstance(value, torch.Tensor):
                self.fills.append((f"K|{key}", lambda t, k=key: sd.__setitem__(k, t)))

    def _optimizer_side(self, osd: Mapping[str, Any]) -> None:
        optimizer = self.optimizer
        opt = optimizer_name(optimizer)
        meta = osd.get(OPTIMIZER_KEY)
        if not isinstance(meta, Mapping) or "params" not in meta:
            raise CheckpointError(
                f"load_deduped_state_dict: the optimizer state dict has no {OPTIMIZER_KEY!r} "
                f"metadata; pass the optimizer state dict deduped_state_dict returned"
            )
        current = optimizer_metadata([pm for _, pm in self.pms], optimizer)
        check_optimizer_metadata(meta, current, f"load_deduped_state_dict into {opt}")
        state = dict(osd["state"])
        self.osd = {"state": state, "param_groups": osd["param_groups"]}
        for i, ident in _optimizer_ids(osd):
            if ident is None:
                continue
            entry = state.get(i)
            if entry is None:
                self.open_entries.append((ident, i))
                continue
            listing = []
            for j, (key, value) in enumerate(entry.items()):
                if isinstance(value, torch.Tensor):
                    self._have(f"{ident}#{j}", value)
                    listing.append((key, "t", f"{ident}#{j}"))
                else:
                    listing.append((key, "v", value))
            self.catalog[ident] = ("e", listing)

    def needs(self, catalogs: list[Mapping[str, Any]]) -> list[str]:
        """Resolve what this rank lacks against every rank's catalog (raises when a piece
        is nowhere)."""
        def source(ident: str) -> int | None:
            return next((r for r, c in enumerate(catalogs) if ident in c), None)

        wanted: list[str] = []
        self.sources: dict[str, int] = {}
        self.specs: dict[str, tuple[list[int], str]] = {}
        resolved_fills = []
        for ident, fill in self.fills:
            r = source(ident)
            if r is None:
                raise CheckpointError(
                    f"load_deduped_state_dict: no rank's state dict holds {ident.split('|', 2)[-1]}"
                    f"; pass every rank its own deduped state dict, all saved at the same step"
                )
            resolved_fills.append((ident, fill))
            wanted.append(ident)
        self.fills = resolved_fills
        for prefix, extra in self.open_unheld:
            head = f"U|{prefix}|"
            names = sorted({i for c in catalogs for i in c if i.startswith(head)})
            if not names:
                continue
            unheld: dict[str, Any] = {}
            extra["unheld"] = unheld
            for ident in names:
                wanted.append(ident)
                self.fills.append((ident, lambda t, n=ident[len(head):], d=unheld:
                                   d.__setitem__(n, t)))
        state = self.osd["state"] if self.osd is not None else {}
        for ident, i in self.open_entries:
            r = source(ident)
            if r is None:
                continue  # no rank has state for it: no step taken yet
            entry: dict[Any, Any] = {}
            state[i] = entry
            for key, kind, value in catalogs[r][ident][1]:
                if kind == "v":
                    entry[key] = value
                else:
                    wanted.append(value)
                    self.fills.append((value, lambda t, k=key, e=entry: e.__setitem__(k, t)))
        for ident in wanted:
            r = source(ident)
            if r is None:
                raise CheckpointError(f"load_deduped_state_dict: no rank holds {ident}")
            self.sources[ident] = r
            self.specs[ident] = tuple(catalogs[r][ident][1:3])  # type: ignore[assignment]
        return wanted

    def fill(self, received: Mapping[str, torch.Tensor]) -> None:
        for ident, fill in self.fills:
            fill(received[ident])

    def load(self) -> None:
        self.module.load_state_dict(self.sd, strict=True)
        if self.optimizer is not None and self.osd is not None:
            self.optimizer.load_state_dict(self.osd)


def load_deduped_state_dict(
    module: torch.nn.Module,
    module_state_dict: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state_dict: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device | None = None,
) -> None:
    """Restore every rank from the state dicts [`deduped_state_dict`][nnscaler.deduped_state_dict]
    returned (collective: every rank calls it with its own dicts).

    Each rank receives the pieces it lacks from the rank that kept them, then loads the
    completed state dicts with ``load_state_dict``: the module must have the plan the
    dicts were saved with (else an error names the first mismatching key and both shapes).
    The module's tensors are updated in place; the optimizer state goes to the devices of
    the tensors it belongs to (``device`` is accepted for symmetry with
    [`load_merged_state_dicts`][nnscaler.load_merged_state_dicts] and not needed).
    """
    del device  # the module's tensors are updated in place where they live
    if (optimizer is None) != (optimizer_state_dict is None):
        raise CheckpointError(
            "load_deduped_state_dict: pass both optimizer and optimizer_state_dict, or neither"
        )
    pms = parallel_modules(module)
    restore: _Restore | None = None
    error: BaseException | None = None
    try:
        if not pms:
            raise CheckpointError(
                f"load_deduped_state_dict: {type(module).__qualname__} holds no "
                f"ParallelModule; load its state dict with load_state_dict"
            )
        restore = _Restore(module, pms, module_state_dict, optimizer, optimizer_state_dict)
    except CheckpointError as e:
        error = e
    agree(error, "load_deduped_state_dict")
    if restore is None:  # unreachable: _agree raised
        raise CheckpointError("internal error: load_deduped_state_dict has nothing to load")
    catalogs = gather(restore.catalog)
    wanted: list[str] = []
    try:
        wanted = restore.needs(catalogs)
    except CheckpointError as e:
        error = e
    agree(error, "load_deduped_state_dict")
    requests = gather([(restore.sources[i], i) for i in wanted])
    plan = [(src, dst, ident) for dst, reqs in enumerate(requests) for src, ident in reqs]
    specs = {ident: catalogs[src][ident][1:3] for src, _, ident in plan}
    restore.fill(_exchange(plan, restore.tensors, specs))
    restore.load()
