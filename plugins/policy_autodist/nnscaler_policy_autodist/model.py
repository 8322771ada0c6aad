"""The cost model of one stage: each op's options with their time and memory, and the
cost of every producer -> consumer edge for each pair of options.

A stage of ``k`` devices runs each op either replicated on all ``k`` or split in ``k``
parts by one transform of its transform space (``op.anno.transform_space(k)`` with its
op's rules, one option per split), part ``p`` on device ``p``, or on two axes, data x
tensor (`nnscaler_policy_autodist.twoaxis`). For an option the model knows, per device:

- ``time``: the part's forward and backward time (`profile`), the forward again
  when the op is recomputed; plus the collectives its parts run among themselves (a
  split whose rule calls a collective part op, such as a cross-entropy split over its
  classes: recorded by calling the part op on meta tensors); plus the moves of what it
  reads from outside the stage's
  activations: forward arguments (held replicated), weights (the first reader fixes a
  weight's layout: its need with value parts folded into replicas; a later reader of a
  tied weight pays the move from there, as an edge), and the move of a graph output to
  replicated;
- gradient synchronisation: the runtime sums a weight piece's gradient over every rank
  that holds it, in one all-reduce: its replicas in the unit (a weight held replicated,
  by a split op or a replicated one) times the data-parallel scale units
  (``runtime_ngpus / plan_ngpus``);
- the optimizer's step over the weights it is the first to read (measured for Adam:
  per parameter and per byte; memory bound for a named device); this step and the
  gradient sum run once a training step, so an option, whose times are per
  micro-batch, carries ``1 / micro_batches`` of them (a stage's ``micro_batches`` x
  time is then its step);
- ``mem``: bytes of the weights it is the first to read (parameter, gradient and
  optimizer state; under ZeRO the state divided over the units, plus the shard the
  optimizer steps and its gradient; the step's temporaries that exist for every weight
  at once); ``transient``: the temporaries of its weights' update that exist one weight
  at a time (a stage holds the largest) and of the activations
  it keeps for backward (its outputs, when gradients flow and it is not recomputed).

An edge between the producer of an activation and a consumer costs the layout plan from
the layout the producer's option writes to the one the consumer's option reads
(`nnscaler.layout.plan`, timed by `CommModel`), forward and backward.

Repeated blocks (`nnscaler.graph.blocks.repeated_blocks`) are *tied*: the costs of
an instance are computed once, and every op of an instance between the first and the last
takes the choice of the op at its position in the second instance. The first and last
instances choose for themselves (the ops before the first, or after the last, are not
another block), so the solver sees at most three layers whatever the depth.

The models of one search (a unit size each, per ZeRO stage, and their copies per expert
degree) share one `SharedCosts`: what depends only on an op, its split and the stage's
devices, or only on layouts, is computed once for every point of the mesh that asks for it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs

from nnscaler.extend import (
    FullTensor,
    Layout,
    Op,
    TensorKind,
    Transform,
    op_layouts,
    plan,
    repeated_blocks,
    replicated,
    tensors_in,
)
from nnscaler_policy_autodist import twoaxis
from nnscaler_policy_autodist.comm import CommModel
from nnscaler_policy_autodist.experts import held_to_degree, imbalanced
from nnscaler_policy_autodist.profile import ComputeProfiler
from nnscaler_policy_autodist.sequence import (
    PartTimes,
    attention_calls,
    part_strategy,
    sequence_kept,
    sequence_transient,
    usable,
)
from nnscaler_policy_autodist.twoaxis import TwoAxis, two_axis_transforms

__all__ = ["CostModel", "Edge", "Option", "SharedCosts", "StageProblem"]

logger = logging.getLogger("nnscaler.autodist.model")  # under nnscaler's loggers


@attrs.frozen(eq=False)
class Option:
    """One way to run an op: ``transform`` (``None``: replicated) over ``k`` devices."""

    transform: Transform | TwoAxis | None
    reads: tuple[tuple[FullTensor, Layout | None, bool], ...]
    writes: tuple[tuple[FullTensor, Layout | None], ...]
    #: seconds per device and micro-batch, forward + backward (+ recompute), and the
    #: optimizer's step over its weights spread over the micro-batches (it runs once)
    compute: float
    #: seconds per micro-batch of moves charged to the op alone, and its weights'
    #: gradient sum spread over the micro-batches
    comm: float
    mem: float  # bytes per device
    act: float  # of which activations kept for backward, per micro-batch
    transient: float = 0.0  # bytes its optimizer step holds briefly (a stage holds the max)
    #: how the parts talk along the sequence (`sequence.part_strategy`), for the report
    strategy: str | None = None

    @property
    def time(self) -> float:
        return self.compute + self.comm

    def describe(self) -> str:
        if isinstance(self.transform, TwoAxis):
            return self.transform.describe()
        return "replicate" if self.transform is None else (
            f"split input {self.transform.idx} dim {self.transform.dim} "
            f"({self.transform.ident!r}) in {self.transform.num}"
            + ("" if self.strategy is None else f" ({self.strategy})"))


@attrs.frozen(eq=False)
class Edge:
    """Producer ``src`` -> consumer ``dst`` (indices into the problem's ops) of one tensor:
    ``cost[i][j]`` seconds when ``src`` takes option ``i`` and ``dst`` option ``j``."""

    src: int
    dst: int
    cost: tuple[tuple[float, ...], ...]


@attrs.frozen(eq=False)
class StageProblem:
    """What a solver sees: per op its options; edges; ``rep[i]`` the op whose choice op
    ``i`` takes (itself, or its position in the template of its repeated block)."""

    ops: tuple[Op, ...]
    options: tuple[tuple[Option, ...], ...]
    edges: tuple[Edge, ...]
    rep: tuple[int, ...]
    k: int


def _same_split(t: Transform) -> tuple | None:
    """What makes two transforms the same split: the transform space names a split by
    every tensor that carries its identifier (a linear's input columns and its weight's),
    and those differ only in ``(idx, dim)``, unless a rule's modifier reads them
    (``None``: not comparable)."""
    if t.modifier is not None:
        return None
    return (t.ident, t.inputs, t.outputs, t.kwarg_updates, t.part_op)


def _is_weight(full: FullTensor) -> bool:
    return full.is_leaf and full.kind is not TensorKind.INPUT


class SharedCosts:
    """What the cost models of one search share, whatever their unit size, ZeRO stage or
    expert degree (the search builds a stage problem for every point of the mesh, and
    points with stages of equal devices ask for the same pieces): what depends only on
    an op, its split and the stage's devices (the layouts it reads and writes, its
    two-axis splits), and what depends only on layouts (a move's seconds, an edge's
    cost matrix). Every entry is what the model would compute again: sharing changes
    no cost, only how often it is computed."""

    def __init__(self) -> None:
        self.layouts: dict[tuple, tuple] = {}  # (op, transform, k) -> `op_layouts`
        self.twoaxis: dict = {}  # `twoaxis.layouts`'s memo
        self.two: dict[tuple[Op, int], list[TwoAxis]] = {}  # two-axis splits by (op, k)
        self.moves: dict[tuple[Layout, Layout, int, bool], float] = {}
        #: (elements, item size, the producer's layouts, the consumer's) -> cost matrix
        self.edges: dict[tuple, tuple[tuple[float, ...], ...]] = {}


class CostModel:
    """Builds `StageProblem` s for the ops of stages of ``k`` devices. ``shared``: the
    memo of the search's other models (`SharedCosts`; a fresh one if not given)."""

    def __init__(self, *, profiler: ComputeProfiler, comm: CommModel, units: int,
                 zero: bool, opt_state: float = 2.0, recompute: frozenset[int] = frozenset(),
                 allowed: dict[int, set] | None = None, max_degree: int | None = None,
                 micro_batches: int = 1, share: float = 1.0,
                 overlap_grads: bool = False, unit: int | None = None,
                 zero_stage: int | None = None, parts: PartTimes | None = None,
                 two_axis: bool = True, expert_imbalance: float = 1.0,
                 shared: SharedCosts | None = None) -> None:
        self.profiler = profiler
        #: the measured times of the sequence splits whose parts talk (`sequence`)
        self.parts = parts
        self.comm = comm
        self.units = units
        #: the ZeRO stage (docs/zero.md); ``zero`` alone means stage 1, as in nnScaler
        self.stage = int(zero) if zero_stage is None else zero_stage
        self.zero = self.stage >= 1
        self.opt_state = opt_state
        self.recompute = recompute  # oids of ops whose activations are recomputed
        self.allowed = allowed or {}  # oid -> allowed {(idx, dim) | 'replicate'}
        self.max_degree = max_degree
        #: the optimizer's step and the gradients' sum run once a step: per micro-batch,
        #: an option carries 1/micro_batches of them
        self.micro_batches = max(1, micro_batches)
        #: processes per core of the devices planned for (`profile.core_share`)
        self.share = share
        #: the reducer sums gradients while backward runs (``async_op``, ZeRO stage 2+)
        self.overlap_grads = overlap_grads
        self.unit = unit  # devices of a scale unit (plan_ngpus), for the node layout
        self.two_axis = two_axis  # also data x tensor splits of an op (`twoaxis`)
        self.shared = shared or SharedCosts()
        self._two = self.shared.two  # asked again for every stage
        self._layouts = self.shared.twoaxis  # of the two-axis options (`twoaxis.layouts`)
        #: options by build context and (op, transform, k): this model's and the copies
        #: `experts.ExpertAxis.restrict` makes of it (they differ in their options only)
        self._options: dict[tuple, dict[tuple, Option]] = {}
        #: the busiest device's token-expert pairs over the mean under an expert split
        #: (`nnscaler_policy_autodist.experts`): its exchanges and its experts' work scale
        self.expert_imbalance = expert_imbalance
        #: the expert degree this model is held to (`experts.ExpertAxis.restrict`)
        self.expert_degree: int | None = None
        self._plans = self.shared.moves

    # -- options ------------------------------------------------------------------------
    def transforms(self, op: Op, k: int) -> list[Transform | TwoAxis | None]:
        """Replication, every split of ``op`` in ``k`` parts and every two-axis split
        (`twoaxis`) its constraints allow."""
        allowed = self.allowed.get(op.oid)
        out: list[Transform | None] = []
        if allowed is None or "replicate" in allowed:
            out.append(None)
        if k > 1 and op.anno is not None and op.opdef is not None and not op.opdef.collective \
                and (self.max_degree is None or k <= self.max_degree):
            seen: set = set()
            for t in op.anno.transform_space(k, rules=op.opdef.rules_for(op.anno)):
                if (allowed is None or (t.idx, t.dim) in allowed) and usable(op, t, k):
                    same = _same_split(t)
                    if same is None or same not in seen:  # one option per split
                        seen.add(same)
                        out.append(t)
            if self.two_axis:  # after the one-axis splits: their indices do not move
                if (op, k) not in self._two:
                    self._two[op, k] = two_axis_transforms(op, k, self._layouts)
                out += [t for t in self._two[op, k] if twoaxis.allowed(t, allowed)]
        if self.expert_degree is not None:  # a point of the expert axis (`experts`)
            out = held_to_degree(op, out, self.expert_degree)
        if not out:  # constraints that leave nothing: replicate (reported by the caller)
            out.append(None)
        return out


    def move(self, full: FullTensor, src: Layout | None, dst: Layout | None,
             grad: bool) -> float:
        """Seconds to bring ``full`` from ``src`` to ``dst`` (and its gradient back)."""
        if src is not None and dst is not None and src == dst:
            return 0.0
        itemsize = full.dtype.itemsize
        if src is None or dst is None:
            return self.comm.plan_time(None, itemsize, full.numel, grad)
        key = (src, dst, itemsize, grad)
        if key not in self._plans:
            self._plans[key] = self.comm.plan_time(plan(src, dst), itemsize, full.numel, grad)
        return self._plans[key]

    def option(self, op: Op, t: Transform | None, k: int, first_reader: dict[FullTensor, Op],
               outputs: set[FullTensor], produced: set[FullTensor]) -> Option:
        if isinstance(t, TwoAxis):
            reads, writes = twoaxis.layouts(op, t, self._layouts)
        else:
            key = (op, t, k)
            if key not in self.shared.layouts:
                self.shared.layouts[key] = op_layouts(op, t, k)
            reads, writes = self.shared.layouts[key]
        got = self.parts.time(op, t, k) if self.parts is not None else None
        fw, bw = got if got is not None else self.profiler.time(op, t, k)
        fw, bw = imbalanced(op, t, fw, bw, self.expert_imbalance)
        grads = not op.no_grad and any(g for _, _, g in reads)
        recomputed = op.oid in self.recompute
        compute = fw + (bw if grads else 0.0) + (fw if recomputed and grads else 0.0)
        comm = self.part_comm(op, t, k, grads)
        grad_sum = 0.0  # seconds a step spends summing this op's weights' gradients
        rs_sum = 0.0  # seconds a micro-batch reduce-scatters them (ZeRO 2 and 3)
        gather_sum = 0.0  # seconds a micro-batch gathers the weights (ZeRO 3)
        mem = 0.0
        transient = 0.0
        seen: set[FullTensor] = set()
        for full, need, grad in reads:
            if full in seen:
                continue
            seen.add(full)
            if full.kind is TensorKind.INPUT and full.is_leaf:
                comm += self.move(full, replicated(full, k), need, grad)
            elif full not in produced and not _is_weight(full):
                # an activation from an earlier stage: it arrives as its boundary sends it
                comm += self.move(full, replicated(full, k), need, grad)
            elif _is_weight(full) and first_reader.get(full) is op:
                canon = None if need is None else need.replicated()
                comm += self.move(full, canon, need, grad)
                piece = (full.numel if need is None else need.piece_numel) * full.dtype.itemsize
                if full.requires_grad:
                    r = 1 if need is None else need.r
                    held, brief = self._weight_bytes(piece)
                    mem += held
                    transient = max(transient, brief)
                    # the optimizer's step over the piece (its shard under ZeRO)
                    compute += self.profiler.optimizer_time(
                        piece / (self.units if self.zero else 1),
                        self.opt_state) / self.micro_batches
                    # the runtime sums a piece's gradient over every rank holding it:
                    # its replicas in the unit (a replicated op's too: its output's
                    # gradient may arrive in partial sums) in every scale unit
                    ring = self.comm.allreduce_time(
                        piece, r * self.units, cross=self.units * k > self.comm.spec.per_node,
                        local=self._local(r, k))
                    step_sum, micro_sum, gathers = self._zero_comm(ring)
                    grad_sum += step_sum
                    rs_sum += micro_sum
                    gather_sum += gathers
                else:
                    mem += piece
        back = bw if grads else 0.0
        comm += self._exposed(grad_sum, back) / self.micro_batches
        comm += max(0.0, rs_sum - back)  # from backward's hooks, on the reducer's stream
        comm += max(0.0, gather_sum - fw - back)  # prefetched while the ops before compute
        act = 0.0
        if grads and not recomputed:
            for full, lay in writes:
                if full.dtype.is_floating_point:
                    act += (full.numel if lay is None else lay.piece_numel) * full.dtype.itemsize
            act += sequence_kept(op, t, k)  # a part's own copies kept for backward
        for full, lay in writes:
            if full in outputs:
                comm += self.move(full, lay, replicated(full, k), full.requires_grad)
        return Option(transform=t, reads=reads, writes=writes, compute=compute, comm=comm,
                      mem=mem + act, act=act,
                      transient=max(transient, sequence_transient(op, t, k)),
                      strategy=part_strategy(op, t, k))

    def part_comm(self, op: Op, t: Transform | None, k: int, grads: bool) -> float:
        """Seconds of the collectives the parts of ``op`` run among themselves under
        ``t`` (a rule whose ``part_op`` is collective, e.g. a cross-entropy split over
        its classes), forward and, where gradients flow, backward: each ``all_reduce``
        as one over the ``k`` parts, each ``all_gather`` as the all-reduce that moves as
        many bytes (and its backward, a reduce-scatter, the same), each ``send_recv`` (a
        ring step) as the all-reduce that moves its bytes once over a link, each
        ``all_to_all`` (the token exchange of expert parallelism, its backward the same)
        as measured (`DeviceSpec.alltoall_time`) for ``expert_imbalance`` times its
        bytes (the busiest device's tokens over the mean: its exchange is the slowest)."""
        if t is None or t.part_op is None or k <= 1:
            return 0.0
        total = 0.0
        calls = attention_calls(op, t, k, grads)  # the sequence split's, from its steps
        for call in self.profiler.collectives(op, t, k) if calls is None else calls:
            if call.kind == "send_recv":  # an all-reduce moves 2(k-1)/k of its bytes
                nbytes = call.nbytes * k / (2 * (k - 1))
            elif call.kind == "all_to_all":
                per_node = self.comm.spec.per_node
                once = self.comm.spec.alltoall_time(
                    call.nbytes * self.expert_imbalance, k, cross=k > per_node,
                    local=min(k, per_node))
                total += once * (2 if grads and call.backward else 1)
                continue
            else:
                nbytes = call.nbytes if call.kind == "all_reduce" else call.nbytes * k / 2
            once = self.comm.allreduce_time(nbytes, k, bucketed=False)
            total += once * (2 if grads and call.backward else 1)
        return total

    def _weight_bytes(self, piece: float) -> tuple[float, float]:
        """(bytes held, bytes held briefly) for a weight piece of ``piece`` bytes under
        the ZeRO stage (docs/zero.md), ``n`` the scale units it is sharded over: stage 0
        the weights, the gradient and ``opt_state`` states; stage 1 the weights and the
        gradient, the states, the fp32 shard and its gradient over ``n``; stage 2 the
        weights, the rest over ``n``; stage 3 everything over ``n``, the piece and its
        gradient gathered while its op runs (briefly). Plus the optimizer's temporaries
        (`_held_for_step`, `_step_temporaries`)."""
        n = self.units if self.zero else 1
        sharded = (self.opt_state + (2 if self.zero else 0)) * piece / n
        whole = {0: 2 * piece, 1: 2 * piece, 2: piece, 3: 0.0}[self.stage]
        brief = self._step_temporaries(piece)
        if self.stage == 3:
            brief = max(brief, 2 * piece)
        return whole + sharded + self._held_for_step(piece), brief

    def _zero_comm(self, ring: float) -> tuple[float, float, float]:
        """The gradient sum of a weight piece whose all-reduce over its holders takes
        ``ring`` seconds, by ZeRO stage: (seconds once a step, seconds each micro-batch
        while backward runs, seconds each micro-batch gathering the weights). Stages 0
        and 1 all-reduce once a step (a reduce-scatter and an all-gather, the same
        bytes); stage 2 reduce-scatters every micro-batch from backward's hooks (half
        the all-reduce) and all-gathers the updated shards once a step; stage 3 also
        gathers the weights before forward and again before backward (half each)."""
        if self.stage <= 1:
            return ring, 0.0, 0.0
        return ring / 2, ring / 2, (ring if self.stage == 3 else 0.0)

    def _local(self, replicas: int, k: int) -> int:
        """Devices in one node of the group that sums a weight piece's gradient: its
        ``replicas`` in a stage of ``k`` devices, times the scale units that share a
        node (units of ``unit`` devices lie node after node)."""
        per_node = self.comm.spec.per_node
        unit = self.unit or k
        if k > per_node:
            return replicas
        return min(replicas * self.units, replicas * max(1, per_node // max(unit, 1)))

    def _exposed(self, grad_sum: float, backward: float) -> float:
        """Seconds of a step's gradient sum that backward does not hide. Summed after
        backward (the reducer's default), all of it. Summed from backward's hooks
        (``overlap_grads``), a bucket is reduced on its own stream while backward
        computes the ops before it; with layers of one size, an op's gradients are
        summed while a layer's worth of backward runs, so this is counted per op as the
        part of its sum longer than its own backward (of the last micro-batch: the
        earlier ones only accumulate)."""
        if not self.overlap_grads or self.stage >= 2:  # ZeRO 2+: the gather after the step
            return grad_sum
        return max(0.0, grad_sum - backward)

    def _gpu(self) -> bool:
        return self.comm.spec.name != "cpu"

    def _held_for_step(self, piece: float) -> float:
        """Bytes a weight piece adds while the step syncs and updates it, on every weight
        at once: Adam's ``foreach`` temporaries (the GPU default, one buffer the size of
        every piece); under ZeRO on gloo, the reduce-scatter's copy of the gradient."""
        if self._gpu():
            return piece
        return piece if self.zero else 0.0

    def _step_temporaries(self, piece: float) -> float:
        """Bytes one weight's update holds briefly, one weight at a time: Adam's
        single-tensor step on a CPU (up to three buffers the size of the piece, or of
        its ZeRO shard)."""
        if self._gpu():
            return 0.0
        return 3 * piece / (self.units if self.zero else 1)

    # -- a stage ------------------------------------------------------------------------
    def build(self, ops: Sequence[Op], k: int, graph_outputs: set[FullTensor],
              all_ops: Sequence[Op] | None = None) -> StageProblem:
        """The problem of running ``ops`` (program order) on ``k`` devices."""
        ops = list(ops)
        index = {op: i for i, op in enumerate(ops)}
        first_reader: dict[FullTensor, Op] = {}
        for op in all_ops or ops:
            for x in op.input_tensors():
                if _is_weight(x.full):
                    first_reader.setdefault(x.full, op)
        producer: dict[FullTensor, int] = {}
        for i, op in enumerate(ops):
            for y in op.output_tensors():
                producer[y.full] = i
        # src[i]: the op whose options op i copies (its place in the first instance);
        # rep[i]: the op whose choice it takes. The first and last instances of a block
        # choose for themselves (what comes before the first, or reads the last, differs
        # from what surrounds the others); the ones between take the second's choice.
        src = list(range(len(ops)))
        rep = list(range(len(ops)))
        for kind in repeated_blocks(ops):
            tpl = kind.template.ops
            insts = kind.instances
            for n, inst in enumerate(insts[1:], start=1):
                for p, op in enumerate(inst.ops):
                    src[index[op]] = index[tpl[p]]
                    if 2 <= n < len(insts) - 1:
                        rep[index[op]] = index[insts[1].ops[p]]
        options: list[tuple[Option, ...] | None] = [None] * len(ops)
        produced = set(producer)
        # the same ops, outputs and first readers: the options of an earlier build hold
        context = (tuple(ops), frozenset(graph_outputs), None if all_ops is None else tuple(all_ops))
        known = self._options.setdefault(context, {})
        written: dict[FullTensor, set[Layout | None]] = {}  # by two-axis options
        for i, op in enumerate(ops):
            template = options[src[i]] if src[i] != i else None  # solved first: earlier
            if template is not None and self._same_weights_role(op, ops[src[i]], first_reader):
                options[i] = self._retarget(template, op, k)
            else:
                options[i] = tuple(
                    self._known(known, op, t, k, first_reader, graph_outputs, produced)
                    for t in self.transforms(op, k)
                    if twoaxis.continues(op, t, written, self._layouts))
                if rep[i] != i and len(options[i]) != len(options[rep[i]]):
                    rep[i] = i
            for o in options[i]:
                if isinstance(o.transform, TwoAxis):
                    for full, lay in o.writes:
                        written.setdefault(full, set()).add(lay)
        for i in range(len(ops)):  # a choice taken from an op whose options differ: its own
            if rep[i] != i and len(options[i]) != len(options[rep[i]]):
                rep[i] = i
        edges: list[Edge] = []
        memo: dict[tuple, tuple[tuple[float, ...], ...]] = {}
        for j, op in enumerate(ops):
            seen: set[tuple[int, FullTensor]] = set()
            for pos, x in enumerate(op.input_tensors()):
                full = x.full
                if full in producer:
                    i = producer[full]
                elif _is_weight(full) and first_reader.get(full) not in (None, op) \
                        and first_reader[full] in index:
                    i = index[first_reader[full]]  # a tied weight: held where its first reader put it
                else:
                    continue
                if (i, full) in seen or i == j:
                    continue
                seen.add((i, full))
                key = (rep[i], rep[j], self._out_pos(ops[i], full), pos,
                       _is_weight(full)) if rep[i] != i or rep[j] != j else None
                if key is not None and key in memo:
                    edges.append(Edge(i, j, memo[key]))
                    continue
                cost = self._edge(options[i], options[j], full, pos, weight=_is_weight(full))
                if key is not None:
                    memo[key] = cost
                if any(c for row in cost for c in row):
                    edges.append(Edge(i, j, cost))
        return StageProblem(ops=tuple(ops), options=tuple(options), edges=tuple(edges),
                            rep=tuple(rep), k=k)

    def _known(self, known: dict[tuple, Option], op: Op, t: Transform | TwoAxis | None, k: int,
               first_reader: dict[FullTensor, Op], outputs: set[FullTensor],
               produced: set[FullTensor]) -> Option:
        """`option`, kept in ``known`` (the options of one build context)."""
        key = (op, t, k)
        if key not in known:
            known[key] = self.option(op, t, k, first_reader, outputs, produced)
        return known[key]

    @staticmethod
    def _out_pos(op: Op, full: FullTensor) -> int:
        for k, y in enumerate(op.output_tensors()):
            if y.full is full:
                return k
        for k, x in enumerate(op.input_tensors()):
            if x.full is full:
                return -1 - k
        return -999

    @staticmethod
    def _same_weights_role(op: Op, tpl: Op, first_reader: dict[FullTensor, Op]) -> bool:
        a = [first_reader.get(x.full) is op for x in op.input_tensors() if _is_weight(x.full)]
        b = [first_reader.get(x.full) is tpl for x in tpl.input_tensors() if _is_weight(x.full)]
        return a == b and len(op.input_tensors()) == len(tpl.input_tensors())

    def _retarget(self, opts: tuple[Option, ...], op: Op, k: int) -> tuple[Option, ...]:
        """The template's options with this instance's tensors (same costs)."""
        ins = [x.full for x in op.input_tensors()]
        outs = [y.full for y in tensors_in(op.outputs)]
        muts = [a.full for _, a in op.mutations if a.full not in set(outs)]
        out = []
        for o in opts:
            reads = tuple((ins[n], lay, g) for n, (_, lay, g) in enumerate(o.reads))
            targets = outs + muts
            writes = tuple((targets[n], lay) for n, (_, lay) in enumerate(o.writes))
            out.append(attrs.evolve(o, reads=reads, writes=writes))
        return tuple(out)

    def _edge(self, src: tuple[Option, ...], dst: tuple[Option, ...], full: FullTensor,
              pos: int, *, weight: bool) -> tuple[tuple[float, ...], ...]:
        helds = []
        for a in src:
            if weight:
                have = next((lay for f, lay, _ in a.reads if f is full), None)
                helds.append(None if have is None else have.replicated())
            else:
                helds.append(next((lay for f, lay in a.writes if f is full), None))
        needs = tuple(b.reads[pos][1:] for b in dst)
        # a move's cost reads the layouts and the tensor's size only
        key = (full.numel, full.dtype.itemsize, tuple(helds), needs)
        if key not in self.shared.edges:
            self.shared.edges[key] = tuple(tuple(self.move(full, held, need, grad)
                                                 for need, grad in needs) for held in helds)
        return self.shared.edges[key]
