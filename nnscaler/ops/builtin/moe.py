"""Mixture-of-experts: the routed experts of an MoE layer as one op, and its expert-parallel
split.

`moe_experts` computes what the expert stack of Hugging Face's Mixtral, Qwen2-MoE and
Qwen3-MoE computes (``experts(hidden, top_k_index, top_k_weights)``): each token goes
through its ``k`` chosen experts, a gated MLP each (``down(act(gate(x)) * up(x))``, the
weights stacked as ``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]``), and the
results are summed with the router's weights. The router stays outside the op, so its
logits, its auxiliary loss and its top-k are ordinary traced ops.

Three splits; the first and the last share the token dim ``t``:

- **data parallel** (the first rule): every part holds every expert and runs its own tokens;
- **tensor parallel inside the experts** (`ffn_parallel_moe`, the rule for a split of
  the experts' intermediate dim ``f``): every part runs every token through every chosen
  expert, on slice ``p`` of the expert's ``F`` intermediate units: gate rows and up rows
  ``[p F/n, (p+1) F/n)`` of ``gate_up_proj`` and the same columns of ``down_proj``; the
  parts' outputs sum to the layer's (value-partial). A part's gate and up rows are two
  blocks of the fused dim ``2F``, and a layout holds one block per dim, so the op also
  takes ``gate_up_proj`` *viewed* as ``[E, 2, F, H]`` (`gate_up_view`): there ``f`` is a
  dim of its own, and slice ``p`` of it is one block holding exactly the part's gate rows
  (index 0 of the ``2``) and up rows (index 1). The tracer hands the op that view of an
  expert weight only the op reads (`nnscaler.trace.moe`), so the weight is split in
  memory; checkpoints keep the model's ``[E, 2F, H]`` (a row-major reshape, exact both
  ways). Given the fused ``[E, 2F, H]`` instead (a weight something else reads too), the
  split keeps it whole on every part, which slices it;
- **expert parallel** (`expert_parallel_moe`, a collective part op): part ``p`` holds the
  ``E / n`` experts ``[p E/n, (p+1) E/n)`` and its slice of the tokens. It counts its
  token-expert pairs per expert, all-gathers the counts (the sizes), sends every pair's
  token to the part holding the expert with an all-to-all of uneven sizes, runs its
  experts on what it received (one matmul per expert on a contiguous block), sends the
  results back with the reverse all-to-all and adds them with the router weights. The
  backward is the same exchanges the other way, so each expert's gradient is whole on its
  part and the router weights' gradients stay local.

Dropless by default. ``capacity_factor=c`` caps each expert at ``ceil(c * T * k / E)``
pairs of the ``T`` tokens of the whole batch, kept in token order (so a split keeps exactly
the pairs the whole op keeps); when that would drop a pair the op raises `MoEError`
unless ``drop_tokens=True``, and the count dropped is reported (`record_routing`).
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nnscaler.anno import Reduce, Replicate, Split, TransformRule, ValuePartial
from nnscaler.anno.partgroup import SINGLE, PartGroup
from nnscaler.errors import MoEError
from nnscaler.ops.registry import OpRegistry, make_recording_wrapper

__all__ = [
    "ACTIVATIONS",
    "EXPERT_PARALLEL",
    "FFN_PARALLEL",
    "MoEError",
    "RoutingRecord",
    "expert_parallel_moe",
    "ffn_parallel_moe",
    "fused_gate_up",
    "gate_up_view",
    "moe_experts",
    "record_routing",
    "routed_experts",
    "routing_metrics",
]

#: The part op of the expert-parallel split.
EXPERT_PARALLEL = "nnscaler.ops.builtin.moe.expert_parallel_moe"
MOE_EXPERTS = "nnscaler.ops.builtin.moe.moe_experts"
#: The part op of the tensor-parallel split (every expert's intermediate dim in slices).
FFN_PARALLEL = "nnscaler.ops.builtin.moe.ffn_parallel_moe"

#: The experts' activations by name (Hugging Face's ``hidden_act`` spellings).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


# -- what each call routed (observability) -------------------------------------------------


@dataclass
class RoutingRecord:
    """What one call of an MoE layer routed, on this part.

    ``tokens_per_expert[e]``: the token-expert pairs of the *whole batch* (every part's)
    routed to expert ``e``; ``tokens_per_part[q]``: the pairs part ``q`` runs (its experts'
    share, after drops); ``dropped``: pairs over capacity, in the whole batch.
    """

    layer: str
    tokens_per_expert: list[int]
    tokens_per_part: list[int]
    dropped: int = 0

    @property
    def imbalance(self) -> float:
        """The busiest part's pairs over the mean (1.0: perfectly balanced)."""
        mean = sum(self.tokens_per_part) / max(len(self.tokens_per_part), 1)
        return max(self.tokens_per_part) / mean if mean else 1.0


_recorders: list[list[RoutingRecord]] = []
_lock = threading.Lock()


@contextlib.contextmanager
def record_routing() -> Iterator[list[RoutingRecord]]:
    """Collect a `RoutingRecord` for every MoE call run inside the block (by any thread of
    the process: the parts `run_parts` runs as threads each add theirs). A call that
    activation recomputation replays in backward adds none: one step records each call
    once, recomputed or not.

    ``with record_routing() as records: loss = model(batch)``; the Trainer does this each
    step and logs the counts (see ``docs/moe.md``).
    """
    records: list[RoutingRecord] = []
    with _lock:
        _recorders.append(records)
    try:
        yield records
    finally:
        with _lock:
            _recorders.remove(records)


def routing_metrics(records: list[RoutingRecord]) -> dict[str, float]:
    """Loggable numbers of a step's records, summed over its calls (micro-batches) per
    layer: ``moe/<layer>/expert<e>`` and ``moe/<layer>/device<q>`` (token-expert pairs),
    ``moe/<layer>/imbalance`` (busiest device over the mean) and ``moe/<layer>/dropped``.
    A layer without a name is ``moe<i>``, in the order of first call."""
    per_layer: dict[str, RoutingRecord] = {}
    unnamed = 0
    for rec in records:
        name = rec.layer
        if not name:
            name, unnamed = f"moe{unnamed}", unnamed + 1
        seen = per_layer.get(name)
        if seen is None:
            per_layer[name] = RoutingRecord(name, list(rec.tokens_per_expert),
                                            list(rec.tokens_per_part), rec.dropped)
            continue
        seen.tokens_per_expert = [a + b for a, b in zip(seen.tokens_per_expert,
                                                        rec.tokens_per_expert)]
        seen.tokens_per_part = [a + b for a, b in zip(seen.tokens_per_part,
                                                      rec.tokens_per_part)]
        seen.dropped += rec.dropped
    metrics: dict[str, float] = {}
    for name, rec in per_layer.items():
        metrics.update({f"moe/{name}/expert{e}": float(c)
                        for e, c in enumerate(rec.tokens_per_expert)})
        metrics.update({f"moe/{name}/device{q}": float(c)
                        for q, c in enumerate(rec.tokens_per_part)})
        metrics[f"moe/{name}/imbalance"] = rec.imbalance
        metrics[f"moe/{name}/dropped"] = float(rec.dropped)
    return metrics


def _recomputing() -> bool:
    """Whether this call runs inside a backward pass: activation recomputation
    (``torch.utils.checkpoint``, reentrant or not, and nnscaler's recompute groups) replays
    the forward there, and what the replay routes was already recorded by the forward."""
    return torch._C._current_graph_task_id() != -1


def _record(record: RoutingRecord) -> None:
    if _recomputing():  # the forward's record counts; the replay routes the same tokens
        return
    with _lock:
        for records in _recorders:
            records.append(record)


# -- the op --------------------------------------------------------------------------------


def routed_experts(
    hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *, activation: str = "silu",
    capacity_factor: float | None = None, drop_tokens: bool = False, layer: str = "",
):
    """The routed experts of an MoE layer (see the module docstring); models call it as
    `moe_experts`, which the tracer records as one op.

    ``hidden [T, H]``; ``top_k_index [T, k]`` (int, the chosen experts) and
    ``top_k_weights [T, k]`` (their router weights); ``gate_up_proj [E, 2F, H]`` (gate rows
    first, then up); ``down_proj [E, H, F]``. Returns ``[T, H]``. ``layer`` names the layer
    in errors and routing records.
    """
    return expert_parallel_moe(
        hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation=activation,
        capacity_factor=capacity_factor, drop_tokens=drop_tokens, layer=layer)


def gate_up_view(gate_up_proj: torch.Tensor) -> torch.Tensor:
    """``gate_up_proj [E, 2F, H]`` viewed as ``[E, 2, F, H]`` (index 0: the gate rows, 1: the
    up rows), the form in which the intermediate dim ``F`` is one dim of its own."""
    e, two_f, h = gate_up_proj.shape
    return gate_up_proj.view(e, 2, two_f // 2, h)


def fused_gate_up(gate_up_proj: torch.Tensor) -> torch.Tensor:
    """The op's ``gate_up_proj`` as ``[E, 2F, H]`` (gate rows, then up rows), given fused or
    as `gate_up_view`'s ``[E, 2, F, H]`` (also a part's ``[E, 2, F/n, H]``)."""
    if gate_up_proj.dim() != 4:
        return gate_up_proj
    e, two, f, h = gate_up_proj.shape
    if two != 2:
        raise MoEError(f"moe_experts: a 4-d gate_up_proj is [E, 2, F, H] (gate rows, then up "
                       f"rows, each F); got shape {list(gate_up_proj.shape)}")
    return gate_up_proj.reshape(e, 2 * f, h)


def _check_call(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                activation: str, held: list[int], group: PartGroup, layer: str) -> None:
    where = f"MoE layer {layer!r}" if layer else "moe_experts"
    if activation not in ACTIVATIONS:
        raise MoEError(f"{where}: unknown activation {activation!r}; use one of "
                       f"{sorted(ACTIVATIONS)}")
    local, two_f, h = gate_up_proj.shape
    shapes = [tuple(x.shape) for x in (hidden, top_k_index, top_k_weights, gate_up_proj,
                                       down_proj)]
    ok = (hidden.dim() == 2 and hidden.size(1) == h and top_k_index.dim() == 2
          and top_k_index.shape[0] == hidden.shape[0]
          and tuple(top_k_weights.shape) == tuple(top_k_index.shape)
          and two_f % 2 == 0 and tuple(down_proj.shape) == (local, h, two_f // 2))
    if not ok:
        raise MoEError(
            f"{where}: expected hidden [T, H], top_k_index and top_k_weights [T, k], "
            f"gate_up_proj [E, 2F, H], down_proj [E, H, F]; got shapes {shapes}")
    if len(held) != group.size or held[group.index] != local:
        raise MoEError(f"{where}: part {group.index} of {group.size} holds {local} experts, "
                       f"but expert_counts={held} (the experts each part holds) says "
                       f"otherwise")


def _keep_counts(every: torch.Tensor, k: int, capacity_factor: float | None, drop_tokens: bool,
                 layer: str) -> tuple[torch.Tensor, int]:
    """``every [parts, E]`` (each part's pairs per expert) -> the pairs each part keeps,
    and the number dropped. An expert keeps its first ``capacity`` pairs in token order,
    that is part by part."""
    if capacity_factor is None:
        return every, 0
    n_experts = every.size(1)
    tokens = int(every.sum()) // k
    capacity = math.ceil(capacity_factor * tokens * k / n_experts)
    before = every.cumsum(0) - every
    keep = (capacity - before).clamp(min=0).minimum(every)
    dropped = int((every - keep).sum())
    if dropped and not drop_tokens:
        busiest = int(every.sum(0).max())
        raise MoEError(
            f"MoE layer {layer or '?'}: capacity_factor={capacity_factor} gives each expert "
            f"{capacity} token slots ({tokens} tokens x top-{k} / {n_experts} experts x "
            f"{capacity_factor}), but the busiest expert got {busiest}, so {dropped} "
            f"token-expert pairs would be dropped. Pass drop_tokens=True to drop them (the "
            f"count is reported), raise capacity_factor to at least "
            f"{busiest * n_experts / (tokens * k):.3g}, or leave it None (dropless)")
    return keep, dropped


def _run_experts(x: torch.Tensor, counts: list[int], gate_up_proj: torch.Tensor,
                 down_proj: torch.Tensor, act: Callable) -> torch.Tensor:
    """Rows of ``x`` grouped by local expert (``counts[e]`` rows each) through their expert."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts)):
        gate, up = F.linear(rows, gate_up_proj[e]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, down_proj[e]))
    return torch.cat(outs) if outs else x


def _regroup(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows in blocks ``counts [a, b]`` (a-major) -> the same blocks b-major."""
    a, b = counts.shape
    blocks = torch.split(x, counts.reshape(-1).tolist())
    return torch.cat([blocks[i * b + j] for j in range(b) for i in range(a)]) if blocks else x


def _even_meta(hidden, top_k_weights, gate_up_proj, down_proj, activation: str,
               num_experts: int, group: PartGroup) -> torch.Tensor:
    """The collectives and expert matmuls of a call whose routing is even, on meta tensors
    (no value to route by): what autodist's profiler records and costs."""
    t, k = top_k_weights.shape
    group.all_gather(torch.empty(num_experts, dtype=torch.long, device="meta"))
    share = [len(c) for c in torch.tensor_split(torch.arange(t * k), group.size)]
    x = group.all_to_all(hidden.unsqueeze(1).expand(t, k, hidden.size(1)).reshape(t * k, -1),
                         share, share)
    # the experts' matmuls as one block: on meta tensors only shapes are computed, and a
    # loop over hundreds of experts would cost the recording seconds for nothing
    y = _run_experts(x, [x.size(0)], gate_up_proj[:1], down_proj[:1], ACTIVATIONS[activation])
    y = group.all_to_all(y, share, share)
    return (y.view(t, k, -1) * top_k_weights.unsqueeze(-1)).sum(1).to(hidden.dtype)


#: What a model calls: `routed_experts`, recorded by the tracer as one op.
moe_experts = make_recording_wrapper(routed_experts, MOE_EXPERTS)


# long: one straight pass of the dispatch, the experts and the combine, read top to bottom
def expert_parallel_moe(
    hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *, activation: str = "silu",
    capacity_factor: float | None = None, drop_tokens: bool = False, layer: str = "",
    expert_counts: tuple[int, ...] | None = None, group: PartGroup = SINGLE,
):
    """`moe_experts` on this part's tokens and experts, the parts joined by ``group`` (a
    `PartGroup`): part ``p`` holds ``expert_counts[p]`` experts, the ones after those of
    the parts before it (default: as many on every part), and its own tokens; it returns
    its tokens' results."""
    n, index = group.size, group.index
    gate_up_proj = fused_gate_up(gate_up_proj)
    local = gate_up_proj.size(0)
    held = [local] * n if expert_counts is None else [int(c) for c in expert_counts]
    _check_call(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation,
                held, group, layer)
    num_experts = sum(held)
    first = sum(held[:index])
    if hidden.device.type == "meta":  # shapes only (a cost model): routing taken as even
        return _even_meta(hidden, top_k_weights, gate_up_proj, down_proj, activation,
                          num_experts, group)
    k = top_k_index.size(1)
    flat = top_k_index.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise MoEError(f"MoE layer {layer or '?'}: top_k_index holds experts "
                       f"[{int(flat.min())}, {int(flat.max())}] but the layer has "
                       f"{num_experts} (0 to {num_experts - 1})")
    # 1. sizes: every part's pairs per expert
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    every = group.all_gather(counts) if n > 1 else counts.unsqueeze(0)  # [n, E]
    keep_all, dropped = _keep_counts(every, k, capacity_factor, drop_tokens, layer)
    keep = keep_all[index]
    if capacity_factor is not None:  # the first keep[e] pairs of each expert's run
        sorted_e = flat[order]
        start = counts.cumsum(0) - counts
        rank = torch.arange(order.numel(), device=flat.device) - start[sorted_e]
        order = order[rank < keep[sorted_e]]
    mine = slice(first, first + local)
    owner = torch.repeat_interleave(torch.arange(n, device=flat.device),
                                    torch.tensor(held, device=flat.device))  # each expert's part
    send = keep.new_zeros(n).index_add(0, owner, keep).tolist()  # pairs to each part
    recv = keep_all[:, mine].sum(1).tolist()  # pairs from each part
    per_part = keep.new_zeros(n).index_add(0, owner, keep_all.sum(0)).tolist()
    _record(RoutingRecord(layer, every.sum(0).tolist(), per_part, dropped))
    # 2. dispatch: each pair's token to the part of its expert
    token = order // k
    x = group.all_to_all(hidden[token], send, recv)
    # 3. the local experts, on blocks grouped by expert (received grouped by source part)
    by_source = keep_all[:, mine]  # [n, local]
    y = _regroup(x, by_source)
    y = _run_experts(y, by_source.sum(0).tolist(), gate_up_proj, down_proj,
                     ACTIVATIONS[activation])
    y = _regroup(y, by_source.t().contiguous())
    # 4. combine: back to the tokens' parts, weighted, summed per token
    y = group.all_to_all(y, recv, send)
    weights = top_k_weights.reshape(-1)[order]
    y = (y * weights.unsqueeze(1)).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add(0, token, y)


def ffn_parallel_moe(
    hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *, activation: str = "silu",
    capacity_factor: float | None = None, drop_tokens: bool = False, layer: str = "",
    ffn_part: tuple[int, int] = (0, 1),
):
    """`moe_experts` on part ``p`` of ``n`` (``ffn_part``) of every expert's intermediate
    units: ``down_proj [E, H, F/n]`` this part's columns, and ``gate_up_proj`` either this
    part's ``[E, 2, F/n, H]`` of `gate_up_view` (its gate rows and its up rows, held alone)
    or the whole fused ``[E, 2F, H]`` (this part takes its rows). Returns this part's share
    of the result; the ``n`` parts' shares sum to it."""
    part, num = ffn_part
    if gate_up_proj.dim() == 4:  # already this part's rows: [gate_p; up_p] once fused
        gate_up = fused_gate_up(gate_up_proj)
        if gate_up.size(1) != 2 * down_proj.size(2):
            raise MoEError(f"MoE layer {layer or '?'}: this part's gate_up_proj "
                           f"{list(gate_up_proj.shape)} and down_proj {list(down_proj.shape)} "
                           f"hold different slices of the intermediate dim")
        return expert_parallel_moe(
            hidden, top_k_index, top_k_weights, gate_up, down_proj, activation=activation,
            capacity_factor=capacity_factor, drop_tokens=drop_tokens, layer=layer)
    local, two_f = down_proj.size(2), gate_up_proj.size(1)
    if not 0 <= part < num or local * num * 2 != two_f:
        where = f"MoE layer {layer!r}" if layer else "ffn_parallel_moe"
        raise MoEError(f"{where}: ffn_part={ffn_part} with down_proj {list(down_proj.shape)} "
                       f"(F/n = {local}) does not slice gate_up_proj {list(gate_up_proj.shape)} "
                       f"(2F = {two_f}) in {num} parts")
    start = part * local
    gate_up = torch.cat([gate_up_proj.narrow(1, start, local),
                         gate_up_proj.narrow(1, two_f // 2 + start, local)], dim=1)
    return expert_parallel_moe(
        hidden, top_k_index, top_k_weights, gate_up, down_proj, activation=activation,
        capacity_factor=capacity_factor, drop_tokens=drop_tokens, layer=layer)


# -- annotation and splits -----------------------------------------------------------------


def moe_anno(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
             capacity_factor: float | None = None, **_: Any) -> str:
    """Tokens ``t`` split; experts ``e`` only by the expert-parallel rule. With a capacity
    the token dim is ``^``: a part alone cannot know the batch's capacity, so only the
    expert-parallel rule (whose parts exchange their counts) splits it."""
    t = "t" if capacity_factor is None else "t^"
    gate_up = "e^ 2 f^ h^" if gate_up_proj.dim() == 4 else "e^ g^ h^"
    return f"{t} h^, {t} k^, {t} k^, {gate_up}, e^ h^ f^ -> {t} h^"


def _ep_modifier(num_experts: int) -> Callable[..., dict]:
    def modifier(kwargs: dict, idx: int, dim: int, num: int, part: int) -> dict:
        counts = tuple(len(c) for c in torch.tensor_split(torch.arange(num_experts), num))
        return {**kwargs, "expert_counts": counts}

    return modifier


def _ffn_modifier(kwargs: dict, idx: int, dim: int, num: int, part: int) -> dict:
    return {**kwargs, "ffn_part": (part, num)}


def moe_rules(bound: Any) -> list[TransformRule]:
    """Data parallel (experts replicated; not with a capacity), expert parallel, and
    tensor parallel inside the experts (a split of ``down_proj``'s intermediate dim, and of
    ``gate_up_proj``'s too when it comes as `gate_up_view`'s ``[E, 2, F, H]``)."""
    experts = bound.input_shapes[3]
    if experts is None:
        return []
    tokens_frozen = bound.expanded.inputs[0].dims[0].idents[0].reduce is Reduce.FROZEN
    s, r = Split(0), Replicate()
    rules = [] if tokens_frozen else [
        TransformRule(inputs=(s, s, s, r, r), outputs=(s,))]
    rules.append(TransformRule(inputs=(s, s, s, s, s), outputs=(s,),
                               modifier=_ep_modifier(experts[0]), part_op=EXPERT_PARALLEL))
    gate_up = Split(2) if len(experts) == 4 else r
    rules.append(TransformRule(inputs=(r, r, r, gate_up, Split(2)), outputs=(ValuePartial(),),
                               modifier=_ffn_modifier, part_op=FFN_PARALLEL))
    return rules


def _ep_anno(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
             capacity_factor: float | None = None, **_: Any) -> str:
    return moe_anno(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                    capacity_factor=capacity_factor)


def gen_moe(rng: random.Random) -> tuple[tuple, dict]:
    """A random routed call: some experts get no token, sometimes all go to one."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    n_experts, k = rng.choice((2, 4, 6, 8)), rng.choice((1, 2))
    tokens, h, f = rng.choice((2, 4, 6, 12)), rng.choice((2, 4)), rng.choice((2, 3))
    logits = torch.randn(tokens, n_experts, generator=g, dtype=torch.float64)
    if rng.random() < 0.3:  # a skewed router: every token's first choice is expert 0
        logits[:, 0] += 100.0
    weights, index = logits.softmax(-1).topk(k, dim=-1)
    args = (torch.randn(tokens, h, generator=g, dtype=torch.float64), index,
            weights / weights.sum(-1, keepdim=True),
            torch.randn(n_experts, 2 * f, h, generator=g, dtype=torch.float64),
            torch.randn(n_experts, h, f, generator=g, dtype=torch.float64))
    if rng.random() < 0.5:  # the tracer's view of an expert weight only the op reads
        args = (*args[:3], gate_up_view(args[3]), args[4])
    kwargs: dict[str, Any] = {"activation": rng.choice(("silu", "gelu"))}
    if rng.random() < 0.3:
        kwargs.update(capacity_factor=1.0, drop_tokens=True)
    return args, kwargs


def register(registry: OpRegistry) -> None:
    registry.register(routed_experts, moe_anno, name=MOE_EXPERTS, input_gen_fn=gen_moe,
                      transform_rules=moe_rules)
    registry.register(expert_parallel_moe, _ep_anno, name=EXPERT_PARALLEL,
                      input_gen_fn=gen_moe, collective=True)
    registry.register(ffn_parallel_moe, _ep_anno, name=FFN_PARALLEL, input_gen_fn=gen_moe)
