"""autodist's sequence axis: the splits whose parts talk along the sequence, as options.

Two splits let a stage keep a sequence split through a whole model, and both come from
the ops' own transform spaces (`nnscaler.ops.builtin.context_parallel`,
`nnscaler.ops.builtin.token_loss`):

- **self-attention along the sequence**: ``scaled_dot_product_attention`` split along the
  key's sequence dim runs the *ring* (*zigzag* when causal and the sequence divides by
  twice the parts), along the value's *Ulysses* where the query and key/value heads
  divide by the parts (else the ring again, so that option is dropped as a duplicate);
- **a mean cross-entropy over its tokens**: each part sums and counts its own tokens'
  losses and one all-reduce of the two numbers gives the mean. The kernel offers this
  split inside `token_split` only; autodist plans inside it (`planning`), so a batch or
  sequence split reaches the loss instead of gathering the logits.

What they cost, per part (`CostModel.option` asks `PartTimes` and `ring_backward_comm`):

- *compute*: the part op itself, timed on this machine on tensors of a part's shapes
  with a group that does not communicate (`RecordingGroup`; its ``send_recv`` copies),
  forward and backward, as the part that works most (the last: in a causal plain ring
  it computes every block, the first one block); spread over the ranks like the
  profiler's jobs and cached in ``profile_dir`` (``parts-<device>.json``), then scaled
  by the profiler's calibration. The ring's blocks are matmuls with a log-sum-exp merge,
  not the fused kernel the whole op runs (on this project's CPUs a ring part of 2 takes
  about 3-5 times half the whole op), so its share of the whole op would be far off.
  With a named ``device_type`` nothing runs: the whole op's analytic time over the
  parts, times ``(2n - 1) / n`` for the causal plain ring's last part.
- *communication*, costed by `CostModel.part_comm` with the measured collectives: the
  ring's ``n - 1`` steps of the key and value chunks forward, and backward again with
  their gradients (`attention_calls`); Ulysses' all-to-alls (``n - 1`` rounds of
  ``send_recv`` for the query, key, value and output, and again backward); zigzag's
  half-chunk swaps; the token loss's one all-reduce of two numbers (twice with its
  gradient; recorded on meta tensors like any part op whose parts talk).
- *memory*: activations as for any split (each part keeps its chunk); briefly, as the
  option's ``transient`` (a stage holds the largest, `sequence_transient`): the ring's
  buffers in flight, two key and two value chunks (a block and, backward, its gradients
  arriving while the ones in hand are held) and one output chunk (a block's partial
  output merged into the running one), and the pieces of Ulysses' all-to-alls arriving;
  kept from forward to backward (`sequence_kept`), zigzag's and Ulysses' re-laid query,
  key, value and output (four chunks).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from nnscaler.extend import (
    CONTEXT_PARALLEL_ATTENTION,
    TOKEN_PARALLEL_CE,
    Op,
    SubTensor,
    Transform,
    map_over_ranks,
    part_piece,
    token_split,
)
from nnscaler_policy_autodist.profile import (
    ComputeProfiler,
    JsonCache,
    PartCall,
    ProfileJob,
    RecordingGroup,
    run_job,
    tensor_spec,
)

__all__ = ["PartTimes", "attention_calls", "part_strategy", "planning", "sequence_kept",
           "sequence_transient", "usable"]

logger = logging.getLogger("nnscaler.autodist.sequence")

#: the part ops this module times and costs
PART_OPS = (CONTEXT_PARALLEL_ATTENTION, TOKEN_PARALLEL_CE)
#: bump when the way a part is timed changes (invalidates the cache's entries)
METHOD = 1


@contextmanager
def planning() -> Iterator[None]:
    """Plan within it: a mean cross-entropy's transform space includes its token split
    (enumerating options, applying the chosen ones and replaying a plan file alike)."""
    with token_split():
        yield


def part_strategy(op: Op, t: Transform | None, k: int) -> str | None:
    """How the parts of ``op`` split by ``t`` over ``k`` devices talk along the sequence:
    ``'ring'``, ``'zigzag'``, ``'ulysses'`` (self-attention), ``'tokens'`` (a mean loss's
    token split), or ``None`` for any other option."""
    if t is None or k <= 1 or t.part_op not in PART_OPS or op.opdef is None:
        return None
    if t.part_op == TOKEN_PARALLEL_CE:
        return "tokens"
    return str(op.opdef.part_kwargs(t, op.kwargs, 0).get("strategy", "ring"))


def usable(op: Op, t: Transform | None, k: int) -> bool:
    """Whether to offer ``t``: the value's sequence split of attention where the heads do
    not divide runs the ring, as the key's split does (same plan, same costs): dropped.
    Likewise the token split asked for by the target (the same parts as the input's)."""
    if t is None or t.part_op not in PART_OPS:
        return True
    if t.part_op == TOKEN_PARALLEL_CE:
        return t.idx == 0
    return not (t.idx == 2 and part_strategy(op, t, k) != "ulysses")


def _chunk_bytes(op: Op, t: Transform, k: int, pos: int) -> int:
    x = op.inputs[pos] if pos < len(op.inputs) else None
    if not isinstance(x, SubTensor):
        return 0
    piece = part_piece(x, t.inputs[pos], k, 0)
    return math.prod(b - a for a, b in piece.indmap) * x.full.dtype.itemsize


def attention_calls(op: Op, t: Transform | None, k: int, grads: bool
                    ) -> tuple[PartCall, ...] | None:
    """The collectives one part of a sequence-split self-attention runs, as
    `CostModel.part_comm` costs them (each twice where ``backward``: once forward and
    its mirror backward); ``None`` for any other option. Written from the part op's
    steps rather than recorded on meta tensors (the ring's blocks are tiles of the
    sequence: recording them takes seconds at 16K tokens and minutes at 64K):

    - ring: ``n - 1`` steps sending the key and value chunks; its own backward
      (`_KernelRing`, or `_RingAttention` with a mask) sends them again *with* their
      gradients and a last step takes the gradients home, ``n`` sends of each more than
      the forward's mirror (charged once, where gradients flow);
    - zigzag: the ring, after swapping half-chunks of the query, key and value (two
      sends of a half each) and before swapping the output's back (autograd's mirror
      backward);
    - Ulysses: ``n - 1`` sends of ``1 / n`` of the query, key, value and output chunks
      (the all-to-alls), mirrored backward.

    A mask with rows is swapped with the zigzag and gathered by Ulysses."""
    strategy = part_strategy(op, t, k)
    if t is None or strategy not in ("ring", "zigzag", "ulysses"):
        return None
    q, kc, vc = (_chunk_bytes(op, t, k, pos) for pos in range(3))
    e, ev = _last(op, 0), _last(op, 2)
    out = q * ev // e if e else q
    mask = op.inputs[3] if len(op.inputs) > 3 else None
    rows = _chunk_bytes(op, t, k, 3) if isinstance(mask, SubTensor) and mask.ndim >= 2 \
        and mask.shape[-2] != 1 else 0
    mask_grad = isinstance(mask, SubTensor) and mask.full.requires_grad
    calls: list[PartCall] = []
    if strategy == "ulysses":
        for nbytes in (q, kc, vc, out):
            calls += [PartCall("send_recv", nbytes // k, True)] * (k - 1)
        if rows:
            calls.append(PartCall("all_gather", rows, mask_grad))
        return tuple(calls)
    if strategy == "zigzag":
        for nbytes in (q, kc, vc, out):
            calls += [PartCall("send_recv", nbytes // 2, True)] * 2
        if rows:
            calls += [PartCall("send_recv", rows // 2, mask_grad)] * 2
    calls += [PartCall("send_recv", kc, True), PartCall("send_recv", vc, True)] * (k - 1)
    if grads:  # the ring's backward beyond the forward's mirror
        calls += [PartCall("send_recv", kc, False), PartCall("send_recv", vc, False)] * k
    return tuple(calls)


def _last(op: Op, pos: int) -> int:
    x = op.inputs[pos] if pos < len(op.inputs) else None
    return x.shape[-1] if isinstance(x, SubTensor) else 0


def sequence_transient(op: Op, t: Transform | None, k: int) -> float:
    """Bytes a part holds briefly beyond what the op holds on its chunk alone.

    - ring and zigzag: the key and value blocks arriving from the previous part while
      the ones in hand are held, and in backward their gradients with them (two key and
      two value chunks), and a block's partial output while it is merged into the
      running output by the log-sum-exp rule (one output chunk). Measured on CPU against
      a part of one with the same chunk (`test_autodist_sequence.py`): the plain causal
      ring's busiest part holds exactly this, zigzag's 0.5-0.8 of it;
    - Ulysses: the pieces of one re-laid tensor arriving before they are concatenated,
      ``(n - 1) / n`` of its largest chunk (the re-laid tensors themselves are kept:
      `sequence_kept`)."""
    strategy = part_strategy(op, t, k)
    if t is None or strategy not in ("ring", "zigzag", "ulysses"):
        return 0.0
    q, kc, vc, out = _chunks(op, t, k)
    if strategy == "ulysses":
        return max(q, kc, vc, out) * (k - 1) / k
    return 2.0 * (kc + vc) + out


def sequence_kept(op: Op, t: Transform | None, k: int) -> float:
    """Bytes a part keeps from forward to backward beyond its output: zigzag's
    query, key, value and output in zigzag order (its ring's saved tensors; the output
    it returns is swapped back), Ulysses' re-laid by heads (what attention on them saves);
    the plain ring saves its inputs and output, already counted. Measured after the
    forward on 2 gloo processes: the ring holds its output, zigzag and Ulysses 5 chunks."""
    if part_strategy(op, t, k) not in ("zigzag", "ulysses"):
        return 0.0
    return float(sum(_chunks(op, t, k)))


def _chunks(op: Op, t: Transform, k: int) -> tuple[int, int, int, int]:
    """Bytes of a part's query, key, value and output chunks."""
    q, kc, vc = (_chunk_bytes(op, t, k, pos) for pos in range(3))
    e, ev = _last(op, 0), _last(op, 2)
    return q, kc, vc, (q * ev // e if e else q)


def time_part(job: tuple[ProfileJob, int]) -> tuple[float, float] | str:
    """Run one part job on this rank: the part op with a group of ``n`` parts that
    does not communicate, as its last part (picklable: `map_over_ranks` sends it)."""
    base, n = job
    group = RecordingGroup(n)
    group.index = n - 1
    return run_job(ProfileJob(op=base.op, args=base.args,
                              kwargs={**base.kwargs, "group": group}, grads=base.grads))


class PartTimes(JsonCache):
    """Measured (forward, backward) seconds of the sequence parts (see the module docs),
    cached per device beside the profiler's cache."""

    def __init__(self, profiler: ComputeProfiler) -> None:
        self.profiler = profiler
        self._read_table(profiler.path.with_name(f"parts-{profiler.key}.json"),
                         profiler.measure, "part cache")

    def _job(self, op: Op, t: Transform, k: int) -> tuple[str, tuple[ProfileJob, int]]:
        args = [tensor_spec(part_piece(x, t.inputs[n], k, 0)) if isinstance(x, SubTensor) else x
                for n, x in enumerate(op.inputs)]
        kwargs = dict(op.opdef.part_kwargs(t, op.kwargs, 0))
        grads = not op.no_grad and any(x.full.requires_grad for x in op.input_tensors())
        key = f"part{METHOD}|{t.part_op}|{k}|{args!r}|{sorted(kwargs.items())!r}|{grads}"
        return key, (ProfileJob(op=str(t.part_op), args=args, kwargs=kwargs, grads=grads), k)

    def prefetch(self, requests: Sequence[tuple[Op, Transform | None, int]]) -> int:
        """Measure every sequence part of ``requests`` missing from the cache, spread
        over the ranks; returns how many were measured."""
        if not self.profiler.measure:
            return 0
        jobs: dict[str, tuple[ProfileJob, int]] = {}
        for op, t, k in requests:
            if t is not None and part_strategy(op, t, k) is not None:
                key, job = self._job(op, t, k)
                if key not in self._table:
                    jobs.setdefault(key, job)
        if jobs:
            for key, got in zip(jobs, map_over_ranks(time_part, list(jobs.values()))):
                self._store(key, got)
        return len(jobs)

    def _store(self, key: str, got: tuple[float, float] | str) -> None:
        if isinstance(got, str):
            logger.info("autodist: a sequence part could not run here (%s); costing it "
                        "as the whole op's share", got)
            self._table[key] = [-1.0, -1.0]
        else:
            self._table[key] = [float(got[0]), float(got[1])]
        self._dirty = True

    def time(self, op: Op, t: Transform | None, k: int) -> tuple[float, float] | None:
        """(forward, backward) seconds of the part of ``op`` split by ``t`` over ``k``,
        calibrated like the profiler's; ``None`` where ``t`` is no sequence part."""
        strategy = part_strategy(op, t, k)
        if t is None or strategy is None:
            return None
        if self.profiler.measure:
            key, job = self._job(op, t, k)
            if key not in self._table:
                self._store(key, time_part(job))
            fw, bw = self._table[key]
            if fw >= 0:
                scale = self.profiler.factors[0] * self.profiler.clock_share
                return fw * scale, bw * scale
        fw, bw = self.profiler.time(op, None, 1)
        share = 1.0 / k
        if strategy == "ring" and op.kwargs.get("is_causal"):
            share *= (2 * k - 1) / k  # the last part computes every block it sees
        return fw * share, bw * share
