"""`ModuleSource`: the full tensors of a live model holding parallel modules, read
collectively (every rank calls `ModuleSource.read` for the same names in the same order;
rank 0 gets each tensor, the other ranks send it the pieces they are the first holder
of, and a ZeRO stage-3 piece as the slices of the shards that hold it). It is the
source of ``save_pretrained(model, ...)``; the catalog and the box arithmetic are
`nnscaler.checkpoint.pieces`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.checkpoint.collective import comm_device, gather, world
from nnscaler.checkpoint.pieces import (
    _VIEW,
    _as_box,
    _Catalog,
    _Entry,
    _full_box,
    _intersect,
    _lookup,
    zero3_piece,
)
from nnscaler.checkpoint.shards import rank_state_dict, shard_slice
from nnscaler.runtime.state import is_extra_state, numel, sub_shape
from nnscaler.runtime.zero3_state import SECTION

__all__ = ["ModuleSource"]


class ModuleSource:
    """A live model holding parallel modules, on every rank (collective): every rank
    calls `read` for the same names in the same order; rank 0 gets the full tensor,
    the other ranks send it the pieces they are the first holder of and get None."""

    def __init__(self, module: torch.nn.Module) -> None:
        _, self.rank, _ = world()
        self.local = rank_state_dict(module)  # ZeRO stage 3: the shards, nothing gathered
        everyone = gather({k: _shapes_only(v) for k, v in self.local.items()})
        self.catalog = _Catalog()
        for r, view in enumerate(everyone):
            self.catalog.add_state_dict(r, view, f"rank {r}'s module")

    def names(self) -> list[str]:
        return self.catalog.names()

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype, str]:
        e = self.catalog.entries[self.catalog.alias[name]]
        return e.shape, e.dtype, "the parallel module"

    def read(self, name: str, index: Sequence[Sequence[int]] | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor | None:
        e = self.catalog.entries[self.catalog.alias[name]]
        box = _full_box(e.shape) if index is None else _as_box(index)
        if self.rank != 0:
            zero3 = self.catalog.zero3
            for (piece_box, _), (holder, key) in e.pieces.items():
                if _intersect(piece_box, box) is None:
                    continue
                if zero3.owns(key):  # a stage-3 piece: the slices of this rank's shards
                    for file, prefix, pos, lo, hi in zero3.slices(holder, key.split(_VIEW)[0]):
                        if file == self.rank:
                            _send(shard_slice(self.local, prefix, pos, lo, hi), 0)
                elif holder == self.rank:
                    _send(_lookup(self.local, key), 0)
            return None
        return e.assemble(box, lambda h, k: self._fetch(e, h, k), "export", out)

    def _fetch(self, e: _Entry, holder: int, key: str) -> torch.Tensor:
        if self.catalog.zero3.owns(key):
            return zero3_piece(self.catalog.zero3, holder, key, self._shard)
        if holder == 0:
            return _lookup(self.local, key)
        box = next(b for (b, _), (h, k) in e.pieces.items() if (h, k) == (holder, key))
        return _recv(sub_shape(box), e.dtype, holder)

    def _shard(self, file: int, prefix: str, pos: int, lo: int, hi: int) -> torch.Tensor:
        if file == 0:
            return shard_slice(self.local, prefix, pos, lo, hi)
        return _recv((hi - lo,), self.catalog.zero3.dtypes[(file, prefix, pos)], file)


def _shapes_only(value: Any) -> Any:
    """What the other ranks need to know of a state-dict entry: tensors as meta tensors
    (shape and dtype), metadata without the values of non-persistent buffers."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("meta")
    if is_extra_state(value):
        out = {k: v for k, v in value.items() if k != "nonpersistent"}
        if out.get("unheld"):
            out["unheld"] = {n: t.to("meta") for n, t in out["unheld"].items()}
        if out.get(SECTION):
            out[SECTION] = [{**r, "shard": None if r["shard"] is None else r["shard"].to("meta")}
                            for r in out[SECTION]]
        return out
    return value



def _send(t: torch.Tensor, dst: int) -> None:
    buf = t.detach().contiguous().reshape(-1).view(torch.uint8).to(comm_device())
    if buf.numel():
        dist.send(buf, dst)


def _recv(shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
    nbytes = numel(shape) * torch.empty((), dtype=dtype).element_size()
    buf = torch.empty(nbytes, dtype=torch.uint8, device=comm_device())
    if nbytes:
        dist.recv(buf, src)
    return buf.cpu().view(dtype).reshape(shape)
