"""A tiny MLP classifier: the smallest model the parallel tests and examples use.

``MLP`` takes a batch ``{'x': [B, d_in] float, 'y': [B] class indices}`` and returns the
mean cross-entropy of ``n_layers`` linear layers with GELU between them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Sizes of an `MLP`: ``n_layers`` linears, ``d_in -> d_hidden ... -> n_classes``."""

    d_in: int = 16
    d_hidden: int = 32
    n_classes: int = 8
    n_layers: int = 3

    def __post_init__(self) -> None:
        for field in ("d_in", "d_hidden", "n_classes", "n_layers"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MLPConfig.{field} must be a positive int, got {value!r}")


class MLP(nn.Module):
    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        sizes = [config.d_in] + [config.d_hidden] * (config.n_layers - 1) + [config.n_classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = batch["x"]
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < len(self.layers) - 1:
                h = F.gelu(h)
        return F.cross_entropy(h, batch["y"])


def make_batch(config: MLPConfig, batch_size: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random batch for `MLP`."""
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(batch_size, config.d_in, generator=g),
        "y": torch.randint(0, config.n_classes, (batch_size,), generator=g),
    }
