"""Parity: parallel training equals the single process that sees the same samples.

Each case trains a tiny model 3 Adam steps on ``runtime_ngpus`` gloo processes and checks,
on every rank, the per-micro-batch losses and every parameter piece against the reference
(one process, gradients summed over all units' micro-batches), rtol 1e-5.
"""

from __future__ import annotations

import pytest
from dist_utils import run_distributed

from .common import Case, train_parallel

CASES = [
    Case("mlp", "dp", 1, 2),
    Case("mlp", "tp", 2, 2, end2end=True),
    Case("mlp", "data", 2, 4, use_zero=True, end2end=True),
    Case("mlp", "tp", 2, 4, use_async_reducer=True, micro=2),
    Case("gpt", "dp", 1, 2, use_async_reducer=True, end2end=True, micro=2),
    Case("gpt", "tp", 2, 2, use_zero=True),
    Case("gpt", "tp", 2, 4, use_zero=True, use_async_reducer=True, end2end=True),
    Case("gpt", "data", 2, 2, end2end=True),
]


def _worker(rank, world, case, gen_savedir):
    return train_parallel(case, rank, gen_savedir)


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_parity(case, tmp_path):
    results = run_distributed(_worker, case.runtime_ngpus, case, str(tmp_path))
    assert all(r["checked"] > 0 for r in results)
