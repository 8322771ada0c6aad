"""Repeated blocks: the layers of a model recognised as one computation on other weights."""

from __future__ import annotations

import torch
from torch import nn

from nnscaler.graph import IRGraph
from nnscaler.graph.blocks import layer_path, repeated_blocks
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.trace import trace


def _gpt(n_layer: int) -> IRGraph:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, n_layer=n_layer, n_head=2, d_model=16, seq_len=8)
    return IRGraph.from_graph(trace(GPTWithLoss(cfg), {"batch": make_batch(cfg, 2)}))


def test_gpt_layers_are_one_kind():
    g = _gpt(4)
    kinds = repeated_blocks(g.nodes())
    assert len(kinds) == 1
    kind = kinds[0]
    assert [b.path for b in kind.instances] == [f"gpt.blocks.{i}" for i in range(4)]
    sizes = {len(b.ops) for b in kind.instances}
    assert len(sizes) == 1
    for block in kind.instances:  # position p is the same op in every instance
        assert [op.name for op in block.ops] == [op.name for op in kind.template.ops]
        assert all(layer_path(op) == block.path for op in block.ops)


def test_different_shapes_are_different_kinds():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8),
                                         nn.Linear(8, 4), nn.Linear(4, 4), nn.Linear(4, 4)])

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x.sum()

    g = IRGraph.from_graph(trace(Net(), {"x": torch.randn(2, 8)}))
    kinds = repeated_blocks(g.nodes())
    paths = sorted([b.path for b in k.instances] for k in kinds)
    # layers.0 reads the forward argument (no gradient flows into it): not like 1 and 2;
    # layers.3 (8 -> 4) is alone; layers.4 and 5 (4 -> 4)
    assert paths == [["layers.1", "layers.2"], ["layers.4", "layers.5"]]
    assert repeated_blocks(g.nodes(), min_count=3) == []


def test_no_layers_no_blocks():
    g = IRGraph.from_graph(trace(nn.Linear(4, 4), {"input": torch.randn(2, 4)}))
    assert repeated_blocks(g.nodes()) == []
