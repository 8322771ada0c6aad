"""``tp``: tensor parallelism inside a scale unit, chosen op by op from adapter costs.

Every op is split in ``plan_ngpus`` parts (part ``p`` on device ``p``) through its
transform space, or replicated on every device. The choice is greedy, in program order,
with a lookahead. For each option (each legal split, and replication) the policy
computes, in bytes (see `nnscaler.policies.costs`):

1. ``params``: for each parameter, buffer or constant with two or more dims that the op
   is the first to read, the bytes held beyond one copy if the op reads it in that
   layout (0 when the option shards it, ``n - 1`` copies when it replicates it). The
   first reader fixes where a weight lives (its canonical layout), so this is memory the
   option commits. Vectors (biases, norm scales) count their bytes under ``moves``;
2. ``moves``: the adapters the option needs (each input from the layout it is held in to
   the layout the option reads it in, forward and, where gradients flow, backward; a
   weight already placed by an earlier reader, such as a tied LM head, from its
   canonical layout), the move of a graph output to replicated, and the lookahead: for
   each later op that reads an output, what it would pay to read it from this option's
   layout under its own best option, recursively ``tp_lookahead`` readers deep. A reader's
   other inputs cost what it takes to bring them from where they are held, or nothing
   when their producers are not placed yet. A weight the option is the first to read is
   costed for its other readers too (a tied LM head reads the embedding's table from
   where the embedding puts it);
3. ``compute``, added to ``moves``: the op's work on one device (its multiply-accumulates,
   `op_work`, three times that when gradients flow back,
   divided by the parts of a split) times ``tp_bytes_per_mac``, the bytes a collective
   moves in the time of one multiply-accumulate. So a big replicated matmul (an LM head)
   is split when what it saves outweighs the communication the split adds.

Options compare by ``params``, then ``moves``, then the moves needed now (a gather that
can wait is not paid early: a later op may need the split), then replication before a
split (splitting a replicated input creates a layout someone may have to gather), then
the order of the transform space.

Parameters come first on purpose: added to adapter bytes, a replicated weight loses to
the activations it saves moving as soon as batch x sequence exceeds the hidden size (any
real run), and the policy degenerates into splitting the sequence or the batch, which is
data parallelism. Ordered first, every weight matrix its annotation lets split is
sharded, and then as little as possible moves: consecutive linears become Megatron
column-then-row (the first split on its output features, the activation on the same dim,
the second on its reduction dim with value-partial outputs; with a bias, linear's
transform rule adds it on part 0 only), attention splits by heads. With the compute
term, an LM head splits by vocabulary and its cross-entropy with it (the class-parallel
cross-entropy of cross_entropy's transform rule), and a tied embedding table by rows
(Megatron's vocabulary-parallel embedding).
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from nnscaler.anno import Transform
from nnscaler.config import ComputeConfig
from nnscaler.graph import IRGraph, PartitionError
from nnscaler.ir import FullTensor, Graph, Op, TensorKind
from nnscaler.layout import Layout
from nnscaler.policies.common import (
    PolicyError,
    as_policy_graph,
    assign_parts,
    policy_config,
)
from nnscaler.policies.costs import (
    adapter_cost,
    default_bytes_per_mac,
    layout_of,
    op_layouts,
    op_work,
    redundant_bytes,
    replicated,
)

__all__ = ["TPOption", "tp"]

logger = logging.getLogger(__name__)

#: How many readers deep an option's outputs are costed, unless pas_config says otherwise.
DEFAULT_LOOKAHEAD = 3


@attrs.frozen(eq=False)
class TPOption:
    """One way to place an op: ``transform`` (``None``: replicate) with the layout of
    each tensor it reads (``reads``: tensor, layout, gradient flows) and writes."""

    transform: Transform | None
    reads: tuple[tuple[FullTensor, Layout | None, bool], ...]
    writes: tuple[tuple[FullTensor, Layout | None], ...]

    def __str__(self) -> str:
        return "replicate" if self.transform is None else str(self.transform)


def _is_weight(full: FullTensor) -> bool:
    """A leaf that lives on the devices (not a forward argument)."""
    return full.is_leaf and full.kind is not TensorKind.INPUT


class _Greedy:
    def __init__(self, graph: IRGraph, n: int, lookahead: int,
                 bytes_per_mac: float | None = None) -> None:
        self.graph = graph
        self.n = n
        self.lookahead = lookahead
        self.bytes_per_mac = default_bytes_per_mac() if bytes_per_mac is None else bytes_per_mac
        self._compute: dict[Op, float] = {}
        self.held: dict[FullTensor, Layout | None] = {}  # activations; weights: canonical
        self.outputs = {p.full for p in graph.output_tensors()}
        self._options: dict[Op, list[TPOption]] = {}
        self.chosen: dict[Op, Transform | None] = {}  # what place() chose for each op
        # best (params, moves, now) of a reader given one input's layout; valid while
        # nothing is placed (weights placed by an op change what later readers pay)
        self._best: dict[tuple[Op, FullTensor, Layout | None, int],
                         tuple[float, float, float]] = {}

    # -- the options of an op (they do not depend on what was placed) ------------------
    def options(self, op: Op) -> list[TPOption]:
        if op not in self._options:
            transforms: list[Transform | None] = [None]
            if op.anno is not None and op.opdef is not None:
                transforms += op.anno.transform_space(self.n, rules=op.opdef.rules_for(op.anno))
            self._options[op] = [self._option(op, t) for t in transforms]
        return self._options[op]

    def _option(self, op: Op, t: Transform | None) -> TPOption:
        reads, writes = op_layouts(op, t, self.n)
        return TPOption(t, reads, writes)

    # -- costs --------------------------------------------------------------------------
    def compute(self, op: Op, option: TPOption) -> float:
        """What ``option`` costs a device in computation, in bytes: the op's forward work
        (`op_work`), three times that when gradients flow
        back through it, divided by the parts of a split."""
        if op not in self._compute:
            grads = not op.no_grad and any(full.requires_grad for full, _, _ in option.reads)
            self._compute[op] = op_work(op) * (3 if grads else 1) * self.bytes_per_mac
        return self._compute[op] / (1 if option.transform is None else self.n)

    def _source(self, full: FullTensor) -> Layout | None:
        if full.kind is TensorKind.INPUT and full.is_leaf:
            return replicated(full, self.n)
        return self.held.get(full, replicated(full, self.n))

    def _weights(self, op: Op, option: TPOption, depth: int,
                 given: tuple[FullTensor, Layout | None] | None
                 ) -> tuple[float, float, float]:
        """(params, moves now, moves later) of the weights ``option`` reads. A weight
        that ``option`` is the first to read gets its canonical layout from it, so its
        other readers (a tied LM head) are costed reading it from there, ``depth`` deep."""
        params = moves = later = 0.0
        first: dict[FullTensor, Layout | None] = {}
        for full, need, grad in option.reads:
            if not _is_weight(full):
                continue
            if given is not None and full is given[0]:
                canon = given[1]
            elif full in self.held:
                canon = self.held[full]
            elif full in first:
                canon = first[full]
            else:
                canon = first[full] = None if need is None else need.replicated()
                extra = (full.numel * full.dtype.itemsize * (self.n - 1) if canon is None
                         else redundant_bytes(full, canon))
                if full.ndim >= 2:
                    params += extra
                else:  # a bias or a norm's scale: bytes like any other
                    moves += extra
                if depth > 0:
                    later += self._lookahead(op, full, canon, depth - 1)
            moves += adapter_cost(full, canon, need, grad=grad)[0]
        return params, moves, later

    def score(self, op: Op, option: TPOption, depth: int,
              given: tuple[FullTensor, Layout | None] | None = None
              ) -> tuple[float, float, float]:
        """(params, moves, moves now) of placing ``op`` as ``option``, looking ``depth``
        readers ahead; *moves now* leaves the lookahead out.

        ``given``: the one input whose layout is assumed (a lookahead); the op's other
        inputs cost what it takes to bring them from where they are held, or nothing if
        their producers are not placed yet.
        """
        params, now, later = self._weights(op, option, depth, given)
        now += self.compute(op, option)
        for full, need, grad in option.reads:
            if _is_weight(full):
                continue
            if given is not None and full is given[0]:
                now += adapter_cost(full, given[1], need, grad=grad)[0]
            elif given is None or full in self.held or full.is_leaf:
                now += adapter_cost(full, self._source(full), need, grad=grad)[0]
        for full, layout in option.writes:
            if full in self.outputs:
                now += adapter_cost(full, layout, replicated(full, self.n),
                                    grad=full.requires_grad)[0]
            if depth > 0:
                later += self._lookahead(op, full, layout, depth - 1)
        return params, now + later, now

    def _lookahead(self, op: Op, full: FullTensor, layout: Layout | None, depth: int) -> float:
        """What the later readers of ``full`` would pay, each under its best option, to
        read it from ``layout``."""
        total = 0.0
        for reader in dict.fromkeys(self.graph.consumers(full)):
            if reader is op or reader.device is not None:
                continue
            key = (reader, full, layout, depth)
            if key not in self._best:
                self._best[key] = min(self.score(reader, option, depth, (full, layout))
                                      for option in self.options(reader))
            total += self._best[key][1]
        return total

    # -- placing ------------------------------------------------------------------------
    def place(self, op: Op) -> list[Op]:
        ranked = []
        for k, option in enumerate(self.options(op)):
            params, moves, now = self.score(op, option, self.lookahead)
            ranked.append(((round(params, 3), round(moves, 3), round(now, 3),
                            option.transform is not None, k), option))
        ranked.sort(key=lambda item: item[0])
        for key, option in ranked:
            t = option.transform
            try:
                parts = (self.graph.replicate(op, self.n) if t is None else
                         self.graph.partition(op, idx=t.idx, dim=t.dim, num=self.n))
            except PartitionError as e:
                logger.debug("tp: %s: %s is not possible (%s)", op.name, option, e)
                continue
            logger.debug("tp: op #%d %s: %s (params %g B, moves %g B)", op.oid, op.name,
                         option, key[0], key[1])
            self.chosen[op] = t
            assign_parts(self.graph, parts)
            self.record(parts)
            self._best.clear()
            return parts
        raise PartitionError(f"tp: {self.graph.describe(op)} could be neither split nor "
                             f"replicated")  # replicate never fails

    def place_as(self, op: Op, t: Transform | None) -> list[Op] | None:
        """Place ``op`` as ``t`` (a choice made for an identical op); ``None`` when the
        graph refuses it (then `place` decides)."""
        try:
            parts = (self.graph.replicate(op, self.n) if t is None else
                     self.graph.partition(op, idx=t.idx, dim=t.dim, num=self.n))
        except PartitionError:
            return None
        self.chosen[op] = t
        assign_parts(self.graph, parts)
        self.record(parts)
        self._best.clear()
        return parts

    def record(self, parts: list[Op]) -> None:
        """Hold what the placed ``parts`` wrote, and the canonical layout of the weights
        they are the first to read."""
        reads = [p.input_tensors() for p in parts]
        for j, x in enumerate(reads[0]):
            if _is_weight(x.full) and x.full not in self.held:
                need = layout_of((p.device, r[j]) for p, r in zip(parts, reads))
                self.held[x.full] = None if need is None else need.replicated()
        writes = [p.output_tensors() for p in parts]
        for j, x in enumerate(writes[0]):
            self.held[x.full] = layout_of((p.device, w[j]) for p, w in zip(parts, writes))


def get_bytes_per_mac(compute_config: ComputeConfig, policy: str) -> float:
    """``pas_config['tp_bytes_per_mac']``: what one multiply-accumulate costs, in bytes a
    collective moves (default: `default_bytes_per_mac`)."""
    value = policy_config(compute_config, policy).pas_config.get("tp_bytes_per_mac")
    if value is None:
        return default_bytes_per_mac()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise PolicyError(
            f"policy {policy!r}: pas_config['tp_bytes_per_mac'] is what one multiply-"
            f"accumulate costs in bytes moved by a collective, a number >= 0 (0: choose by "
            f"communication alone; default {default_bytes_per_mac()} on this device type); "
            f"got {value!r}"
        )
    return float(value)


def tp(graph: Graph, compute_config: ComputeConfig) -> IRGraph:
    """Tensor parallelism on ``compute_config.plan_ngpus`` devices: every op split through
    its transform space where that pays (see the module docstring), else replicated.

    ``pas_config`` options: ``tp_lookahead`` (default 3), how many readers deep an option's
    outputs are costed; ``tp_bytes_per_mac``, what a multiply-accumulate costs in bytes
    (`BYTES_PER_MAC` of the device type by default; 0
    leaves computation out). The result passes ``graph.check(plan_ngpus)``.
    """
    config = policy_config(compute_config, "tp")
    n = config.plan_ngpus
    lookahead = config.pas_config.get("tp_lookahead", DEFAULT_LOOKAHEAD)
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise PolicyError(
            f"policy 'tp': pas_config['tp_lookahead'] is how many readers deep the policy "
            f"costs an op's outputs, an int >= 0 (default {DEFAULT_LOOKAHEAD}); got "
            f"{lookahead!r}"
        )
    bytes_per_mac = get_bytes_per_mac(compute_config, "tp")
    g = as_policy_graph(graph)
    if n == 1:
        for op in g.nodes():
            g.assign(op, 0)
    else:
        greedy = _Greedy(g, n, lookahead, bytes_per_mac)
        reuse = _BlockReuse(g.nodes())
        for op in g.nodes():
            t = reuse.choice_for(op, greedy)
            if t is _SCORE or greedy.place_as(op, t) is None:
                greedy.place(op)
    g.check(n)
    return g


_SCORE = object()  # no reusable choice: score the op


class _BlockReuse:
    """Choices of repeated blocks (`nnscaler.graph.blocks.repeated_blocks`) made
    once and reused: the greedy's choice for an op depends on the layouts its block's
    inputs are held in and on what its lookahead sees, so the second instance of a block
    (whose inputs come from an instance, not from the stem) is scored, and every later
    instance but the last (whose lookahead sees the model's head) takes its choices
    when its inputs from outside the block are held in the same layouts. The plan is
    the one the greedy makes op by op, in a fraction of the time."""

    def __init__(self, ops: list[Op]) -> None:
        from nnscaler.graph.blocks import repeated_blocks

        self.template: dict[Op, tuple[Op, Op, Op]] = {}  # op -> (its op in the template,
        #                                                  its block's first op, template's)
        self.inputs: dict[Op, list[tuple[FullTensor, FullTensor]]] = {}
        for kind in repeated_blocks(ops):
            if len(kind.instances) < 4:
                continue
            tpl = kind.instances[1]
            for inst in kind.instances[2:-1]:
                for a, b in zip(inst.ops, tpl.ops):
                    self.template[a] = (b, inst.ops[0], tpl.ops[0])
                self.inputs[inst.ops[0]] = _outside(inst.ops, tpl.ops)
        self.ok: dict[Op, bool] = {}

    def choice_for(self, op: Op, greedy: _Greedy) -> Any:
        if op not in self.template:
            return _SCORE
        tpl, first, _ = self.template[op]
        if first not in self.ok:
            self.ok[first] = all(
                greedy._source(mine) == greedy._source(theirs)
                for mine, theirs in self.inputs[first])
        if not self.ok[first] or tpl not in greedy.chosen:
            return _SCORE
        return greedy.chosen[tpl]


def _outside(ops: tuple[Op, ...], tpl: tuple[Op, ...]) -> list[tuple[FullTensor, FullTensor]]:
    """The tensors the ops of a block read from outside it (activations and forward
    arguments), paired with the template's at the same place."""
    made = {y.full for op in ops for y in op.output_tensors()}
    pairs = []
    for a, b in zip(ops, tpl):
        for x, y in zip(a.input_tensors(), b.input_tensors()):
            if x.full not in made and not _is_weight(x.full):
                pairs.append((x.full, y.full))
    return pairs
