"""A small model with a heavy submodule, shared by the tests that parallelize only the
submodule (tests/parallel/test_submodule.py, tests/checkpoint/test_nested.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Heavy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.proj = nn.Linear(32, 8, bias=False)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(x)))


class Parent(nn.Module):
    def __init__(self, heavy: nn.Module) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.heavy = heavy
        self.post = nn.Linear(8, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.post(self.heavy(torch.tanh(self.pre(x)))), y)
