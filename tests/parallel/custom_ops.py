"""Custom ops for the promise-check and decorator-form tests, defined at the top level of
an importable module (as user code would) with ``@register_op`` as a decorator."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import nnscaler

#: How many times each op's function ran (the promise check runs them too).
CALLS = {"row_scale": 0}


@nnscaler.register_op("n d -> n d", name="tests.lying_column_norm")
def lying_column_norm(x: torch.Tensor) -> torch.Tensor:
    """Claims rows are independent ('n' splits) while it normalises across rows."""
    return x / x.norm(dim=0, keepdim=True)


@nnscaler.register_op("n d^ -> n d^", name="tests.row_scale")
def row_scale(x: torch.Tensor) -> torch.Tensor:
    """Normalises each row: rows are independent, 'd' is not."""
    CALLS["row_scale"] += 1
    return x / x.norm(dim=1, keepdim=True)


@nnscaler.register_op("n d^ -> n d^", name="tests.row_scale_src", code_impl_pattern="source")
def row_scale_src(x: torch.Tensor) -> torch.Tensor:
    """``row_scale`` again, carried into the generated file as source (so it may name
    modules, ``F`` here, but no other module-level name)."""
    return F.normalize(x, dim=1)


OPS = {"lying": lying_column_norm, "import": row_scale, "source": row_scale_src}


class UsesOp(nn.Module):
    """linear -> the custom op -> linear -> mean squared error."""

    def __init__(self, which: str) -> None:
        super().__init__()
        self.which = which
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = OPS[self.which](self.fc1(x))
        return ((self.fc2(h) - y) ** 2).mean()


def make_batch(seed: int, n: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 8, generator=g), "y": torch.randn(n, 4, generator=g)}


@nnscaler.register_op("n d^ -> n d^", name="tests.uses_a_global", code_impl_pattern="source")
def uses_a_global(x: torch.Tensor) -> torch.Tensor:
    """Not self-contained: the generated file would not have ``CALLS``."""
    CALLS["row_scale"] += 0
    return x


OPS["global"] = uses_a_global
