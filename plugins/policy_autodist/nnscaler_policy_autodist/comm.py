"""Device figures and the communication model: the time of a layout plan's steps.

A step of a `nnscaler.layout.Plan` moves ``step.cost`` elements through its
busiest device, over groups of ``g`` devices. Its time is ``latency * (g - 1) + bytes /
bandwidth``, with the bandwidth of NVLink (or the local fabric) when the group stays in
one node and of the network otherwise. The token exchange of expert parallelism, an
all-to-all of uneven sizes, has figures of its own (`DeviceSpec.alltoall_time`): it is
measured as the runtime runs it, per group size. The figures come from a measurement on
the present process group (`measure_comm`, cached in the profile directory) or, for a
named device type, from `DEVICE_SPECS` (public figures; a plan for a cluster that is not
here).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

from nnscaler.extend import DEFAULT_BUCKET_CAP_MB, Plan

__all__ = ["DEVICE_SPECS", "CommModel", "DeviceSpec", "comm_measured", "interpolate",
           "measure_comm", "measure_for_plan"]

logger = logging.getLogger("nnscaler.autodist.comm")  # under nnscaler's loggers

GB = 1024**3

Curve = tuple[tuple[float, float], ...]  # (bytes, seconds) by size


def interpolate(curve: Curve, nbytes: float) -> float:
    """Seconds at ``nbytes`` on a measured ``curve``: linear between its points, the
    first point's time below them, the last segment's slope beyond them."""
    sizes = [b for b, _ in curve]
    times = [t for _, t in curve]
    if nbytes <= sizes[0] or len(curve) == 1:
        return times[0]
    k = next((i for i in range(1, len(sizes)) if nbytes <= sizes[i]), len(sizes) - 1)
    slope = (times[k] - times[k - 1]) / max(sizes[k] - sizes[k - 1], 1.0)
    return times[k - 1] + slope * (nbytes - sizes[k - 1])


#: The reducer's default bucket size: gradients share one collective's latency per bucket.
BUCKET_BYTES = int(DEFAULT_BUCKET_CAP_MB * 1024 * 1024)


@attrs.frozen(kw_only=True)
class DeviceSpec:
    """What the cost model needs to know about one kind of device.

    ``flops``: dense matmul throughput (FLOP/s) for the model's dtype class it is used
    with; ``mem_bw``: memory bandwidth (B/s), for ops that only move data; ``memory``:
    bytes per device; ``intra_bw``/``inter_bw``: the bus bandwidth (B/s, as nccl-tests
    reports it: an all-reduce of ``S`` bytes over ``g`` devices takes ``2(g-1)/g * S /
    busbw``) of a collective inside a node, and of one across nodes per device of the
    group in each node (its network card); ``intra_lat``/``inter_lat``: seconds per hop;
    ``per_node``: devices per node; ``launch``: seconds of overhead per op;
    ``attn_fw_flops``/``attn_bw_flops``: the fused attention kernel's throughput forward
    and backward (0: ``flops``).
    """

    name: str
    flops: float
    mem_bw: float
    memory: float
    intra_bw: float
    inter_bw: float
    intra_lat: float
    inter_lat: float
    per_node: int
    launch: float
    #: measured all-reduce times inside a node, ``((bytes, seconds), ...)`` by size, on a
    #: group of ``curve_group`` processes (`measure_comm`); empty: the formula
    allreduce_curve: Curve = ()
    curve_group: int = 0
    attn_fw_flops: float = 0.0
    attn_bw_flops: float = 0.0
    #: measured all-to-all times inside a node by group size, ``((g, curve), ...)``,
    #: ``curve`` the seconds by the bytes each rank sends (`measure_comm`); empty: the
    #: formula
    alltoall_curves: tuple[tuple[int, Curve], ...] = ()

    def alltoall_time(self, nbytes: float, g: int, *, cross: bool = False,
                      local: int = 1) -> float:
        """Seconds of an all-to-all over ``g`` devices in which each sends ``nbytes`` in
        all (its own share, ``1/g`` of it, stays on the device), ``cross``: the group spans
        nodes with ``local`` of its devices in each.

        Measured (`alltoall_curves`, inside a node): the curve of group size ``g``, else
        of the nearest measured size with its time scaled by the hops, ``(g - 1) / (m -
        1)``. From the figures: each device sends ``(g - 1) / g`` of its bytes, through
        the bus bandwidth (nccl-tests, ``src/alltoall.cu``: an all-to-all's bus bandwidth
        is its algorithm bandwidth times ``(n - 1) / n``, the bytes that leave each rank),
        ``g - 1`` messages of latency; across nodes the ``(g - local) / g`` bound for other
        nodes go through the device's network card while the rest cross the node's
        fabric at the same time."""
        if g <= 1 or nbytes <= 0:
            return 0.0
        if not cross and self.alltoall_curves:
            m, curve = min(self.alltoall_curves, key=lambda c: (abs(c[0] - g), -c[0]))
            return interpolate(curve, nbytes) * (g - 1) / max(m - 1, 1)
        if not cross:
            return self.intra_lat * (g - 1) + nbytes * (g - 1) / g / self.intra_bw
        local = min(max(local, 1), g)
        inside = nbytes * (local - 1) / g / self.intra_bw
        across = nbytes * (g - local) / g / self.inter_bw
        return self.inter_lat * (g - 1) + max(inside, across)


# Figures of named devices, each from a public source:
#
# - peaks: NVIDIA's datasheets. H100 SXM5: 989.4 TFLOP/s dense BF16, 3.35 TB/s HBM3,
#   80 GB. A100 SXM4 80GB: 312 TFLOP/s dense BF16, 2.039 TB/s HBM2e, 80 GB.
# - matmul: XLA's table of measured cuBLAS GEMMs on sm_90 (openxla/xla,
#   xla/service/gpu/model/matmul_interpolator_data.h): BF16 4096x4096x4096 runs at
#   783 TFLOP/s (0.79 of peak), 2048^3 at 632 TFLOP/s, which the 783 TFLOP/s plateau
#   plus about 5 us per kernel reproduces (27 us = 22 + 5): so ``flops`` is the plateau
#   and ``launch`` 5 us. No such table is public for sm_80; the A100 takes the same 0.79
#   of its peak (an assumption that bench/autodist/bench_published.py checks).
# - attention: FlashAttention-2 (the kernel behind torch's scaled_dot_product_attention
#   on both), Dao 2023 (arXiv 2307.08691): on A100 forward reaches up to 73% of peak,
#   backward up to 63%, at head dim 128 and long sequences; the FlashAttention-3 paper
#   (Shah et al. 2024, arXiv 2407.08608) reports FlashAttention-2 at 35% of H100's peak
#   forward (backward scaled by the A100's 63/73).
# - memory: 0.8 of the datasheet bandwidth for elementwise kernels (an assumption: the
#   large-copy rate of HBM is 0.85-0.9 of peak, torch's unfused kernels do a little worse).
# - NCCL inside a node: nccl-tests all_reduce_perf busbw at large sizes, 460-480 GB/s on
#   8 x H100 SXM5 (NVLink 4, NVSwitch) and 230-250 GB/s on 8 x A100 SXM4 (NVLink 3)
#   (Alaya NeW, "NCCL-tests in practice", docs.alayanew.com/en/docs/tech-blog/
#   2026-05-06-nccl-tests); the lower ends are used.
# - NCCL across nodes: one InfiniBand card per GPU (DGX H100: ConnectX-7 NDR 400 Gb/s;
#   DGX A100: ConnectX-6 HDR 200 Gb/s, NVIDIA's DGX user guides), at 0.9 of the line
#   rate: 45 and 22.5 GB/s per device of a group in each node.
# - latency per hop: an assumption, 1.5 us inside a node and 5 us across (a small
#   all-reduce over 8 devices then takes about 20 us inside a node, 70 us across).
#
# ``cpu``: one core of this project's machines with gloo over loopback (measured here;
# replace by measure_comm).
DEVICE_SPECS: dict[str, DeviceSpec] = {
    "H100": DeviceSpec(name="H100", flops=783e12, mem_bw=3.35e12 * 0.8, memory=80 * GB,
                       intra_bw=460e9, inter_bw=45e9, intra_lat=1.5e-6, inter_lat=5e-6,
                       per_node=8, launch=5e-6, attn_fw_flops=989.4e12 * 0.35,
                       attn_bw_flops=989.4e12 * 0.35 * 63 / 73),
    "A100": DeviceSpec(name="A100", flops=312e12 * 0.79, mem_bw=2.039e12 * 0.8,
                       memory=80 * GB, intra_bw=230e9, inter_bw=22.5e9, intra_lat=1.5e-6,
                       inter_lat=5e-6, per_node=8, launch=5e-6, attn_fw_flops=312e12 * 0.70,
                       attn_bw_flops=312e12 * 0.60),
    "cpu": DeviceSpec(name="cpu", flops=2 * 30e9, mem_bw=8e9, memory=8 * GB, intra_bw=1.5e9,
                      inter_bw=1.5e9, intra_lat=60e-6, inter_lat=60e-6, per_node=64,
                      launch=4e-6),
}


@attrs.frozen
class CommModel:
    """Seconds of communication for plans over the devices of one scale unit."""

    spec: DeviceSpec

    def measured(self, nbytes: float, g: int) -> float | None:
        """Seconds of an all-reduce of ``nbytes`` over ``g`` devices of a node from the
        measured curve (linear between its points, its last slope beyond them; the hops
        scaled from the measured group size), or ``None`` without one."""
        curve = self.spec.allreduce_curve
        if not curve or g <= 1:
            return None
        return interpolate(curve, nbytes) * (g - 1) / max(self.spec.curve_group - 1, 1)

    def step_time(self, groups: Iterable[tuple[int, ...]], elements: float,
                  itemsize: int) -> float:
        groups = list(groups)
        if not groups or elements <= 0:
            return 0.0
        g = max(len(set(grp)) for grp in groups)
        cross = any(len({d // self.spec.per_node for d in grp}) > 1 for grp in groups)
        if not cross:
            # the all-reduce that moves as many bytes through each device (2(g-1)/g of
            # its size), as measured
            size = elements * itemsize * max(g, 2) / (2 * max(g - 1, 1))
            t = self.measured(size, max(g, 2))
            if t is not None:
                return t
        local = max(sum(1 for d in grp if d // self.spec.per_node == grp[0] // self.spec.per_node)
                    for grp in groups)
        bw = self.cross_bw(local) if cross else self.spec.intra_bw
        lat = self.spec.inter_lat if cross else self.spec.intra_lat
        return lat * max(g - 1, 1) + elements * itemsize / bw

    def cross_bw(self, local: int = 1) -> float:
        """Bus bandwidth of a collective across nodes whose group has ``local`` devices
        in each node: each device sends through its own network card, so the node's
        cards carry the group's traffic together (up to the bandwidth inside a node)."""
        return min(self.spec.intra_bw, self.spec.inter_bw * max(local, 1))

    def plan_time(self, p: Plan | None, itemsize: int, numel: int, grad: bool) -> float:
        """Forward (and, with ``grad``, backward) time of plan ``p``; a move without a plan
        (pieces that form no layout) costs the whole tensor once each way."""
        if p is None:
            once = self.measured(numel * itemsize, 2)
            if once is None:
                once = self.spec.intra_lat + numel * itemsize / self.spec.intra_bw
            return 2 * once if grad else once
        total = self._steps(p, itemsize)
        if grad and p.steps:
            total += self._steps(p.adjoint(), itemsize)
        return total

    def _steps(self, p: Plan, itemsize: int) -> float:
        return sum(self.step_time([g.src + g.dst for g in s.groups], s.cost, itemsize)
                   for s in p.steps if s.cost > 0)

    def allreduce_time(self, nbytes: float, g: int, *, cross: bool = False,
                       bucketed: bool = True, local: int = 1) -> float:
        """A ring all-reduce of ``nbytes`` over ``g`` devices (``cross``: across nodes,
        ``local`` of them in each node, see `cross_bw`). Gradients are synchronised
        in buckets (``bucketed``): their latency is shared by `BUCKET_BYTES`."""
        if g <= 1 or nbytes <= 0:
            return 0.0
        if not cross and self.spec.allreduce_curve:
            if bucketed:  # at the rate of a full bucket
                return self.measured(BUCKET_BYTES, g) * nbytes / BUCKET_BYTES
            return self.measured(nbytes, g)
        bw = self.cross_bw(local) if cross else self.spec.intra_bw
        lat = 2 * (g - 1) * (self.spec.inter_lat if cross else self.spec.intra_lat)
        if bucketed:
            lat *= min(1.0, nbytes / BUCKET_BYTES)
        return lat + 2 * (g - 1) / g * nbytes / bw


#: How `measure_comm` measures; figures cached another way are measured again (4: with
#: the all-to-all's curves).
METHOD = 4

#: Bytes each rank sends in the measured all-to-alls (the token exchanges of a step are
#: mostly tens of KiB to a few MiB on CPU; larger ones follow the last slope).
A2A_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
#: Floats in a row of the measured all-to-alls (a token's hidden state).
A2A_ROW = 256


def _cache_file(profile_dir: Path, device: str, group: int) -> Path:
    """Figures per device type and group size: two processes sharing a node's cores, or
    eight, see very different latencies."""
    return Path(profile_dir) / f"comm-{device}-g{group}.json"


def _cached_groups(profile_dir: Path, device: str) -> list[int]:
    out = []
    for path in Path(profile_dir).glob(f"comm-{device}-g*.json"):
        tail = path.stem.rsplit("-g", 1)[-1]
        if tail.isdigit():
            out.append(int(tail))
    return sorted(out)


def monotone(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest to ``values`` in least squares (pooling
    adjacent violators): a larger message never costs less, and a noisy point is
    averaged with its neighbours instead of lifting every size after it."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    out: list[float] = []
    for total, n in blocks:
        out.extend([total / n] * int(n))
    return out


def alltoall_groups(world: int) -> list[int]:
    """The group sizes whose all-to-all `measure_comm` measures on ``world`` ranks: the
    powers of two from 2 that divide it, and ``world`` itself (an expert degree is a
    stage's degree, which divides the unit)."""
    out = [g for g in (2 ** i for i in range(1, world.bit_length())) if world % g == 0]
    return sorted(set(out) | {world}) if world >= 2 else []


def even_splits(rows: int, g: int) -> list[int]:
    """``rows`` dealt to ``g`` members, the first ``rows % g`` one more (as an even routing
    of a part's token-expert pairs sends them)."""
    return [rows // g + (1 if m < rows % g else 0) for m in range(g)]


# long: a 20-line docstring on the method; the code is one measurement around two closures
def measure_comm(profile_dir: Path | str, *,
                 sizes: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 21,
                                           1 << 23, BUCKET_BYTES),
                 a2a_sizes: tuple[int, ...] = A2A_SIZES,
                 repeat: int = 9, segment: int = 16, syncs: int = 6) -> dict[str, Any] | None:
    """Measure all-reduce and all-to-all on the present ``torch.distributed`` group and
    cache the times per size (``points``, which the model interpolates) with a fitted
    latency and bandwidth (``{'lat': s, 'bw': B/s}``) as the ``cpu`` or ``cuda`` figures of
    this machine, and the all-to-all's times per group size (``alltoall``: ``{g: points}``,
    by the bytes each rank sends). Every rank must call it (it runs collectives); rank 0
    writes the file. Returns the figures, or ``None`` without a process group of two or
    more ranks.

    A collective is measured by what it adds to a computation, as training meets it:
    ``syncs`` rounds of ``segment`` 192x192 matmuls (about 2 ms on one CPU thread, an op
    or two of a layer) each followed by the collective through the runtime (an
    all-reduce through its adapter; the all-to-all through the `ProcessPartGroup` that
    expert parallelism's dispatch calls, of rows dealt evenly, every group of ``g``
    consecutive ranks exchanging at once as the groups of an expert-parallel plan do),
    against the same rounds without it, both timed on the slowest rank (mean of
    ``repeat``: the waits of a step's collectives add up, so their mean is what a step
    pays, and it is larger than their median, for a few waits are long). The difference
    counts what timing the call alone misses: the wait for the slower rank, a sleeping
    process's wake-up, and the computation after it running slower. On this project's
    2-core machine a 4 KiB all-reduce costs 0.3-2 ms back to back but adds 1.3-3 ms to a
    computation; 16 rounds of 2.3 ms of matmuls took 79 ms with one all-reduce and 112 ms
    with one after each round. The times are made non-decreasing in the size
    (`monotone`).

    ``autodist`` calls it itself, through `nnscaler.parallel.call_on_every_rank`,
    the first time it plans inside a distributed ``parallelize`` with no figures cached.
    """
    import statistics

    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    from nnscaler.extend import Layout, current_device, device_type, execute_plan, plan

    dev = current_device() if device_type() == "cuda" else torch.device("cpu")
    g = dist.get_world_size()
    work = torch.randn(192, 192, device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def rounds(comm: Callable[[], Any] | None) -> float:
        """Seconds of ``syncs`` rounds on the slowest rank."""
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(syncs):
            for _ in range(segment):
                work @ work  # the computation a collective follows in training
            if comm is not None:
                comm()
        sync()
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took.item())

    def added(comm: Callable[[], Any], size: int, paired: bool = False) -> float:
        """Seconds ``comm`` adds to a round (a large message's time is mostly its
        transfer, steadier than a wait: fewer samples). ``paired``: rounds with it and
        without it alternate, so that a change of the machine's load meanwhile shifts
        both (the all-to-all's rounds, short, afford it)."""
        comm()
        if paired:  # each pair two rounds: half as many pairs
            n = max(3, repeat // 2) if size <= 1 << 20 else max(2, repeat // 4)
            pairs = [(rounds(comm), rounds(None)) for _ in range(n)]
            return max(statistics.fmean(a - b for a, b in pairs), 0.0) / syncs
        n = repeat if size <= 1 << 20 else max(3, repeat // 3)
        took = statistics.fmean(rounds(comm) for _ in range(n))
        return max(took - compute, 0.0) / syncs

    def all_reduce(size: int) -> Callable[[], Any]:
        # through the runtime, as generated code runs it (its bookkeeping included)
        shape = (size // 4,)
        reduce = plan(Layout(shape=shape, v=g), Layout(shape=shape, r=g))
        _ensure(reduce)
        x = torch.ones(shape, dtype=torch.float32, device=dev)
        return lambda: execute_plan(reduce, x)

    with torch.no_grad():
        rounds(None)
        compute = statistics.fmean(rounds(None) for _ in range(repeat))
        times = [added(all_reduce(size), size) for size in sizes]
        exchanges = {m: [added(_alltoall(m, size, dev), size, True) for size in a2a_sizes]
                     for m in (alltoall_groups(g) if a2a_sizes else ())}
    figures = _figures(g, list(zip(sizes, _floored(times))), compute / syncs)
    figures["alltoall"] = {str(m): [list(x) for x in zip(a2a_sizes, _floored(t))]
                           for m, t in exchanges.items() if t}
    if dist.get_rank() == 0:
        path = _cache_file(Path(profile_dir), device_type(), g)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(figures, indent=1))
        tmp.replace(path)
    return figures


def _floored(times: list[float]) -> list[float]:
    """Non-decreasing in the size (`monotone`), and never free: a collective costs
    something however lucky the samples."""
    return [max(t, 1e-6) for t in monotone(times)]


def _ensure(p: Plan) -> None:
    from nnscaler.extend import ensure_groups, plan_groups

    ensure_groups(plan_groups(p))


def _alltoall(m: int, size: int, dev: Any) -> Callable[[], Any]:
    """One token exchange of ``size`` bytes per rank among groups of ``m`` consecutive
    ranks, as expert parallelism's dispatch runs it (`ProcessPartGroup.all_to_all`, the
    sizes agreed)."""
    import torch
    import torch.distributed as dist

    from nnscaler.extend import ProcessPartGroup, ensure_groups

    world = dist.get_world_size()
    groups = [tuple(range(i, i + m)) for i in range(0, world, m)]
    ensure_groups(groups)
    group = ProcessPartGroup(groups[dist.get_rank() // m])
    rows = max(size // (4 * A2A_ROW), 1)
    splits = even_splits(rows, m)
    x = torch.ones(rows, A2A_ROW, dtype=torch.float32, device=dev)
    return lambda: group.all_to_all(x, splits, splits)


def _figures(g: int, points: list[tuple[int, float]], compute: float) -> dict[str, Any]:
    """The all-reduce's figures: its points and the ring's latency and bandwidth fitted
    on the smallest and largest (``t = 2(g-1) lat + 2(g-1)/g * bytes / bw``), for a
    reader; the model interpolates the points (mid-sized messages cost more per byte
    than a line through the ends says)."""
    (s0, t0), (s1, t1) = points[0], points[-1]
    k = 2 * (g - 1) / g
    bw = k * (s1 - s0) / max(t1 - t0, 1e-9)
    lat = max((t0 - k * s0 / bw) / (2 * (g - 1)), 1e-7)
    return {"lat": lat, "bw": bw, "group": g, "points": [list(x) for x in points],
            "compute_s": compute, "method": METHOD}


def comm_measured(profile_dir: Path | str, group: int, alltoall: bool = False) -> bool:
    """Whether `measure_comm` cached figures for this device type and a group of
    ``group`` processes there, measured the present way (`METHOD`), with the
    all-to-all's curves when ``alltoall``."""
    from nnscaler.extend import device_type

    path = _cache_file(Path(profile_dir), device_type(), group)
    try:
        fig = json.loads(path.read_text())
        return fig.get("method") == METHOD and (not alltoall or bool(fig.get("alltoall")))
    except (OSError, ValueError, AttributeError):
        return False


def measure_for_plan(profile_dir: Path | str, alltoall: bool) -> dict[str, Any] | None:
    """`measure_comm` as a plan needs it: the all-to-all too when ``alltoall`` (a model
    with an MoE op), which spares every other model the seconds it takes."""
    return measure_comm(profile_dir, a2a_sizes=A2A_SIZES if alltoall else ())


def device_spec(device: str | None, profile_dir: Path, group: int = 2) -> DeviceSpec:
    """The figures for ``device`` (a name of `DEVICE_SPECS`), or for the present
    device type with the communication figures `measure_comm` cached for a group
    of ``group`` processes (else for the nearest group size measured; else defaults)."""
    if device is not None and device not in ("cpu", "cuda"):
        return DEVICE_SPECS[device]
    from nnscaler.extend import device_type

    kind = device or device_type()
    base = DEVICE_SPECS["cpu"] if kind == "cpu" else DEVICE_SPECS["H100"]
    known = _cached_groups(Path(profile_dir), kind)
    nearest = min(known, key=lambda g: (abs(g - group), -g)) if known else group
    path = _cache_file(Path(profile_dir), kind, nearest)
    if path.is_file():
        try:
            fig = json.loads(path.read_text())
            curve = tuple(sorted((float(b), float(t)) for b, t in fig.get("points", ())))
            exchanges = tuple(sorted(
                (int(m), tuple(sorted((float(b), float(t)) for b, t in pts)))
                for m, pts in fig.get("alltoall", {}).items() if pts))
            return attrs.evolve(base, name=kind, intra_bw=float(fig["bw"]),
                                inter_bw=float(fig["bw"]), intra_lat=float(fig["lat"]),
                                inter_lat=float(fig["lat"]), allreduce_curve=curve,
                                curve_group=int(fig.get("group", nearest)),
                                alltoall_curves=exchanges)
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("autodist: ignoring the unreadable communication profile %s (%s)",
                           path, e)
    return attrs.evolve(base, name=kind)
