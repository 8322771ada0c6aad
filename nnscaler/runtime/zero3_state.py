"""ZeRO stage 3 in checkpoints: a rank saves its fp32 shards, never a gathered unit.

Inside `saving_shards` (what ``nnscaler.checkpoint.rank_state_dict``, the deduped
checkpoints and the Trainer use), ``state_dict()`` of a stage-3 `ParallelModule` leaves
out the parameters that live in a gathering unit and puts under ``_extra_state`` a
``zero3`` list instead, one record per bucket of a stage-3 reducer (`shard_records`):

- ``reducer`` (its ranks), ``bucket`` (the index among the reducer's buckets), ``unit``;
- ``shard_index``, ``nshards`` (the ZeRO group's size), ``shard_numel``, ``numel`` (the
  bucket's elements, before padding to a multiple of ``nshards``);
- ``zero_ranks`` (this rank's ZeRO group), ``zero_ngroups`` (how many groups hold the
  same shards: hybrid sharding);
- ``members``: ``[[attr, offset, numel], ...]``, where each parameter piece lies in the
  bucket's flat buffer (the attribute's record in ``attrs`` gives the piece's box);
- ``shard``: the fp32 shard (the master values the optimizer steps), or None in a
  deduped state dict on a rank that is not the shard's first holder.

Nothing is gathered: the shard is the tensor the optimizer updates. `load_shards` puts the
shards of a state dict of the same plan and rank back (``load_state_dict`` calls it).
Outside `saving_shards`, ``state_dict()`` copies the units out one at a time (gathered,
copied, freed: `copy_units_out`), as a torch user expects of a module's state dict (each
key holds the parameter's values).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from nnscaler.errors import CheckpointError, StateDictMismatchError
from nnscaler.runtime.zero3 import free_unit, gather_unit, wait_unit

if TYPE_CHECKING:
    from nnscaler.runtime.module import ParallelModule
    from nnscaler.runtime.reducer import Bucket, Reducer

__all__ = ["SECTION", "bucket_key", "check_shards", "copy_units_out", "is_saving_shards", "load_shards", "saving_shards", "section_of",
           "shard_records", "sharded_attrs", "unit_keys", "unit_places",
           "write_piece"]

SECTION = "zero3"
_FLAG = "_nnscaler_saving_shards"


@contextlib.contextmanager
def saving_shards(module: torch.nn.Module) -> Iterator[None]:
    """Inside, ``state_dict()`` of every ZeRO stage-3 parallel module in ``module`` holds
    its shards (the module docstring) instead of gathered parameters."""
    from nnscaler.runtime.module import ParallelModule

    pms = [m for m in module.modules() if isinstance(m, ParallelModule)]
    for pm in pms:
        pm.__dict__[_FLAG] = pm.__dict__.get(_FLAG, 0) + 1
    try:
        yield
    finally:
        for pm in pms:
            pm.__dict__[_FLAG] -= 1


def is_saving_shards(pm: ParallelModule) -> bool:
    """Whether ``pm.state_dict()`` now writes shards (stage 3 inside `saving_shards`)."""
    return pm._zero3 is not None and pm.__dict__.get(_FLAG, 0) > 0


def _stage3_buckets(pm: ParallelModule) -> Iterator[tuple[Reducer, int, Bucket]]:
    if pm._zero3 is None:
        return
    for reducer in pm._zero3.reducers:
        for bi, bucket in enumerate(reducer.buckets):
            yield reducer, bi, bucket


def unit_places(pm: ParallelModule) -> dict[int, tuple[Bucket, int]]:
    """``id(parameter) -> (bucket, offset in its flat buffer)`` for every parameter that
    lives in a stage-3 unit of ``pm`` (empty for other stages)."""
    return {id(p): (bucket, int(off)) for _, _, bucket in _stage3_buckets(pm)
            for p, off in zip(bucket.params, bucket.offsets)}


def unit_keys(pm: ParallelModule, state_dict: Mapping[str, Any], prefix: str
              ) -> dict[str, tuple[Bucket, int, int]]:
    """The keys of ``state_dict`` that hold the whole values of parameters living in a
    stage-3 unit of ``pm``: ``key -> (bucket, offset, numel)`` (empty for other stages)."""
    places = unit_places(pm)
    out = {}
    for attr in pm.fullmap:
        place = places.get(id(getattr(pm, attr)))
        if place is not None and isinstance(state_dict.get(prefix + attr), torch.Tensor):
            out[prefix + attr] = (place[0], place[1], int(getattr(pm, attr).numel()))
    return out


def write_piece(bucket: Bucket, offset: int, numel: int,
                read: Callable[[], torch.Tensor] | None) -> None:
    """Set the elements ``[offset, offset + numel)`` of ``bucket``'s flat buffer in this
    rank's shard to those of ``read()`` (a parameter piece; None: zero), without
    gathering the unit: ``read`` is called only when the shard holds some of them."""
    lo = bucket.shard_index * bucket.shard_numel
    a, b = max(offset, lo), min(offset + numel, lo + bucket.shard_numel)
    free_unit(bucket)  # a unit gathered now would hold the old values
    if a >= b or bucket.shard_param is None:
        return
    with torch.no_grad():
        dst = bucket.shard_param[a - lo: b - lo]
        if read is None:
            dst.zero_()
        else:
            dst.copy_(read().reshape(-1)[a - offset: b - offset])


def copy_units_out(pm: ParallelModule, out: MutableMapping[str, Any], prefix: str) -> None:
    """Replace the entries of ``out`` (``pm``'s state dict, keys under ``prefix``) of the
    parameters living in a stage-3 unit by copies of their values, gathering one unit at
    a time (collective over each unit's ZeRO group, as every gather)."""
    key_of = {id(getattr(pm, a)): prefix + a for a, m in pm.fullmap.items()
              if m.kind == "parameter"}
    for reducer, _, bucket in _stage3_buckets(pm):
        keys = [key_of.get(id(p)) for p in bucket.params]
        was_gathered = bucket.gathered
        gather_unit(reducer, bucket)
        wait_unit(bucket)
        try:
            for p, key in zip(bucket.params, keys):
                if key is not None and key in out:
                    out[key] = p.detach().clone()
        finally:
            if not was_gathered:
                free_unit(bucket)


def bucket_key(record: Mapping[str, Any]) -> tuple[tuple[int, ...], int]:
    """``(reducer ranks, bucket index)``: the same on every rank of the reducer."""
    return tuple(int(r) for r in record["reducer"]), int(record["bucket"])


def shard_records(pm: ParallelModule) -> list[dict[str, Any]]:
    """The ``zero3`` section of ``pm``'s state dict: one record per stage-3 bucket."""
    attr_of = {id(getattr(pm, a)): a for a, m in pm.fullmap.items() if m.kind == "parameter"}
    out = []
    for reducer, bi, bucket in _stage3_buckets(pm):
        if bucket.shard_param is None:
            raise CheckpointError("internal error: a stage-3 bucket without a shard")
        out.append({
            "reducer": list(reducer.ranks), "bucket": bi, "unit": bucket.unit,
            "shard_index": int(bucket.shard_index), "nshards": int(bucket.nshards),
            "shard_numel": int(bucket.shard_numel), "numel": int(bucket.numel),
            "zero_ranks": list(reducer._groups.zero_ranks),
            "zero_ngroups": int(reducer.zero_ngroups),
            "members": [[attr_of[id(p)], int(off), int(p.numel())]
                        for p, off in zip(bucket.params, bucket.offsets)],
            "shard": bucket.shard_param.detach(),
        })
    return out


def section_of(extra: Any) -> list[Mapping[str, Any]] | None:
    """The ``zero3`` section of a parallel module's ``_extra_state`` (None: none there,
    the parameters are under their own keys)."""
    if isinstance(extra, Mapping):
        section = extra.get(SECTION)
        if section:
            return list(section)
    return None


def sharded_attrs(section: Sequence[Mapping[str, Any]] | None) -> set[str]:
    """The attributes whose values a ``zero3`` section holds (not under their own keys)."""
    return {str(m[0]) for rec in section or () for m in rec["members"]}


def _layout(rec: Mapping[str, Any]) -> tuple[Any, ...]:
    return (bucket_key(rec), int(rec["shard_index"]), int(rec["nshards"]),
            int(rec["shard_numel"]), [tuple(m) for m in rec["members"]])


def check_shards(pm: ParallelModule, section: Sequence[Mapping[str, Any]], where: str) -> None:
    """Before anything is loaded: the shards of ``section`` are those of ``pm``'s plan and
    rank, every one present, else a `StateDictMismatchError` (or a `CheckpointError`
    for a deduped state dict) that says what to call instead."""
    mine = {bucket_key(r): r for r in shard_records(pm)}
    theirs = {bucket_key(r): r for r in section}
    for key, rec in theirs.items():
        own = mine.get(key)
        if own is None or _layout(own) != _layout(rec):
            have = "nothing" if own is None else f"shard {own['shard_index']}/{own['nshards']}"
            raise StateDictMismatchError(
                f"{where}: the state dict holds ZeRO-3 shard {rec['shard_index']}/"
                f"{rec['nshards']} of bucket {key[1]} (unit {rec['unit']!r}) of the reducer "
                f"over ranks {list(key[0])}, this module holds {have} there; the state dict "
                f"belongs to another plan, rank or ZeRO layout. Load it with "
                f"nnscaler.load_resharded(module, every rank's files, ...)"
            )
        shard = rec["shard"]
        if shard is None:
            raise CheckpointError(
                f"{where}: the ZeRO-3 shard of bucket {key[1]} (unit {rec['unit']!r}) is not "
                f"in this state dict (a deduped state dict keeps it on another rank); load "
                f"deduped state dicts with nnscaler.load_deduped_state_dict on every rank"
            )
        if not isinstance(shard, torch.Tensor) or shard.numel() != int(own["shard_numel"]):
            seen = tuple(shard.shape) if isinstance(shard, torch.Tensor) else type(shard).__name__
            raise StateDictMismatchError(
                f"{where}: the ZeRO-3 shard of bucket {key[1]} (unit {rec['unit']!r}) should "
                f"be a tensor of {own['shard_numel']} elements, the state dict holds {seen}; "
                f"the state dict was edited after it was saved"
            )
    missing = [k for k in mine if k not in theirs]
    if missing:
        raise StateDictMismatchError(
            f"{where}: the state dict holds no ZeRO-3 shard of bucket {missing[0][1]} of the "
            f"reducer over ranks {list(missing[0][0])}, which this module has; the state dict "
            f"belongs to another plan. Load it with nnscaler.load_resharded"
        )


def load_shards(pm: ParallelModule, section: Sequence[Mapping[str, Any]]) -> None:
    """Copy the shards of ``section`` (checked by `check_shards`) into ``pm``'s buckets."""
    by_key = {(tuple(int(x) for x in r.ranks), bi): b for r, bi, b in _stage3_buckets(pm)}
    with torch.no_grad():
        for rec in section:
            bucket = by_key[bucket_key(rec)]
            bucket.shard_param.copy_(rec["shard"].reshape(-1))  # type: ignore[union-attr]
            free_unit(bucket)  # a unit gathered now would hold the old values
