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


class _BatchSizedWeightGrad(torch.autograd.Function):
    """``x * w`` whose weight gradient is a mean over the rows times a batch size of 4,
    fixed when it was written: right on one device, wrong on a part of the batch."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return g * w, (g * x).mean(0) * 4


def scale_impl(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _BatchSizedWeightGrad.apply(x, w)


scale = nnscaler.register_op("b d, d -> b d", name="verify_models.scale")(scale_impl)


def fails_on_rank_1_impl(x: torch.Tensor) -> torch.Tensor:
    """Raises on rank 1 of a process group (the single-device reference runs)."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
        raise RuntimeError("verify_models.fails_on_rank_1 fails here on purpose")
    return x + 1.0


fails_on_rank_1 = nnscaler.register_op("b d -> b d", name="verify_models.fails_on_rank_1")(
    fails_on_rank_1_impl)


class Regressor(torch.nn.Module):
    """``linear -> relu -> custom op -> linear -> squared error``; ``op`` picks the custom
    op (``lying_norm``, ``odd_backward``, ``scale``, ``fails_on_rank_1`` or none)."""

    def __init__(self, op: str | None = "lying_norm") -> None:
        super().__init__()
        self.op = op
        self.proj = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 1)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = torch.relu(self.proj(batch["x"]))
        if self.op == "lying_norm":
            h = lying_norm(h)  # the line verify must name
        elif self.op == "odd_backward":
            h = odd_backward(h)  # the line verify must name
        elif self.op == "scale":
            h = scale(h, self.scale)  # the line verify must name
        elif self.op == "fails_on_rank_1":
            h = fails_on_rank_1(h)
        return ((self.out(h).squeeze(-1) - batch["y"]) ** 2).mean()


def regressor_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, generator=g)}
