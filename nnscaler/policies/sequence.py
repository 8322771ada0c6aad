"""``sequence``: context parallelism, the sequence split across the ``plan_ngpus`` devices.

The sequence dim starts at dim 1 of every tensor forward argument with two or more dims
(``pas_config`` key ``sequence_dims`` changes that per argument, as ``batch_dims`` does for
``data``) and is followed through the graph in program order, as ``data`` follows the
batch: norms, linears, the MLP, RoPE and the residual adds run on each device's chunk of
the sequence. Tensors built from constants (positions, the rotary tables, a causal mask)
are replicated and each consumer reads the slice of its chunk, so every chunk gets its
own position offsets. Self-attention (``scaled_dot_product_attention``) is split by the
rules of `nnscaler.ops.builtin.context_parallel`: ``pas_config['attention']`` is
``'ring'`` (the default; zigzag balanced when causal and the sequence divides by twice the
devices) or ``'ulysses'``. A mean cross-entropy over tokens that carry the sequence (a
batch of one, flattened) splits too, its parts all-reducing their sums and counts
(`nnscaler.ops.builtin.token_loss`); over a flattened batch of several sequences the
tokens of a chunk are not contiguous, so the logits are gathered for the loss.

Data parallelism composes through the scale units (``runtime_ngpus = k * plan_ngpus``).

Tensor parallelism composes inside the unit with ``pas_config['tensor_parallel']`` (or
Megatron's name, ``tensor_model_parallel_size``): ``tp`` dividing ``plan_ngpus``, the
sequence is split over ``plan_ngpus / tp`` devices and every op over ``tp`` first. That
plan is the ``megatron`` policy's tensor x context parallelism (attention by heads,
linears by columns and rows, the loss by the vocabulary, then each tensor-parallel part
along the sequence: `split_sequence_within`), so the policy hands it to ``megatron``
(``plugins/policy_megatron``) with the sizes, ``sequence_dims`` and the attention
strategy translated, rather than keep a second copy of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from nnscaler.config import ComputeConfig
from nnscaler.graph import IRGraph, PartitionError
from nnscaler.ir import Graph, Op, SubTensor
from nnscaler.ops.builtin.token_loss import token_split
from nnscaler.policies.batch_split import _batch_transform, _follow, batch_dims_of_inputs
from nnscaler.policies.common import PolicyError, as_policy_graph, assign_parts, policy_config
from nnscaler.registry import active_registry

__all__ = ["ATTENTION_STRATEGIES", "SDPA", "attention_split", "sequence", "split_sequence",
           "split_sequence_within"]

SDPA = "torch.nn.functional.scaled_dot_product_attention"
#: ``pas_config['attention']`` -> the input whose sequence dim the split names
ATTENTION_STRATEGIES = {"ring": 1, "ulysses": 2}


def attention_split(graph: IRGraph, op: Op, num: int, strategy: str = "ring") -> list[Op]:
    """Split the self-attention ``op`` along the sequence in ``num`` parts by
    ``strategy`` (``'ring'``: zigzag when causal and the sequence divides by ``2 num``;
    ``'ulysses'``: the heads must divide by ``num``); returns the parts."""
    if strategy not in ATTENTION_STRATEGIES:
        raise PolicyError(f"attention split: strategy is one of {sorted(ATTENTION_STRATEGIES)}, "
                          f"got {strategy!r}")
    idx = ATTENTION_STRATEGIES[strategy]
    x = op.inputs[idx] if idx < len(op.inputs) else None
    if not isinstance(x, SubTensor) or x.ndim < 2:
        raise PolicyError(f"attention split: {graph.describe(op)} has no key/value tensor "
                          f"argument at position {idx}")
    if strategy == "ulysses":
        heads = [t.shape[-3] for t in op.inputs[:3] if isinstance(t, SubTensor) and t.ndim >= 3]
        if len(heads) < 3 or any(h % num for h in heads):
            raise PolicyError(
                f"attention split: Ulysses gives each of the {num} devices whole heads, but "
                f"{graph.describe(op)} has {heads or 'no'} query/key/value heads. Use "
                f"pas_config['attention']='ring', or a degree that divides the heads")
    return graph.partition(op, idx=idx, dim=x.ndim - 2, num=num)


def _sequence_dims(g: IRGraph, dims: Any, n: int) -> dict:
    """The sequence dim of each tensor argument (dim 1 unless ``dims`` says otherwise);
    arguments with fewer than two dims carry none."""
    defaults = {str(x.full.names[0] if x.full.names else x.full.name): None
                for x in g.input_tensors() if x.full.ndim < 2}
    given = {**defaults, **({} if dims is None else dict(dims))}
    for x in g.input_tensors():
        name = x.full.names[0] if x.full.names else x.full.name
        given.setdefault(name, 1)
    try:
        return batch_dims_of_inputs(g, given, n)
    except PolicyError as e:
        raise PolicyError(str(e).replace("policy 'data'", "policy 'sequence'")
                          .replace("batch_dims", "sequence_dims")
                          .replace("batch dim", "sequence dim")
                          .replace("batch size", "sequence length")) from None


def _is_self_attention(op: Op) -> bool:
    if op.name != SDPA or len(op.inputs) < 3:
        return False
    q, k, v = op.inputs[:3]
    return all(isinstance(t, SubTensor) and t.ndim >= 2 for t in (q, k, v)) and (
        q.shape[-2] == k.shape[-2] == v.shape[-2])


def sequence(graph: Graph, compute_config: ComputeConfig) -> IRGraph:
    """Split the sequence across ``compute_config.plan_ngpus`` devices (see the module
    docstring). ``pas_config``: ``sequence_dims`` (``{argument: dim or None}``),
    ``attention`` (``'ring'`` or ``'ulysses'``) and ``tensor_parallel`` (a divisor of
    ``plan_ngpus``, default 1; with ``sequence_parallel``, Megatron's)."""
    config = policy_config(compute_config, "sequence")
    n, cfg = config.plan_ngpus, config.pas_config
    tp = _tensor_degree(cfg, n)
    if tp > 1:
        return _tensor_and_context(graph, config, tp)
    g = as_policy_graph(graph)
    for _, parts in split_sequence(g, n, strategy=cfg.get("attention", "ring"),
                                   sequence_dims=cfg.get("sequence_dims")):
        assign_parts(g, parts)
    g.check(n)
    return g


#: the names ``pas_config`` may give the tensor-parallel degree by (the second is Megatron's)
TENSOR_KEYS = ("tensor_parallel", "tensor_model_parallel_size")
#: the attention strategy -> Megatron's ``cp_comm_type``
_CP_COMM = {"ring": "p2p", "ulysses": "a2a"}


def _tensor_degree(cfg: dict, n: int) -> int:
    """The tensor-parallel degree ``pas_config`` asks for (1 when it names none)."""
    given = {k: cfg[k] for k in TENSOR_KEYS if k in cfg}
    if len(set(map(repr, given.values()))) > 1:
        raise PolicyError(f"policy 'sequence': pas_config gives the tensor-parallel degree "
                          f"twice, differently: {given}. Give one of {list(given)}")
    key, tp = next(iter(given.items()), ("tensor_parallel", 1))
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or n % tp:
        raise PolicyError(
            f"policy 'sequence': pas_config[{key!r}] is the tensor-parallel degree inside "
            f"the scale unit, a divisor of plan_ngpus={n} (the sequence is split over "
            f"plan_ngpus / {key}); got {tp!r}. Give one of "
            f"{[d for d in range(1, n + 1) if n % d == 0]}")
    return tp


def _tensor_and_context(graph: Graph, config: ComputeConfig, tp: int) -> IRGraph:
    """Tensor x context parallelism: the ``megatron`` policy's plan of these sizes."""
    cfg, n = config.pas_config, config.plan_ngpus
    policies = active_registry("policies")
    if "megatron" not in policies:
        raise PolicyError(
            f"policy 'sequence' with a tensor-parallel degree ({tp} of plan_ngpus={n}) "
            f"plans with the 'megatron' policy's tensor x context parallelism, which is not "
            f"installed. Fix: pip install ./plugins/policy_megatron, or drop the "
            f"tensor-parallel degree")
    strategy = cfg.get("attention", "ring")
    if strategy not in ATTENTION_STRATEGIES:
        raise PolicyError(f"policy 'sequence': pas_config['attention'] is one of "
                          f"{sorted(ATTENTION_STRATEGIES)}, got {strategy!r}")
    pas = {"tensor_model_parallel_size": tp, "context_parallel_size": n // tp,
           "cp_comm_type": _CP_COMM[strategy], "use_distributed_optimizer": config.use_zero}
    for key in ("sequence_dims", "sequence_parallel"):
        if key in cfg:
            pas[key] = cfg[key]
    return policies.get("megatron")(graph, dataclasses.replace(config, pas_config=pas))


def split_sequence(g: IRGraph, num: int, *, strategy: str = "ring",
                   sequence_dims: Any = None) -> list[tuple[Op, list[Op]]]:
    """Split every op of ``g`` that carries the sequence in ``num`` parts, as the
    ``sequence`` policy does (self-attention by ``strategy``, the loss over the tokens),
    and replicate the others ``num`` times; returns each op with its parts, in program
    order, for the caller to assign (part ``k`` to the ``k``-th device of its group).
    A policy that combines the sequence split with pipeline stages places each op's
    parts on the devices of the op's stage."""
    if strategy not in ATTENTION_STRATEGIES:
        raise PolicyError(f"policy 'sequence': pas_config['attention'] is one of "
                          f"{sorted(ATTENTION_STRATEGIES)}, got {strategy!r}")
    if num == 1:
        return [(op, g.replicate(op, 1)) for op in g.nodes()]
    seq = _sequence_dims(g, sequence_dims, num)
    with token_split():
        return [(op, _split(g, op, seq, num, strategy)) for op in g.nodes()]


def split_sequence_within(
    g: IRGraph, num: int, first: Callable[[Op], list[Op]], *, strategy: str = "ring",
    sequence_dims: Any = None,
) -> list[tuple[Op, list[list[Op]]]]:
    """Tensor x context parallelism inside one scale unit: every op of ``g`` is first
    replaced by ``first(op)`` (its tensor-parallel parts, or replicas: the caller's
    split), then each of those instances is split along the sequence in ``num`` parts as
    `split_sequence` splits an op (or replicated ``num`` times where it carries no
    sequence or cannot be split along it). Returns each op with, per instance of
    ``first``, its ``num`` sequence parts, in program order, for the caller to assign:
    the parts of one instance run on that instance's context-parallel devices.

    Attention split by heads first runs a ring (or Ulysses) among the sequence parts of
    each head part; a loss split by classes first (its parts talk) is replicated over
    the sequence parts, each replica talking to the replicas at its position."""
    if strategy not in ATTENTION_STRATEGIES:
        raise PolicyError(f"split_sequence_within: strategy is one of "
                          f"{sorted(ATTENTION_STRATEGIES)}, got {strategy!r}")
    seq = _sequence_dims(g, sequence_dims, num) if num > 1 else {}
    out: list[tuple[Op, list[list[Op]]]] = []
    with token_split():
        for op in g.nodes():
            insts = first(op)
            if num == 1:
                out.append((op, [g.replicate(inst, 1) for inst in insts]))
                continue
            out.append((op, [_split(g, inst, seq, num, strategy) for inst in insts]))
    return out


def _split(g: IRGraph, op: Op, seq: dict, n: int, strategy: str) -> list[Op]:
    carries = any(isinstance(x, SubTensor) and x.full in seq for x in op.inputs[:3])
    if carries and _is_self_attention(op):
        parts = attention_split(g, op, n, strategy)
        _follow_output(op, seq)
        return parts
    t = _batch_transform(op, seq, n)
    if t is not None:
        try:
            parts = g.partition(op, idx=t.idx, dim=t.dim, num=n)
        except PartitionError:  # an in-place write through a view: replicate
            pass
        else:
            _follow(op, t, seq)
            return parts
    return g.replicate(op, n)


def _follow_output(op: Op, seq: dict) -> None:
    out = op.output_tensors()
    if out:
        seq[out[0].full] = out[0].full.ndim - 2
