"""examples/llama_long trains its Llama on 2 processes with the sequence split in 2: the
ring runs zigzag (sdpa's causal flag, no mask), nothing but attention and the loss's two
sums talk, and the losses equal one process training the same model on the same
sequences (SGD, so that the second step's loss compares at the same tolerance as the
first: Adam's update divides by the root of the squared gradient, so a near-zero
gradient's last-bit difference becomes a whole step and the comparison would measure
Adam rather than the plan)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama_long"
pytest.importorskip("transformers")
SEQ, STEPS, LR = 64, 2, 0.1


def _train(rank: int, world: int, workdir: str) -> list[float]:
    sys.path.insert(0, str(EXAMPLE))
    from train import main

    return main(["--seq", str(SEQ), "--steps", str(STEPS), "--lr", str(LR),
                 "--optimizer", "sgd", "--workdir", workdir])["losses"]


def _reference() -> list[float]:
    sys.path.insert(0, str(EXAMPLE))
    from llama_long import SMALL, LongLlama, byte_windows

    torch.manual_seed(0)
    model = LongLlama(**SMALL, max_positions=1024)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in byte_windows(SEQ, STEPS):
        opt.zero_grad()
        loss = model(batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_the_long_sequence_example_trains_with_zigzag_ring_attention(tmp_path):
    got = run_distributed(_train, 2, str(tmp_path), timeout=600)
    want = _reference()
    assert got[0] == got[1]
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)
    assert got[0][1] < got[0][0]
    code = next(tmp_path.rglob("gencode0.py")).read_text()
    assert code.count("strategy='zigzag'") == 2  # both layers' attention
    assert "all_gather" not in code  # no key, value or logit is gathered
