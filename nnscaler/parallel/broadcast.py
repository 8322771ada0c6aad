"""Moving generated files and initial weights between ranks.

- `broadcast_gen_files`: rank 0 sends newly generated files to the first rank of
  every other node (``BroadcastGenFilesStrategy``); with one node it does nothing.
- [`broadcast_weights`][nnscaler.broadcast_weights]: ranks ``0..stride-1`` send their module state
  to the ranks ``r`` with ``r % stride`` equal to theirs (for ``broadcast_strategy='no_weights'``).
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nnscaler import gendir
from nnscaler.errors import BroadcastError
from nnscaler.parallel import staging
from nnscaler.parallel.config import BroadcastGenFilesStrategy
from nnscaler.runtime.module import ParallelModule

__all__ = ["BroadcastError", "broadcast_gen_files", "broadcast_weights", "node_leaders"]

_CHUNK = 64 * 1024 * 1024  # bytes per broadcast of file contents


def _node_key() -> str:
    """This process's node: torchrun's ``GROUP_RANK`` (the node rank) when set, else the
    host name."""
    group_rank = os.environ.get("GROUP_RANK", "").strip()
    return f"node{group_rank}" if group_rank else f"host:{socket.gethostname()}"


def node_leaders() -> list[int]:
    """The lowest global rank of every node, in rank order (collective: every rank calls)."""
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, _node_key())
    first: dict[str, int] = {}
    for rank, key in enumerate(keys):
        first.setdefault(key, rank)
    return sorted(first.values())


def selected_files(outdir: Path, strategy: BroadcastGenFilesStrategy) -> list[str]:
    """The files of ``outdir`` that ``strategy`` sends, ``config.json`` last."""
    names = sorted(p.name for p in outdir.iterdir() if p.is_file())
    if strategy is BroadcastGenFilesStrategy.CODE:
        names = [n for n in names if gendir.is_gencode(n)]
    elif strategy is BroadcastGenFilesStrategy.NO_WEIGHTS:
        names = [n for n in names if n != gendir.FULLMODEL]
    elif strategy is BroadcastGenFilesStrategy.NONE:
        names = []
    return sorted(names, key=lambda n: (n == gendir.CONFIG_FILE, n))


def _comm_device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _send_bytes(data: bytes | None, size: int, src: int, group: Any,
                device: torch.device) -> bytes:
    out = bytearray()
    for start in range(0, size, _CHUNK):
        n = min(_CHUNK, size - start)
        if data is not None:
            chunk = torch.frombuffer(bytearray(data[start:start + n]), dtype=torch.uint8)
            chunk = chunk.to(device)
        else:
            chunk = torch.empty(n, dtype=torch.uint8, device=device)
        dist.broadcast(chunk, src=src, group=group)
        if data is None:
            out += chunk.cpu().numpy().tobytes()
    return bytes(out) if data is None else data


def broadcast_gen_files(outdir: Path, strategy: BroadcastGenFilesStrategy) -> None:
    """Send the files ``strategy`` selects from rank 0's ``outdir`` to the first rank of
    every other node, which writes them into its own ``outdir`` (collective).

    ``ALL`` replaces the receiving directory; ``NO_WEIGHTS`` and ``CODE`` write their files
    into it and keep the others (the weights, ...) that are already there.
    """
    if strategy is BroadcastGenFilesStrategy.NONE:
        return
    leaders = node_leaders()
    if len(leaders) == 1:
        return  # one node: every rank already sees rank 0's files
    rank = dist.get_rank()
    if rank not in leaders:
        return
    if leaders[0] != 0:
        raise BroadcastError(f"internal error: rank 0 is not the first rank of its node "
                             f"(node leaders {leaders})")
    group = dist.new_group(leaders, use_local_synchronization=True)
    try:
        device = _comm_device(group)
        box: list[Any] = [None]
        if rank == 0:
            names = selected_files(outdir, strategy)
            box = [[(n, (outdir / n).stat().st_size) for n in names]]
        dist.broadcast_object_list(box, src=0, group=group)
        listing: list[tuple[str, int]] = box[0]
        if rank == 0:
            for name, size in listing:
                _send_bytes((outdir / name).read_bytes(), size, 0, group, device)
            return
        received = [(name, _send_bytes(None, size, 0, group, device)) for name, size in listing]
    finally:
        dist.destroy_process_group(group)
    _write_received(outdir, received, replace=strategy is BroadcastGenFilesStrategy.ALL)


def _write_received(outdir: Path, received: list[tuple[str, bytes]], *, replace: bool) -> None:
    if replace:
        with staging.staging_dir(outdir) as tmp:
            for name, data in received:
                (tmp / name).write_bytes(data)
        return
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / gendir.CONFIG_FILE).unlink(missing_ok=True)  # incomplete while writing
    for name, data in received:
        tmp = outdir / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, outdir / name)


def _parallel_modules(module: torch.nn.Module) -> list[Any]:
    return [m for m in module.modules() if isinstance(m, ParallelModule)]


def broadcast_weights(module: torch.nn.Module, stride: int | None = None) -> None:
    """Copy the module state (parameters and buffers, persistent or not) of ranks
    ``0..stride-1`` to every rank ``r`` from rank ``r % stride`` (collective).

    For ``broadcast_strategy='no_weights'``: ranks that built their parallel modules with
    ``init_module_params=False`` get the initial weights from ranks that had them.
    ``stride`` defaults to the parallel modules' ``plan_ngpus`` and must be a multiple of
    it that divides the world size. Call it before
    [`nnscaler.build_optimizer`][nnscaler.build_optimizer].
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise BroadcastError("broadcast_weights needs torch.distributed to be initialized "
                             "(launch with torchrun and call init_process_group first)")
    world, rank = dist.get_world_size(), dist.get_rank()
    pms = _parallel_modules(module)
    plans = sorted({int(pm.plan_ngpus) for pm in pms})
    if len(plans) > 1:
        raise BroadcastError(f"the parallel modules of {type(module).__qualname__} have "
                             f"different plan_ngpus {plans}; broadcast each separately")
    plan_ngpus = plans[0] if plans else 1
    if stride is None:
        if not pms:
            raise BroadcastError(
                f"{type(module).__qualname__} holds no ParallelModule, so there is no "
                f"plan_ngpus to default stride to; pass stride= explicitly"
            )
        stride = plan_ngpus
    if (isinstance(stride, bool) or not isinstance(stride, int) or stride < 1
            or stride % plan_ngpus or world % stride):
        raise BroadcastError(
            f"stride must be a positive multiple of plan_ngpus ({plan_ngpus}) that divides "
            f"the world size ({world}), got {stride!r}; the default is plan_ngpus"
        )
    if stride == world:
        return
    from nnscaler.runtime.groups import ensure_groups, get_group

    groups = [tuple(range(s, world, stride)) for s in range(stride)]
    ensure_groups(groups)
    src = rank % stride
    group = get_group(groups[src])
    seen: set[int] = set()
    with torch.no_grad():
        for t in itertools.chain(module.parameters(), module.buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            dist.broadcast(t.data, src=src, group=group)
    for pm in pms:
        for reducer in pm.reducers:
            reducer.refresh_shards()
