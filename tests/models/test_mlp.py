from __future__ import annotations

import pytest
import torch

from nnscaler.ir import verify_graph
from nnscaler.models import MLP, MLPConfig
from nnscaler.models.mlp import make_batch
from nnscaler.trace import trace


def test_mlp_returns_a_loss_and_traces():
    torch.manual_seed(0)
    config = MLPConfig(d_in=8, d_hidden=16, n_classes=4, n_layers=3)
    model = MLP(config)
    args = {"batch": make_batch(config, 4)}
    assert model(args["batch"]).shape == ()
    graph = trace(model, args)
    assert [op.name.rsplit(".", 1)[-1] for op in graph.ops] == [
        "linear", "gelu", "linear", "gelu", "linear", "cross_entropy"
    ]
    assert graph.opaque_ops() == [] and len(graph.parameters()) == 6
    verify_graph(graph, model, args)


def test_mlp_config_is_validated():
    with pytest.raises(ValueError, match="MLPConfig.n_layers must be a positive int, got 0"):
        MLPConfig(n_layers=0)
    assert len(MLP(MLPConfig(n_layers=1)).layers) == 1
