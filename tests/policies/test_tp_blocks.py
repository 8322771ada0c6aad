"""``tp`` reuses the choices of repeated blocks: the plan is the greedy's, op by op."""

from __future__ import annotations

import pytest
import torch
from policy_cases import config

import nnscaler.policies.tensor_parallel as tpm
from nnscaler.graph import IRGraph
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.trace import trace


def _signature(g):
    return [(op.name, op.device, op.opdef.name if op.opdef else None,
             tuple((x.indmap, x.valmap) for x in op.input_tensors()),
             tuple((x.indmap, x.valmap) for x in op.output_tensors())) for op in g.ops]


@pytest.mark.parametrize("n", [2, 4])
def test_reuse_gives_the_greedy_plan(n, monkeypatch):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, n_layer=6, n_head=4, d_model=32, seq_len=8)
    traced = trace(GPTWithLoss(cfg), {"batch": make_batch(cfg, 4)})
    reused = tpm.tp(IRGraph.from_graph(traced), config(n))
    calls = []
    orig = tpm._BlockReuse.choice_for

    def counting(self, op, greedy):
        t = orig(self, op, greedy)
        calls.append(t is not tpm._SCORE)
        return t

    monkeypatch.setattr(tpm._BlockReuse, "choice_for", counting)
    tpm.tp(IRGraph.from_graph(traced), config(n))
    assert sum(calls) >= 3 * 20  # blocks 2..4 taken from block 1
    monkeypatch.setattr(tpm._BlockReuse, "choice_for", lambda self, op, greedy: tpm._SCORE)
    scored = tpm.tp(IRGraph.from_graph(traced), config(n))
    assert _signature(reused) == _signature(scored)
