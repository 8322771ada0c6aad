"""Models that ship with nnscaler: a small GPT and a tiny MLP, each returning its loss."""

from nnscaler.models.gpt import GPT, GPTConfig, GPTWithLoss
from nnscaler.models.mlp import MLP, MLPConfig

__all__ = ["GPT", "GPTConfig", "GPTWithLoss", "MLP", "MLPConfig"]
