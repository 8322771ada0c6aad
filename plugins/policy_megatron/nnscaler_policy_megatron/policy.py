"""The ``megatron`` policy: Megatron-LM's parallelism for any traced transformer.

Steps, in this order (each needs the one before):

1. read the sizes (`nnscaler_policy_megatron.config`);
2. pipeline: cut the program into ``pp * vpp`` stages of whole transformer layers
   (a layer is an element of a module list: the module path up to its first index),
   the ops before the first layer (embeddings) in the first stage and those after the
   last (final norm, LM head, loss) in the last; stage ``s`` runs on pipeline rank
   ``s % pp``, as Megatron's interleaved schedule places virtual stages;
3. tensor parallelism: the regions of `nnscaler_policy_megatron.structure` split
   over the ``tp`` devices of their pipeline rank;
4. the other ops (norms, dropout, residual adds, the position embedding): with
   ``sequence_parallel``, split along the sequence where they carry it, so nnscaler
   moves the activations into a column linear with an all-gather and out of a row
   linear with a reduce-scatter; otherwise replicated, and a row linear's output is
   all-reduced.

With ``context_parallel_size`` (``cp``) and ``tp`` = 1, steps 3 and 4 are the
``sequence`` policy's split instead: every op of a stage that carries the sequence runs
on chunks of it over the ``cp`` devices of its pipeline rank, attention as ring
attention (zigzag when causal; Ulysses with ``cp_comm_type='a2a'``), and the others are
replicated there (`nnscaler.policies.sequence.split_sequence`). With ``tp`` > 1 too,
steps 3 and 4 run first and each tensor-parallel part (or replica) is then split along
the sequence over its own ``cp`` devices (``split_sequence_within``): device
``c * tp + t`` of a pipeline rank holds tensor part ``t`` of sequence chunk ``c``.

With ``expert_model_parallel_size`` (= ``tp``), every MoE layer's experts are split
over the tensor-parallel devices (`nnscaler.policies.experts`): each holds ``E / tp``
experts and the tokens move to them with an all-to-all. Without it (``tp`` > 1), every
expert is split by its intermediate units over the tensor-parallel devices, as Megatron
splits a dense MLP: each device runs every token through a slice of each chosen expert
and the slices' results are summed.

Data parallelism is the ``runtime_ngpus / plan_ngpus`` scale units, and the distributed
optimizer is ZeRO stage 1 (``use_zero``), both done by nnscaler's runtime. Parameter
matmuls the policy could not place in a region stay replicated; they are listed at
INFO on the logger ``nnscaler_policy_megatron``.
"""

from __future__ import annotations

import logging
from typing import Any

from nnscaler.extend import (
    ComputeConfig,
    Graph,
    IRGraph,
    Op,
    as_compute_config,
    expert_transform,
    ffn_transform,
    is_moe,
    require_moe_layers,
    split_sequence,
    split_sequence_within,
)
from nnscaler_policy_megatron.config import MegatronConfig, MegatronConfigError, read_config
from nnscaler_policy_megatron.structure import Region, find_regions, track_sequence

__all__ = ["MegatronPlan", "layer_of", "megatron", "plan"]

logger = logging.getLogger("nnscaler_policy_megatron")

_INTERLEAVED = "1f1b_interleaved"
SDPA = "torch.nn.functional.scaled_dot_product_attention"


def layer_of(op: Op) -> str | None:
    """The layer ``op`` belongs to: its module path up to the first list index
    (``model.layers.3.mlp`` -> ``model.layers.3``), or ``None`` outside any list."""
    parts = op.module_path.split(".") if op.module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


class MegatronPlan:
    """What the policy decided, kept for tests, docs and the INFO report: the regions,
    the ops split along the sequence, the replicated ones, and the stage of each layer."""

    def __init__(self, config: MegatronConfig) -> None:
        self.config = config
        self.regions: list[Region] = []
        self.sequence_split: list[Op] = []
        self.replicated: list[Op] = []
        self.unplaced: list[Op] = []  # parameter matmuls left whole
        self.expert_split: list[Op] = []  # MoE layers split by their experts
        self.ffn_split: list[Op] = []  # MoE layers split by their experts' intermediate units
        self.stages: dict[str, int] = {}


def _as_graph(graph: Graph) -> IRGraph:
    if isinstance(graph, IRGraph):
        return graph
    return IRGraph.from_graph(graph)


def _stage(g: IRGraph, cfg: MegatronConfig, compute_config: ComputeConfig,
           plan: MegatronPlan) -> int:
    """Cut ``g`` into pipeline stages of whole layers; returns the number of stages."""
    ops = g.nodes()
    layers = list(dict.fromkeys(lay for op in ops if (lay := layer_of(op)) is not None))
    nlayers = len(layers)
    if cfg.layers_per_virtual_stage is not None:
        per_pipeline_rank = nlayers // cfg.pp if nlayers % cfg.pp == 0 else None
        if per_pipeline_rank is None or per_pipeline_rank % cfg.layers_per_virtual_stage:
            raise MegatronConfigError(
                f"policy 'megatron': num_layers_per_virtual_pipeline_stage="
                f"{cfg.layers_per_virtual_stage} must divide the {nlayers} layers / "
                f"pipeline_model_parallel_size={cfg.pp}"
            )
        vpp = per_pipeline_rank // cfg.layers_per_virtual_stage
    else:
        vpp = cfg.vpp or 1
    nstages = cfg.pp * vpp
    if nlayers % nstages:
        raise MegatronConfigError(
            f"policy 'megatron': the model has {nlayers} layers (found as the elements of "
            f"its module lists: {', '.join(layers[:4])}{', ...' if nlayers > 4 else ''}), "
            f"which does not split evenly into pipeline_model_parallel_size * "
            f"virtual_pipeline_model_parallel_size = {cfg.pp} * {vpp} = {nstages} stages. "
            f"Use sizes whose product divides {nlayers}"
        )
    scheduler = compute_config.pipeline.scheduler
    if vpp > 1 and scheduler != _INTERLEAVED:
        raise MegatronConfigError(
            f"policy 'megatron': {vpp} virtual stages per pipeline rank run with the "
            f"interleaved schedule; pas_config['pipeline_scheduler'] is {scheduler!r}. Set "
            f"pipeline_scheduler='{_INTERLEAVED}' or drop the virtual stages"
        )
    if compute_config.pipeline.nmicros is None:
        raise MegatronConfigError(
            f"policy 'megatron': pipeline_model_parallel_size={cfg.pp} runs each step as "
            f"micro-batches; set pas_config['pipeline_nmicros'] (Megatron's number of "
            f"micro-batches: global batch / (micro batch * data parallel))"
        )
    if not compute_config.use_end2end:
        raise MegatronConfigError(
            "policy 'megatron': pipeline stages run over micro-batches in train_step, so "
            "the module must be end2end; set ComputeConfig(use_end2end=True)"
        )
    per = nlayers // nstages
    plan.stages = {lay: i // per for i, lay in enumerate(layers)}
    starts = [ops[0]]
    seen: set[int] = {0}
    for op in ops:
        lay = layer_of(op)
        if lay is None:
            continue
        s = plan.stages[lay]
        if s not in seen:
            seen.add(s)
            starts.append(op)
    g.staging(starts)
    return nstages


def plan(graph: Graph, compute_config: ComputeConfig) -> tuple[IRGraph, MegatronPlan]:
    """The ``megatron`` policy, returning what it decided as well (see the module
    docstring)."""
    cfg = read_config(compute_config)
    compute_config = as_compute_config(compute_config)  # read_config checked it
    g = _as_graph(graph)
    result = MegatronPlan(cfg)
    if cfg.pp > 1:
        _stage(g, cfg, compute_config, result)
    if cfg.cp > 1 and cfg.tp == 1:
        _split_context(g, cfg, compute_config, result)
        g.check(cfg.plan_ngpus)
        return g, result
    tp = cfg.tp
    ops = g.nodes()
    choices: dict[Op, Any] = {}
    if tp > 1:
        result.regions = find_regions(g, tp)
        for region in result.regions:
            choices.update(region.choices)
    seq_along: dict[Op, Any] = {}
    if cfg.sequence_parallel:
        _, seq_along = track_sequence(g, tp)
    if cfg.ep > 1:
        require_moe_layers(ops, "megatron")
    if cfg.cp > 1:
        _split_tensor_context(g, cfg, compute_config, result, choices, seq_along)
    else:
        for op in ops:
            parts = _tensor_parts(g, op, cfg, choices, seq_along, result)
            base = ((op.stage or 0) % cfg.pp) * tp
            for k, part in enumerate(parts):
                g.assign(part, base + k)
    for op in result.unplaced:
        logger.info("megatron: op #%d %s in %s (%s) stays replicated on the %d "
                    "tensor-parallel devices: no column or row split of it closes a region",
                    op.oid, op.name, op.module_path or "<root>", op.short_source, tp)
    for region in result.regions:
        for full in region.cut:
            logger.info("megatron: the region of op #%d %s in %s reads %s cut from its "
                        "whole value (its producer cannot write it split)", region.seed.oid,
                        region.seed.name, region.seed.module_path, full.name)
    g.check(cfg.plan_ngpus)
    return g, result


def _tensor_parts(g: IRGraph, op: Op, cfg: MegatronConfig, choices: dict[Op, Any],
                  seq_along: dict[Op, Any], result: MegatronPlan) -> list[Op]:
    """``op`` split (or replicated) over the ``tp`` devices of its pipeline rank."""
    tp = cfg.tp
    if cfg.ep > 1 and is_moe(op):
        t = expert_transform(op, cfg.ep, "megatron")
        result.expert_split.append(op)
        return g.partition(op, idx=t.idx, dim=t.dim, num=cfg.ep)
    if tp > 1 and is_moe(op):
        t = ffn_transform(op, tp, "megatron")
        result.ffn_split.append(op)
        return g.partition(op, idx=t.idx, dim=t.dim, num=tp)
    if op in choices:
        t = choices[op]
        return g.partition(op, idx=t.idx, dim=t.dim, num=tp)
    if op in seq_along:
        t = seq_along[op]
        result.sequence_split.append(op)
        return g.partition(op, idx=t.idx, dim=t.dim, num=tp)
    result.replicated.append(op)
    if tp > 1 and any(x.full.is_leaf and x.full.is_param and x.full.ndim == 2
                      for x in op.input_tensors()):
        result.unplaced.append(op)
    return g.replicate(op, tp)


def _split_tensor_context(g: IRGraph, cfg: MegatronConfig, compute_config: ComputeConfig,
                          plan: MegatronPlan, choices: dict[Op, Any],
                          seq_along: dict[Op, Any]) -> None:
    """Tensor x context parallelism in one pipeline rank: every op is first split over
    the ``tp`` devices (attention by heads; with ``sequence_parallel`` the ops between
    blocks along the sequence), then each tensor-parallel part along the sequence over
    its ``cp`` devices. Device ``base + c * tp + t`` holds tensor part
    ``t`` of sequence chunk ``c`` (Megatron's order, tensor ranks fastest), so the ring
    of head part ``t`` runs over the strided devices ``base + t, base + tp + t, ...``."""
    _check_attention(g, cfg, choices)
    dims = compute_config.pas_config.get("sequence_dims")
    split = split_sequence_within(
        g, cfg.cp, lambda op: _tensor_parts(g, op, cfg, choices, seq_along, plan),
        strategy=cfg.cp_strategy, sequence_dims=dims)
    for op, per_part in split:
        base = ((op.stage or 0) % cfg.pp) * cfg.tp * cfg.cp
        plan.sequence_split.append(op)
        for t, parts in enumerate(per_part):
            for c, part in enumerate(parts):
                g.assign(part, base + c * cfg.tp + t)


def _check_attention(g: IRGraph, cfg: MegatronConfig, choices: dict[Op, Any]) -> None:
    """Under tensor x context parallelism every self-attention splits by heads over the
    ``tp`` devices (a replicated attention would run the sequence split ``tp`` times
    over); Ulysses then needs each part's heads to divide by ``cp``."""
    for op in g.nodes():
        if op.name != SDPA or len(op.inputs) < 3:
            continue
        heads = [x.shape[-3] for x in op.input_tensors()[:3] if x.ndim >= 3]
        where = f"op #{op.oid} {op.name} in {op.module_path or '<root>'} ({op.short_source})"
        if op not in choices:
            raise MegatronConfigError(
                f"policy 'megatron': tensor_model_parallel_size={cfg.tp} with "
                f"context_parallel_size={cfg.cp} splits every attention by heads first, but "
                f"{where} has {heads[:1] or 'no'} query and {heads[1:2] or 'no'} key/value "
                f"heads, which {cfg.tp} does not divide (or its projections could not be "
                f"split by whole heads). Set tensor_model_parallel_size to a divisor of the "
                f"key/value heads, or context_parallel_size=1")
        if cfg.cp_strategy == "ulysses" and any((h // cfg.tp) % cfg.cp for h in heads):
            raise MegatronConfigError(
                f"policy 'megatron': cp_comm_type='a2a' (Ulysses) gives each of the "
                f"context_parallel_size={cfg.cp} devices whole heads of its tensor-parallel "
                f"part, but {where} has {heads} query/key/value heads, "
                f"{[h // cfg.tp for h in heads]} per part of tensor_model_parallel_size="
                f"{cfg.tp}, which {cfg.cp} does not divide. Use cp_comm_type='p2p' (ring "
                f"attention), or sizes with tp * cp dividing the key/value heads")


def _split_context(g: IRGraph, cfg: MegatronConfig, compute_config: ComputeConfig,
                   plan: MegatronPlan) -> None:
    """Context parallelism: the sequence split over the ``cp`` devices of each pipeline
    rank (``tp`` is 1, which `read_config` checked)."""
    dims = compute_config.pas_config.get("sequence_dims")
    for op, parts in split_sequence(g, cfg.cp, strategy=cfg.cp_strategy, sequence_dims=dims):
        base = ((op.stage or 0) % cfg.pp) * cfg.cp
        plan.sequence_split.append(op)
        for k, part in enumerate(parts):
            g.assign(part, base + k)


def megatron(graph: Graph, compute_config: ComputeConfig) -> IRGraph:
    """Megatron-LM's tensor (+ sequence), pipeline and data parallelism, configured by
    ``pas_config`` in Megatron's vocabulary (see `nnscaler_policy_megatron`)."""
    return plan(graph, compute_config)[0]
