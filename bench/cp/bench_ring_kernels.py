"""Ring attention on block kernels against the masked ring it replaces, on CPU processes.

Since the ring runs its steps on block kernels (`nnscaler.ops.builtin.attention_kernels`:
the math kernel here, flash-attention's on GPU), two paths exist in the same processes:
``blocks`` (`ring_forward` / `ring_backward` through `_KernelRing`) and ``masked`` (the
ring that applies a mask to each block, `_RingAttention`, which ran every case before).
Forward and backward of ``context_parallel_attention`` on ``--world`` gloo processes, 4
heads of 64, ``--seq`` tokens in all, the modes interleaved, each the median of
``--steps`` CPU-time measurements (``time.process_time``: robust to a loaded machine):

- ``causal``: zigzag ring, causal, no mask;
- ``documents``: plain ring, a mask of ``--docs`` packed documents (causal within each),
  which the block path reads into varlen sequences and the masked path applies.

Prints one line per case with the ratio blocks / masked, and one JSON line. Usage::

    OMP_NUM_THREADS=1 python bench/cp/bench_ring_kernels.py [--seq 4096] [--world 2]
        [--docs 8] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nnscaler.testing import run_distributed


def _worker(rank: int, world: int, seq: int, docs: int, steps: int) -> dict:
    import nnscaler.ops.builtin.context_parallel as cp
    from nnscaler.runtime.partgroup import ProcessPartGroup

    group = ProcessPartGroup(list(range(world)))
    g = torch.Generator().manual_seed(rank)
    c = seq // world
    q, k, v = (torch.randn(1, 4, c, 64, generator=g, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 4, c, 64, generator=g)
    doc = torch.repeat_interleave(torch.arange(docs), torch.full((docs,), seq // docs))
    packed = (doc[:, None] == doc[None]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    cases = {"causal": dict(is_causal=True, strategy="zigzag"),
             "documents": dict(attn_mask=packed.chunk(world, 0)[rank], strategy="ring")}
    kernel_shapes, documents_of = cp._kernel_shapes, cp.documents_of
    modes = {"blocks": (kernel_shapes, documents_of),
             "masked": (lambda *a: False, lambda *a: None)}
    times: dict = {case: {mode: [] for mode in modes} for case in cases}
    try:
        for step in range(steps + 1):  # the first round warms up
            for case, kwargs in cases.items():
                for mode, (shapes, docs_of) in modes.items():
                    cp._kernel_shapes, cp.documents_of = shapes, docs_of
                    t0 = time.process_time()
                    out = cp.context_parallel_attention(q, k, v, group=group, **kwargs)
                    out.backward(dout)
                    if step:
                        times[case][mode].append(time.process_time() - t0)
    finally:
        cp._kernel_shapes, cp.documents_of = kernel_shapes, documents_of
    return {case: {mode: sorted(ts)[len(ts) // 2] for mode, ts in m.items()}
            for case, m in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    ranks = run_distributed(_worker, args.world, args.seq, args.docs, args.steps, timeout=1800)
    result = {}
    for case in ranks[0]:
        # the busiest rank sets the step
        blocks = max(r[case]["blocks"] for r in ranks)
        masked = max(r[case]["masked"] for r in ranks)
        result[case] = {"blocks_s": blocks, "masked_s": masked, "ratio": blocks / masked}
        print(f"{case:10s} blocks {blocks * 1e3:8.1f} ms  masked {masked * 1e3:8.1f} ms  "
              f"blocks / masked {blocks / masked:.2f}")
    print(json.dumps({"seq": args.seq, "world": args.world, "docs": args.docs, **result}))


if __name__ == "__main__":
    main()
