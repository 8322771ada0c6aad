"""Parity: parallel training equals the single process that sees the same samples.

Each case trains a tiny model 3 Adam steps on ``runtime_ngpus`` gloo processes and checks,
on every rank, the per-micro-batch losses and every parameter piece against the reference
(one process, gradients summed over all units' micro-batches), rtol 1e-5.
"""

from __future__ import annotations

import pytest
from dist_utils import run_distributed

from .common import Case, train_parallel


def _matrix() -> list[Case]:
    """Every model x policy, each with and without ZeRO and the async reducer, on one
    scale unit and on two (runtime_ngpus = 2 x plan_ngpus); train_step and plain
    forward/backward and 1 or 2 micro-batches alternate over the cases."""
    cases = []
    for kind in ("mlp", "gpt"):
        for policy in ("dp", "tp", "data"):
            plan = 1 if policy == "dp" else 2
            for i, (zero, asyn, units) in enumerate(
                (z, a, u) for z in (False, True) for a in (False, True) for u in (1, 2)
            ):
                cases.append(Case(kind, policy, plan, plan * units, use_zero=zero,
                                  use_async_reducer=asyn, end2end=i % 3 == 0,
                                  micro=2 if i % 4 in (1, 2) else 1))
    return cases


CASES = _matrix()


def _worker(rank, world, case, gen_savedir):
    return train_parallel(case, rank, gen_savedir)


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_parity(case, tmp_path):
    results = run_distributed(_worker, case.runtime_ngpus, case, str(tmp_path))
    assert all(r["checked"] > 0 for r in results)
