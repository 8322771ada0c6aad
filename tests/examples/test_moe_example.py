"""examples/moe/train.py trains a tiny Mixtral with expert parallelism on 2 processes: a
few steps, the routing of the expert-parallel group recorded every step."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from dist_utils import run_distributed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe"
pytest.importorskip("transformers")


def _train(rank: int, world: int, tmp: str, dense: bool) -> tuple[float, int, list]:
    os.chdir(tmp)
    sys.path.insert(0, str(EXAMPLE))
    from train import main

    trainer = main(["--steps", "2"] + (["--dense"] if dense else []))
    parts = trainer.last_routing[0].tokens_per_part if trainer.last_routing else []
    return trainer.last_train_loss, trainer.global_step, parts


@pytest.mark.slow
def test_the_moe_example_trains_with_expert_parallelism(tmp_path):
    ep = run_distributed(_train, 2, str(tmp_path), False, timeout=600)
    assert [r[1] for r in ep] == [2, 2] and ep[0][0] == ep[1][0] < 10
    # two ranks share the experts: the pairs each runs, 2 x 32 tokens x 4 sequences x top-2
    assert len(ep[0][2]) == 2 and sum(ep[0][2]) == 2 * 32 * 4
