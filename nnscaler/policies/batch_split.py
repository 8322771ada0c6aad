"""``data``: the batch split across the ``plan_ngpus`` devices of one scale unit.

The batch dim starts at dim 0 of every tensor forward argument (``pas_config`` key
``batch_dims`` changes that per argument) and is followed through the graph in program
order: an op that reads a tensor along its batch dim is split on that dim (through its
transform space, the split whose identifier the most batch-carrying inputs carry there),
and each output the split cuts (``S(d)``) carries the batch at ``d``. Ops that read no
batch-carrying tensor (the position embedding, a mask built from constants), or whose
batch dim cannot be split (a mean-reduced loss marks it ``^``), are replicated on every
device; the adapters gather their inputs. A mean ``cross_entropy`` splits all the same,
inside `token_split`: each part sums and counts its own samples' losses, and one
all-reduce of the two numbers gives every part the whole mean. Part ``p`` runs on device
``p``. With ``expert_parallel`` the experts of every MoE layer are split over the devices
too (`nnscaler.policies.experts`).

When every op reads the batch this is data parallelism: each parameter is held whole on
every device (its first reader reads it replicated) and its gradient stays in value
parts, one per device, that no adapter sums; the reducer sums them once, in its buckets,
over the unit's devices and the other units together. The program is ``dp``'s, plus the
local slicing of the forward arguments and the loss's all-reduce of two numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nnscaler.anno import Split, Transform
from nnscaler.config import ComputeConfig
from nnscaler.graph import IRGraph, PartitionError
from nnscaler.ir import FullTensor, Graph, Op, SubTensor, tensors_in
from nnscaler.ops.builtin.token_loss import token_split
from nnscaler.policies.common import (
    PolicyError,
    as_policy_graph,
    assign_parts,
    policy_config,
)
from nnscaler.policies.experts import (
    expert_parallel_option,
    expert_transform,
    is_moe,
    require_moe_layers,
)

__all__ = ["batch_dims_of_inputs", "data"]


def _argument(name: str) -> str:
    """The forward argument a tensor input comes from: ``batch['x']`` -> ``batch``."""
    return name.split("[", 1)[0].split(".", 1)[0]


def batch_dims_of_inputs(graph: IRGraph, batch_dims: Any, ndevices: int) -> dict[FullTensor, int]:
    """The batch dim of each tensor forward argument: dim 0, unless ``batch_dims`` (from
    ``pas_config``) names it: ``{name: dim or None}``, ``name`` a whole argument
    (``'batch'``) or one tensor of it (``"batch['input_ids']"``, as ``str(tensor)`` of the
    graph's inputs shows); ``None``: no batch dim. Every batch dim must divide by
    ``ndevices``."""
    if batch_dims is None:
        batch_dims = {}
    if not isinstance(batch_dims, Mapping):
        raise PolicyError(
            f"policy 'data': pas_config['batch_dims'] maps forward arguments to their batch "
            f"dim, e.g. {{'batch': 0, \"batch['mask']\": None}}; got {type(batch_dims).__name__} "
            f"{batch_dims!r}"
        )
    inputs = [t.full for t in graph.input_tensors()]
    names = {full: (full.names[0] if full.names else full.name) for full in inputs}
    known = set(names.values()) | {_argument(n) for n in names.values()}
    unknown = sorted(str(k) for k in batch_dims if k not in known)
    if unknown:
        raise PolicyError(
            f"policy 'data': pas_config['batch_dims'] names {unknown}, which are not tensor "
            f"arguments of the forward; the tensor arguments are {sorted(set(names.values()))} "
            f"(or their argument names {sorted({_argument(n) for n in names.values()})}). "
            f"Use one of those names."
        )
    found: dict[FullTensor, int] = {}
    for full in inputs:
        name = names[full]
        dim = batch_dims.get(name, batch_dims.get(_argument(name), 0))
        if dim is None or full.ndim == 0:
            continue
        if isinstance(dim, bool) or not isinstance(dim, int) or not -full.ndim <= dim < full.ndim:
            raise PolicyError(
                f"policy 'data': the batch dim of {name} (shape {list(full.shape)}) must be an "
                f"int in [{-full.ndim}, {full.ndim}) or None (no batch dim); got {dim!r}. Fix "
                f"pas_config['batch_dims']."
            )
        dim %= full.ndim
        if full.shape[dim] % ndevices:
            raise PolicyError(
                f"policy 'data': the batch dim {dim} of {name} (shape {list(full.shape)}) has "
                f"size {full.shape[dim]}, which {ndevices} devices cannot split evenly. Use a "
                f"batch size divisible by plan_ngpus={ndevices}, or, if dim {dim} is not its "
                f"batch dim, say which is in pas_config={{'batch_dims': {{{name!r}: <dim or "
                f"None>}}}}."
            )
        found[full] = dim
    if inputs and not found:
        raise PolicyError(
            f"policy 'data': no forward argument has a batch dim (arguments: "
            f"{sorted(set(names.values()))}), so there is nothing to split. Name one in "
            f"pas_config['batch_dims'], or use the 'dp' policy."
        )
    return found


def _batch_transform(op: Op, batch: dict[FullTensor, int], num: int) -> Transform | None:
    """The split of ``op`` along the batch dim of the most batch-carrying inputs."""
    if op.anno is None or op.opdef is None:
        return None
    best: tuple[int, Transform] | None = None
    for t in op.anno.transform_space(num, rules=op.opdef.rules_for(op.anno)):
        along = sum(1 for x, layout in zip(op.inputs, t.inputs)
                    if isinstance(x, SubTensor) and x.full in batch
                    and layout == Split(batch[x.full]))
        if along and (best is None or along > best[0]):
            best = (along, t)
    return None if best is None else best[1]


def _follow(op: Op, t: Transform, batch: dict[FullTensor, int]) -> None:
    """Record where the batch went in the outputs (and in-place writes) of ``op``."""
    for x, layout in zip(tensors_in(op.outputs), t.outputs):
        if isinstance(layout, Split):
            batch[x.full] = layout.dim
    positions = {x: k for k, x in enumerate(op.inputs) if isinstance(x, SubTensor)}
    for before, after in op.mutations:
        k = positions.get(before)
        layout = None if k is None else t.inputs[k]
        if isinstance(layout, Split) and after.full not in batch:
            batch[after.full] = layout.dim


def data(graph: Graph, compute_config: ComputeConfig) -> IRGraph:
    """Split the batch across ``compute_config.plan_ngpus`` devices (see the module
    docstring). ``pas_config`` options: ``batch_dims`` (``{argument: dim or None}``),
    ``expert_parallel`` (bool: split the experts of MoE layers over the devices too)."""
    config = policy_config(compute_config, "data")
    n, cfg = config.plan_ngpus, config.pas_config
    g = as_policy_graph(graph)
    batch = batch_dims_of_inputs(g, cfg.get("batch_dims"), n)
    experts = expert_parallel_option(cfg, "data")
    if experts:
        require_moe_layers(g.nodes(), "data")
    with token_split():
        _place(g, batch, n, experts)
    g.check(n)
    return g


def _place(g: IRGraph, batch: dict[FullTensor, int], n: int, experts: bool) -> None:
    for op in g.nodes():
        if n == 1:
            g.assign(op, 0)
            continue
        t = expert_transform(op, n, "data") if experts and is_moe(op) else \
            _batch_transform(op, batch, n)
        parts = None
        if t is not None:
            try:
                parts = g.partition(op, idx=t.idx, dim=t.dim, num=n)
            except PartitionError:  # e.g. an in-place write through a view: replicate
                parts = None
            else:
                _follow(op, t, batch)
        if parts is None:
            parts = g.replicate(op, n)
        assign_parts(g, parts)
