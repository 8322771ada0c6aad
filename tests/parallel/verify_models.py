"""Models for tests/parallel/test_verify.py: custom ops whose annotation lies.

Kept in their own module so that generated code (and forked ranks) import the very
functions registered here.
"""

from __future__ import annotations

import torch

import nnscaler


def lying_norm_impl(x: torch.Tensor) -> torch.Tensor:
    """Normalises each column over the rows, while its annotation says rows are independent."""
    return torch.softmax(x, dim=0)


#: registered as ``b d -> b d``: a split of the rows (the batch) changes the result
lying_norm = nnscaler.register_op("b d -> b d", name="verify_models.lying_norm")(lying_norm_impl)


class _OddBackward(torch.autograd.Function):
    """Forward ``2 x`` (rows independent); backward mixes the rows' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2.0

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g * 2.0 + g.mean(0, keepdim=True)


def odd_backward_impl(x: torch.Tensor) -> torch.Tensor:
    return _OddBackward.apply(x)


odd_backward = nnscaler.register_op("b d -> b d", name="verify_models.odd_backward")(
    odd_backward_impl)


class Regressor(torch.nn.Module):
    """``linear -> relu -> custom op -> linear -> squared error``; ``op`` picks the custom
    op (``lying_norm``, ``odd_backward``, or none)."""

    def __init__(self, op: str | None = "lying_norm") -> None:
        super().__init__()
        self.op = op
        self.proj = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = torch.relu(self.proj(batch["x"]))
        if self.op == "lying_norm":
            h = lying_norm(h)  # the line verify must name
        elif self.op == "odd_backward":
            h = odd_backward(h)  # the line verify must name
        return ((self.out(h).squeeze(-1) - batch["y"]) ** 2).mean()


def regressor_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, generator=g)}
