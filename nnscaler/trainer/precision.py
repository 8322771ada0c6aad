"""Mixed precision: fp32 master weights under a bf16/fp16 module, and fp16 loss scaling;
`Precision` applies ``TrainerArgs.precision`` for the Trainer.

``TrainerArgs(precision='bf16')`` (or ``'fp16'``) casts the module's floating-point
parameters, buffers and inputs to that type, so forward and backward run in low
precision. The optimizer must not update low-precision weights directly (small updates
round away), so `mixed_precision` turns any torch optimizer class into one that
keeps, per parameter, an fp32 copy (``state['master_param']``) and fp32 optimizer state:
at each step it casts the gradient to fp32, runs the wrapped algorithm on the master
copy, and writes the result back, rounded, into the module's parameter.
`MixedPrecisionAdamW` is ``mixed_precision(torch.optim.AdamW)`` (they live in
`nnscaler.runtime.f16_optimizer`, nnScaler's import path, and are re-exported here).

The master copy lives in the optimizer state, one value per parameter element, so it is
saved, deduped and merged by ``nnscaler.checkpoint`` like ``exp_avg``.

fp16 has a narrow range: `DynamicLossScaler` multiplies the loss by a large
factor before backward (so small gradients do not underflow), divides the gradients
back before the step, and skips the step and halves the factor when a gradient
overflowed; after ``growth_interval`` clean steps it doubles the factor again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from nnscaler.runtime.f16_optimizer import (
    MixedPrecisionAdam,
    MixedPrecisionAdamW,
    MixedPrecisionError,
    mixed_precision,
)
from nnscaler.trainer.args import TrainerArgs
from nnscaler.trainer.collective import any_rank
from nnscaler.trainer.errors import ConfigError

__all__ = [
    "DTYPES",
    "DynamicLossScaler",
    "MixedPrecisionAdam",
    "MixedPrecisionAdamW",
    "MixedPrecisionError",
    "Precision",
    "grads_overflow",
    "mixed_precision",
]

#: The module dtype of each ``TrainerArgs.precision``.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


class DynamicLossScaler:
    """fp16 dynamic loss scaling (state saved in checkpoints).

    ``scale`` multiplies the loss; `update` halves it after an overflow (the step
    is skipped) and doubles it after ``growth_interval`` steps without one.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1
                and growth_interval > 0):
            raise MixedPrecisionError(
                f"DynamicLossScaler needs init_scale > 0, growth_factor > 1, 0 < "
                f"backoff_factor < 1 and growth_interval > 0; got {init_scale}, "
                f"{growth_factor}, {backoff_factor}, {growth_interval}"
            )
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        """Adjust the scale after a step (``overflow``: a gradient was inf or nan)."""
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])


def grads_overflow(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """A 0-dim float tensor: 1.0 when any gradient of ``params`` holds inf or nan."""
    flags = [torch.logical_not(torch.isfinite(p.grad).all()) for p in params
             if p.grad is not None]
    if not flags:
        return torch.zeros(())
    return torch.stack(flags).any().to(torch.float32)


class Precision:
    """What ``TrainerArgs.precision`` means for one run: the module's dtype, the inputs
    cast to it, the optimizer class (fp32 master weights below fp32) and the loss scaler
    (fp16)."""

    def __init__(self, args: TrainerArgs) -> None:
        self.args = args

    @property
    def dtype(self) -> torch.dtype | None:
        """The module's dtype; None for ``precision: none`` (nothing is converted)."""
        return DTYPES.get(self.args.resolved_precision)

    @property
    def module_dtype(self) -> torch.dtype | None:
        """The dtype ``parallelize`` casts the module to (None: keep it as built)."""
        return None if self.dtype in (torch.float32, None) else self.dtype

    def cast_input(self, batch: Any, device: torch.device) -> Any:
        """Move a batch to ``device``, floating tensors in the module's dtype."""
        dtype = self.dtype

        def move(x: Any) -> Any:
            if not torch.is_tensor(x):
                return x
            if dtype is not None and x.is_floating_point() and x.dtype != dtype:
                x = x.to(dtype)
            return x.to(device, non_blocking=True) if x.device != device else x

        return pytree.tree_map(move, batch)

    def optimizer_class(self, opt_type: Any) -> Any:
        """``opt_type``, wrapped by `mixed_precision` below fp32."""
        if self.args.resolved_precision in ("fp32", "none"):
            return opt_type
        if not (isinstance(opt_type, type) and issubclass(opt_type, torch.optim.Optimizer)):
            raise ConfigError(
                f"precision={self.args.precision!r} keeps fp32 master weights by wrapping "
                f"the optimizer class, but optimizer.type is {opt_type!r}, not a "
                f"torch.optim.Optimizer subclass. Fix: name the optimizer class.",
                "optimizer.type",
            )
        return mixed_precision(opt_type)

    def loss_scaler(self) -> DynamicLossScaler | None:
        """A new loss scaler under fp16, else None."""
        return DynamicLossScaler() if self.args.resolved_precision == "fp16" else None

    @staticmethod
    def overflowed(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
        """True when a gradient of ``optimizer`` holds inf or nan on some rank."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return any_rank(grads_overflow(params), device)
