"""Reading the ZeRO stage-3 shards of per-rank state dicts back into parameter pieces.

A stage-3 rank saves, per gathering unit (a reducer bucket), its fp32 shard of the
unit's flat buffer and where each parameter piece lies in it (the ``zero3`` section of
``_extra_state``, `nnscaler.runtime.zero3_state`). A piece is put together from the
shards of every shard index of the bucket (any rank's, since the ZeRO groups of
``zero_ngroups > 1`` hold equal copies), cut at the piece's offsets and cast to the
parameter's dtype:

- `shard_pieces`: every piece of every stage-3 bucket at once, for
  [`merge_state_dicts`][nnscaler.merge_state_dicts] (which builds the whole model anyway);
- `rank_state_dict`: what a rank saves (shards, not gathered parameters);
- `ShardCatalog`: one piece at a time, read from memory-mapped files, for
  `nnscaler.checkpoint.pieces.RankFilesSource` (``load_resharded``,
  ``save_pretrained`` from files).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from nnscaler.errors import CheckpointError
from nnscaler.runtime.state import EXTRA_KEY, parse_dtype, sub_shape
from nnscaler.runtime.zero3_state import (
    SECTION,
    bucket_key,
    saving_shards,
    section_of,
    write_piece,
)

__all__ = ["ShardCatalog", "rank_state_dict", "shard_job", "shard_pieces", "shard_slice"]

#: (module prefix, (reducer ranks, bucket index))
Key = tuple[str, tuple[tuple[int, ...], int]]


def rank_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    """This rank's module state dict, as a checkpoint saves it: ``module.state_dict()``,
    except that a ZeRO stage-3 parallel module in ``module`` holds this rank's fp32 shard
    of each gathering unit (and where each parameter piece lies in it) instead of its
    gathered parameters, so nothing is gathered and the file is the shard's size.

    It loads back with ``module.load_state_dict`` (same plan and rank), merges with
    [`merge_state_dicts`][nnscaler.merge_state_dicts] and moves to any plan with
    [`load_resharded`][nnscaler.load_resharded]. Without stage 3 it is ``module.state_dict()``.
    """
    with saving_shards(module):
        return module.state_dict()


def shard_slice(sd: Mapping[str, Any], prefix: str, pos: int, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the ``pos``-th shard of the ``zero3`` section of the
    parallel module under ``prefix`` in the state dict ``sd``."""
    return sd[prefix + EXTRA_KEY][SECTION][pos]["shard"].reshape(-1)[lo:hi]


def shard_job(place: tuple[Any, int], meta: Any, piece: Callable[[], torch.Tensor]
              ) -> Callable[[], None]:
    """Loading one parameter piece of a stage-3 unit (``place``: its bucket and offset;
    ``meta``: its `nnscaler.runtime.module.AttrMeta`): the elements of ``piece()`` that
    fall in this rank's shard are written into it (a value part other than the first:
    zeros); ``piece`` is read only when the shard holds some of them."""
    bucket, offset = place

    def run() -> None:
        write_piece(bucket, offset, math.prod(meta.sub_shape),
                    None if meta.value[0] != 0 else piece)
    return run


def _missing(key: Key, nshards: int, have: Sequence[int], unit: str, given: str) -> CheckpointError:
    missing = [s for s in range(nshards) if s not in have]
    return CheckpointError(
        f"the ZeRO-3 shards {missing} of {nshards} of unit {unit!r} (bucket {key[1][1]} of "
        f"the reducer over ranks {list(key[1][0])}) are in none of the {given}; pass the "
        f"state dict of every rank of the saved plan, all saved after the same step"
    )


def shard_pieces(metas: Sequence[Mapping[str, Any]], what: str
                 ) -> Iterator[tuple[int, Mapping[str, Any], torch.Tensor]]:
    """``(rank index, attribute record, piece)`` for every parameter piece that the
    ``zero3`` sections of ``metas`` (one parallel module's ``_extra_state`` per rank)
    hold; a bucket whose shards are not all given is an error naming them."""
    buckets: dict[tuple[tuple[int, ...], int], dict[int, torch.Tensor]] = {}
    first: dict[tuple[tuple[int, ...], int], tuple[int, Mapping[str, Any]]] = {}
    for i, meta in enumerate(metas):
        for rec in section_of(meta) or ():
            key = bucket_key(rec)
            first.setdefault(key, (i, rec))
            shards = buckets.setdefault(key, {})
            if rec["shard"] is not None:
                shards.setdefault(int(rec["shard_index"]), rec["shard"])
    for key, (i, rec) in first.items():
        shards, nshards = buckets[key], int(rec["nshards"])
        if len(shards) != nshards:
            raise _missing(("", key), nshards, list(shards), rec["unit"],
                           f"state dicts given to {what}")
        flat = torch.cat([shards[s].reshape(-1) for s in range(nshards)])
        records = {r["attr"]: r for r in metas[i]["attrs"]}
        for attr, offset, count in rec["members"]:
            r = records[attr]
            piece = flat[int(offset): int(offset) + int(count)]
            yield i, r, piece.view(sub_shape(r["index"])).to(parse_dtype(r["dtype"]))


class ShardCatalog:
    """The stage-3 pieces of a set of per-rank files: registered file by file (`add`),
    checked whole (`check`), read one piece at a time (`read`)."""

    MARK = f"{EXTRA_KEY}/zero3/"

    def __init__(self) -> None:
        self.shards: dict[Key, dict[int, tuple[int, int]]] = {}  # shard index -> (file, pos)
        self.layout: dict[Key, tuple[int, int, str]] = {}  # nshards, shard_numel, unit
        self.refs: dict[tuple[int, str], tuple[Key, int, int, tuple[int, ...]]] = {}
        self.dtypes: dict[tuple[int, str, int], torch.dtype] = {}  # (file, prefix, pos)

    def add(self, holder: int, prefix: str, extra: Mapping[str, Any]) -> dict[str, str]:
        """Register file ``holder``'s shards of the module under ``prefix``; returns, per
        attribute they hold, the key under which `read` gives its piece."""
        records = {r["attr"]: r for r in extra["attrs"]}
        out: dict[str, str] = {}
        for pos, rec in enumerate(section_of(extra) or ()):
            key: Key = (prefix, bucket_key(rec))
            self.layout.setdefault(key, (int(rec["nshards"]), int(rec["shard_numel"]),
                                         str(rec["unit"])))
            if rec["shard"] is not None:
                self.shards.setdefault(key, {}).setdefault(int(rec["shard_index"]),
                                                           (holder, pos))
                self.dtypes[(holder, prefix, pos)] = rec["shard"].dtype
            else:
                self.shards.setdefault(key, {})
            for attr, offset, count in rec["members"]:
                ref = f"{prefix}{self.MARK}{attr}"
                out[str(attr)] = ref
                self.refs[(holder, ref)] = (key, int(offset), int(count),
                                            sub_shape(records[attr]["index"]))
        return out

    def check(self, given: str) -> None:
        """Every bucket has all its shards in some file, else a `CheckpointError`."""
        for key, (nshards, _, unit) in self.layout.items():
            have = self.shards.get(key, {})
            if len(have) != nshards:
                raise _missing(key, nshards, list(have), unit, given)

    def owns(self, ref: str) -> bool:
        return self.MARK in ref

    def slices(self, holder: int, ref: str) -> list[tuple[int, str, int, int, int]]:
        """Where the piece ``ref`` (registered by file ``holder``) lies: ``(file, prefix,
        position, start, stop)`` per shard slice, in the piece's order."""
        key, offset, count, _ = self.refs[(holder, ref)]
        nshards, shard_numel, _ = self.layout[key]
        out = []
        for s in range(offset // shard_numel, min(nshards, -(-(offset + count) // shard_numel))):
            lo, hi = max(offset, s * shard_numel), min(offset + count, (s + 1) * shard_numel)
            if lo < hi:
                file, pos = self.shards[key][s]
                out.append((file, key[0], pos, lo - s * shard_numel, hi - s * shard_numel))
        return out

    def read(self, holder: int, ref: str,
             shard: Callable[[int, str, int, int, int], torch.Tensor]) -> torch.Tensor:
        """The piece ``ref`` registered by file ``holder``, put together from the slices of
        the shards that cover it (``shard(file, prefix, position, start, stop)`` gives
        one slice)."""
        parts = [shard(*where).reshape(-1) for where in self.slices(holder, ref)]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        return flat.view(self.refs[(holder, ref)][3])
