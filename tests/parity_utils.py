"""Compare a multi-process run with its single-process reference, piece by piece.

Used by the codegen and pipeline parity tests. ``results`` holds, per rank: ``losses``
(per step, this unit's), ``fullmap`` (the module's pieces), ``raw`` (gradients before the
reducers), ``synced`` (after them) and ``params`` (after the optimizer steps). ``ref``
holds ``losses`` (per step, per unit), ``grads`` and ``params`` by parameter name.
"""

from __future__ import annotations

from typing import Any

import torch

RTOL, ATOL = 1e-5, 1e-6
# Adam's eps for parity runs. Some gradients are zero in exact arithmetic: the attention's
# k-projection bias adds the same q.b to every score of a query, and softmax is invariant
# to that, so its gradient is rounding noise (~1e-12 here) whose value depends on the
# order of the sums (the BLAS kernel of the CPU, the split of a matmul, the reduction
# order of the ranks). Adam's step is lr * m / (sqrt(v) + eps): with the default eps=1e-8
# noise of 1e-12..1e-9 becomes a step of 1e-4..1e-2 with the noise's sign, so no two
# machines agree after a step (seen: 1.5e-5 on gpt_blocks_0_attn_k_proj_bias). The step's
# sensitivity to its gradient is at most lr / eps. Rounding noise in a gradient that
# cancels to near zero reaches ~1e-8 (seen on another CPU: the tied embedding of a small
# GPT under a plan whose matmuls split differently); the parity runs use lr=1e-3 with
# eps=1e-4, so such noise moves a parameter by at most 1e-7 per step (below ATOL). Gradients above eps still take Adam's
# normalised steps; smaller real ones take smaller steps (~ lr * g / eps), a function of
# the gradient that the comparison of gradients before the step already pins down.
ADAM_EPS = 1e-4


def by_name(ref: dict[str, torch.Tensor], meta: Any) -> torch.Tensor:
    """The reference tensor of a piece, under any of its (tied) names."""
    for n in (meta.orig_name, *meta.names):
        if n in ref:
            return ref[n]
    raise KeyError(meta.orig_name)


def check_parity(results: list[dict[str, Any]], ref: dict[str, Any], plan_ngpus: int, *,
                 steps: bool = True, zero: bool = False) -> None:
    """Losses per unit; gradients summed over holders; synced gradients (not with ZeRO,
    where they live in the optimizer's shards) and, with ``steps``, parameters (after an
    optimizer whose step is well conditioned in the gradient: SGD, or Adam with
    ``eps=ADAM_EPS``), all at ``RTOL``/``ATOL``."""
    for rank, res in enumerate(results):  # every rank of a unit reports the unit's loss
        unit = rank // plan_ngpus
        got = res["losses"]
        want = [per_unit[unit] for per_unit in ref["losses"]][: len(got)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL,
                                   atol=ATOL, msg=lambda m, r=rank: f"rank {r} losses: {m}")
    totals: dict[str, torch.Tensor] = {}
    for res in results:
        for attr, meta in res["fullmap"].items():
            if meta.kind != "parameter" or attr not in res["raw"]:
                continue
            want = by_name(ref["grads"], meta)
            total = totals.setdefault(meta.orig_name, torch.zeros_like(want))
            meta.take(total).add_(res["raw"][attr])  # a view of total
    for name, total in totals.items():
        want = ref["grads"].get(name)
        if want is not None:
            torch.testing.assert_close(total, want, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name: f"summed gradient of {n}: {m}")
    held = {n for res in results for meta in res["fullmap"].values()
            for n in (meta.orig_name, *meta.names)}
    missing = [n for n, g in ref["grads"].items() if n not in held and g.abs().sum() > 0]
    assert not missing, f"no rank holds the parameters {missing}"
    for rank, res in enumerate(results):
        for attr, meta in res["fullmap"].items():
            if meta.kind != "parameter":
                continue
            grad = by_name(ref["grads"], meta)
            if not zero:
                torch.testing.assert_close(res["synced"][attr], meta.take(grad), rtol=RTOL,
                                           atol=ATOL,
                                           msg=lambda m, a=attr, r=rank: f"rank {r} {a} grad: {m}")
            if steps:
                torch.testing.assert_close(res["params"][attr],
                                           meta.take(by_name(ref["params"], meta)),
                                           rtol=RTOL, atol=ATOL,
                                           msg=lambda m, a=attr, r=rank: f"rank {r} {a}: {m}")


def check_zero3_header(pm: Any) -> int:
    """The docstring of a ZeRO stage-3 module's generated file lists, per parameter piece,
    the flat elements ``[start, end)`` that this rank's shard holds: they must be what the
    runtime's buckets hold (`nnscaler.codegen.gathers.shard_ranges` against
    `nnscaler.runtime.bucket.Bucket`). Returns how many pieces were compared."""
    import inspect
    import re

    head = open(inspect.getfile(type(pm))).read().split('"""')[1]
    head = re.sub(r"\n {16}", " ", head)  # a wrapped entry, joined back
    shown = {m.group(1): (int(m.group(2) or 0), int(m.group(3) or 0)) for m in re.finditer(
        r"^ {8}(\w+) \([^)]*\)(?: \[[^\]]*\])?: (?:\[(\d+), (\d+)\)|none) of \d+$", head,
        re.M)}
    attr_of = {id(getattr(pm, a)): a for a in pm.fullmap}
    held = {}
    for reducer in pm.reducers:
        if reducer.stage < 3:
            continue
        for b in reducer.buckets:
            lo, hi = b.shard_index * b.shard_numel, (b.shard_index + 1) * b.shard_numel
            for p, off in zip(b.params, b.offsets):
                start, end = max(lo, off), min(hi, off + p.numel())
                held[attr_of[id(p)]] = (start - off, end - off) if start < end else (0, 0)
    assert shown == held, (shown, held)
    return len(held)
