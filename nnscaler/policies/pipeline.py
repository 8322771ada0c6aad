"""``pp`` and ``hybrid``: pipeline parallelism, alone or with tensor parallelism per stage.

Both cut the program into stages of about equal compute and configure the schedule
through ``pas_config`` (the keys nnScaler users know; the micro-batches and the scheduler
are read once into ``compute_config.pipeline``, `nnscaler.config.PipelineConfig`,
which code generation reads too):

- ``pipeline_nstages``: the number of pipeline devices ``p`` (``pp``: default and at most
  ``plan_ngpus``; ``hybrid``: required, it must divide ``plan_ngpus``);
- ``pipeline_nmicros``: the micro-batches of each ``train_step`` (required);
- ``pipeline_scheduler``: a registered schedule (default ``'1f1b'``; built-ins ``gpipe``,
  ``1f1b``, ``1f1b_interleaved``);
- ``pipeline_nvirtual``: stages per pipeline device (default 2 for ``1f1b_interleaved``,
  else 1); the graph is cut into ``p * pipeline_nvirtual`` stages and stage ``s`` runs on
  pipeline device ``s % p``;
- ``pipeline_balance``: what the stages are balanced on (default ``'compute'``, below;
  ``'parameters'``: the parameter elements each stage holds, a weight read by two stages
  (an LM head tied to the embedding) counted in both, for models whose memory, not
  compute, decides how many stages they need).

``pp`` runs each stage whole on one device (``plan_ngpus == pipeline_nstages``).
``hybrid`` gives each pipeline device ``k = plan_ngpus / pipeline_nstages`` devices
(pipeline device ``d`` owns devices ``d*k .. d*k+k-1``) and splits every op of a stage
over them with the ``tp`` policy's chooser (``tp_lookahead`` applies). Data parallelism
across scale units comes from ``runtime_ngpus``, as for every policy.

Where to cut (``pipeline_balance='compute'``): every op gets a cost (the product of the sizes of the dims its
annotation iterates over: its outputs' dims and the dims it contracts or sums; the
elements it writes for an op without annotation), and the cut points minimize the cost of the most
expensive stage. Cuts are only placed where a new *layer* starts (the module path up to
its first index, ``gpt.blocks.3``; an op of an enclosing module right after a layer, such
as the activation a container applies to each layer's output, stays with that layer),
unless there are too few layers for the stages.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from nnscaler.anno.parser import Reduce
from nnscaler.config import ComputeConfig
from nnscaler.graph import IRGraph
from nnscaler.ir import Graph, Op, tensors_in
from nnscaler.policies.common import (
    PolicyError,
    as_policy_graph,
    policy_config,
)

__all__ = ["PipelineOptions", "cut_points", "hybrid", "op_cost", "pipeline_options", "pp"]

_INTERLEAVED = "1f1b_interleaved"
BALANCES = ("compute", "parameters")


@attrs.frozen
class PipelineOptions:
    """The ``pas_config`` pipeline keys, checked."""

    nstages: int
    nmicros: int
    scheduler: str
    nvirtual: int
    balance: str = "compute"

    @property
    def total_stages(self) -> int:
        return self.nstages * self.nvirtual


def _positive(policy: str, cfg: Mapping[str, Any], key: str, default: int | None,
              meaning: str) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise PolicyError(
            f"policy {policy!r}: pas_config[{key!r}] ({meaning}) is required; set "
            f"ComputeConfig(pas_config={{{key!r}: ..., ...}})"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyError(f"policy {policy!r}: pas_config[{key!r}] is {meaning}, a positive "
                          f"int; got {value!r}")
    return value


def pipeline_options(config: ComputeConfig, policy: str, *, default_nstages: int | None
                     ) -> PipelineOptions:
    """The pipeline of ``config``: ``config.pipeline`` (micro-batches, scheduler) and the
    policy's own ``pas_config`` keys (stages); an unknown scheduler raises
    [`nnscaler.UnknownNameError`][nnscaler.errors.UnknownNameError], which lists the registered
    ones."""
    from nnscaler.schedule import get_schedule

    if not config.use_end2end:
        raise PolicyError(
            f"policy {policy!r} cuts the model into pipeline stages, which run over "
            f"micro-batches in train_step: the module must be end2end (forward(sample) "
            f"returns the loss first), but compute_config.use_end2end is False. Set "
            f"ComputeConfig(use_end2end=True), or use a policy without a pipeline ('tp', "
            f"'data')"
        )
    cfg = config.pas_config
    nstages = _positive(policy, cfg, "pipeline_nstages", default_nstages,
                        "the number of pipeline stages")
    nmicros = _positive(policy, cfg, "pipeline_nmicros", config.pipeline.nmicros,
                        "the number of micro-batches of each train_step")
    scheduler = config.pipeline.scheduler
    get_schedule(scheduler)  # fails here, listing the registered schedules
    nvirtual = _positive(policy, cfg, "pipeline_nvirtual",
                         2 if scheduler == _INTERLEAVED else 1, "the stages per pipeline device")
    balance = cfg.get("pipeline_balance", "compute")
    if balance not in BALANCES:
        raise PolicyError(
            f"policy {policy!r}: pas_config['pipeline_balance'] is what the stages are "
            f"balanced on, one of {list(BALANCES)}; got {balance!r}"
        )
    return PipelineOptions(nstages=nstages, nmicros=nmicros, scheduler=scheduler,
                           nvirtual=nvirtual, balance=balance)


# -- where to cut ---------------------------------------------------------------------------
def op_cost(op: Op) -> float:
    """A compute estimate of ``op``: the product of the sizes of the dims its annotation
    iterates over (its outputs' dims, dims it sums (``+``) and dims two of its inputs
    share and contract), or the elements it writes."""
    anno = op.anno
    if anno is not None:
        names: set[str] = set()
        for t in anno.expanded.outputs:
            for dim in t.dims or ():
                names.update(i.name for i in getattr(dim, "idents", ()))
        readers: dict[str, int] = {}  # identifier -> how many inputs carry it
        for t in anno.expanded.inputs:
            seen: set[str] = set()
            for dim in t.dims or ():
                for i in getattr(dim, "idents", ()):
                    if i.reduce is Reduce.SUM:
                        names.add(i.name)
                    seen.add(i.name)
            for name in seen:
                readers[name] = readers.get(name, 0) + 1
        # a dim two inputs share and the output drops is contracted (linear's k); one
        # that a single input drops is looked up or mixed (an embedding's vocabulary)
        names.update(n for n, count in readers.items() if count > 1)
        sizes = [anno.sizes[n] for n in names if n in anno.sizes]
        if sizes:
            return float(math.prod(sizes))
    return float(sum(t.full.numel for t in tensors_in(op.outputs)) or 1)


def _layer(op: Op) -> str:
    """The module path up to its first index: ``gpt.blocks.3.attn.q_proj`` ->
    ``gpt.blocks.3``."""
    parts = op.module_path.split(".") if op.module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return op.module_path


def _inside(path: str, parent: str) -> bool:
    """``path`` is a module inside ``parent`` (an op of ``parent`` right after one of
    ``path`` continues what the child did, e.g. the activation a container applies after
    each layer: no cut between them)."""
    return parent == "" or path.startswith(parent + ".")


def _compute_costs(ops: list[Op], bounds: list[int]) -> Callable[[int, int], float]:
    """``cost(a, b)``: the summed [`op_cost`][nnscaler.policies.pipeline.op_cost] of the
    ops from ``bounds[a]`` to ``bounds[b]``."""
    prefix = [0.0]
    for op in ops:
        prefix.append(prefix[-1] + op_cost(op))
    at = [prefix[b] for b in bounds]
    return lambda a, b: at[b] - at[a]


def _parameter_costs(ops: list[Op], bounds: list[int]) -> Callable[[int, int], float]:
    """``cost(a, b)``: the elements of the distinct parameters the ops from ``bounds[a]``
    to ``bounds[b]`` read; a parameter two stages read counts in both (each holds it)."""
    reads = [{t.full.root for t in tensors_in(op.inputs) if t.full.is_param} for op in ops]
    m = len(bounds)
    table = array("d", bytes(8 * m * m))  # row a, column b
    for a in range(m):
        seen: set = set()
        total = 0.0
        b = a + 1
        for i in range(bounds[a], bounds[-1]):
            for p in reads[i] - seen:
                seen.add(p)
                total += p.numel
            while b < m and bounds[b] == i + 1:
                table[a * m + b] = total
                b += 1
    return lambda a, b: table[a * m + b]


def cut_points(ops: list[Op], nstages: int, policy: str = "pp",
               balance: str = "compute") -> list[int]:
    """The positions in ``ops`` where stages ``1 .. nstages-1`` start: the cuts that
    minimize the cost of the most expensive stage (its compute, or with ``balance=
    'parameters'`` the parameters it holds), where a new layer starts when there are
    enough of them."""
    n = len(ops)
    if nstages > n:
        raise PolicyError(f"policy {policy!r}: cannot cut {n} ops into {nstages} pipeline "
                          f"stages; use at most {n} stages")
    if nstages == 1:
        return []
    layers = [_layer(op) for op in ops]
    allowed = [i for i in range(1, n)
               if layers[i] != layers[i - 1] and not _inside(layers[i - 1], layers[i])]
    if len(allowed) < nstages - 1:
        allowed = list(range(1, n))
    bounds = [0, *allowed, n]
    m = len(bounds)
    segment = (_parameter_costs if balance == "parameters" else _compute_costs)(ops, bounds)
    inf = float("inf")
    # best[j][b]: the least max stage cost of the ops before bounds[b] in j stages
    best = [[inf] * m for _ in range(nstages + 1)]
    back = [[0] * m for _ in range(nstages + 1)]
    best[0][0] = 0.0
    for j in range(1, nstages + 1):
        for b in range(1, m):
            for a in range(b):
                if best[j - 1][a] == inf:
                    continue
                cost = max(best[j - 1][a], segment(a, b))
                if cost < best[j][b]:
                    best[j][b], back[j][b] = cost, a
    cuts = []
    b = m - 1
    for j in range(nstages, 0, -1):
        b = back[j][b]
        cuts.append(bounds[b])
    cuts = sorted(cuts)[1:]  # drop the start of stage 0
    if len(cuts) != nstages - 1 or len(set(cuts)) != len(cuts):
        raise PolicyError(f"policy {policy!r}: could not cut the {n} ops into {nstages} "
                          f"stages")
    return cuts


def _stage(g: IRGraph, nstages: int, policy: str, balance: str = "compute") -> None:
    ops = g.nodes()
    cuts = cut_points(ops, nstages, policy, balance)
    g.staging([ops[0], *(ops[c] for c in cuts)])


# -- the policies ---------------------------------------------------------------------------
def pp(graph: Graph, compute_config: ComputeConfig) -> IRGraph:
    """Pipeline parallelism: ``pipeline_nstages`` (default ``plan_ngpus``) pipeline
    devices, one device each, ``pipeline_nvirtual`` stages per device; see the module
    docstring for the ``pas_config`` keys."""
    config = policy_config(compute_config, "pp")
    n = config.plan_ngpus
    opts = pipeline_options(config, "pp", default_nstages=n)
    if opts.nstages > n:
        raise PolicyError(
            f"policy 'pp': pas_config['pipeline_nstages'] asks for {opts.nstages} pipeline "
            f"stages, but the scale unit has plan_ngpus={n} devices and each stage needs a "
            f"device of its own. Use pipeline_nstages <= {n}, raise plan_ngpus to "
            f"{opts.nstages}, or run several stages per device with "
            f"pas_config['pipeline_nvirtual']"
        )
    if opts.nstages != n:
        raise PolicyError(
            f"policy 'pp' runs one pipeline stage per device, so pipeline_nstages must be "
            f"plan_ngpus={n}; got {opts.nstages}. Use pipeline_nstages={n}, or the 'hybrid' "
            f"policy to give each of {opts.nstages} stages {n // opts.nstages or 1} devices"
        )
    g = as_policy_graph(graph)
    _stage(g, opts.total_stages, "pp", opts.balance)
    for op in g.nodes():
        g.assign(op, (op.stage or 0) % opts.nstages)
    g.check(n)
    return g


def hybrid(graph: Graph, compute_config: ComputeConfig) -> IRGraph:
    """Pipeline stages with tensor parallelism inside each: ``pipeline_nstages``
    pipeline devices of ``plan_ngpus / pipeline_nstages`` devices each, every op of a
    stage split over its devices by the ``tp`` chooser; see the module docstring."""
    from nnscaler.policies.tensor_parallel import DEFAULT_LOOKAHEAD, _Greedy, get_bytes_per_mac

    config = policy_config(compute_config, "hybrid")
    n = config.plan_ngpus
    opts = pipeline_options(config, "hybrid", default_nstages=None)
    if opts.nstages > n:
        raise PolicyError(
            f"policy 'hybrid': pas_config['pipeline_nstages'] asks for {opts.nstages} "
            f"pipeline stages, but the scale unit has plan_ngpus={n} devices and each stage "
            f"needs at least one of its own. Use pipeline_nstages <= {n} (a divisor of "
            f"{n}), or raise plan_ngpus"
        )
    if n % opts.nstages:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise PolicyError(
            f"policy 'hybrid' gives each of pipeline_nstages={opts.nstages} pipeline stages "
            f"the same number of devices, so it must divide plan_ngpus={n}; use one of "
            f"{divisors}"
        )
    k = n // opts.nstages
    lookahead = config.pas_config.get("tp_lookahead", DEFAULT_LOOKAHEAD)
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise PolicyError(f"policy 'hybrid': pas_config['tp_lookahead'] is an int >= 0, got "
                          f"{lookahead!r}")
    g = as_policy_graph(graph)
    _stage(g, opts.total_stages, "hybrid", opts.balance)
    if k == 1:
        for op in g.nodes():
            g.assign(op, 0)
    else:
        # every stage's ops over devices 0 .. k-1, as tensor parallelism on k devices; a
        # tensor crossing a boundary keeps its layout lane by lane, so the chooser's view of
        # one k-device unit is what each stage sees
        greedy = _Greedy(g, k, lookahead, get_bytes_per_mac(config, "hybrid"))
        for op in g.nodes():
            greedy.place(op)
    for op in g.nodes():
        base = ((op.stage or 0) % opts.nstages) * k
        g.assign(op, base + (op.device or 0))
    g.check(n)
    return g
