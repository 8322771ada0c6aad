"""Optimizers with fp32 master weights for low-precision (bf16/fp16) parameters, at
nnScaler's import path: ``nnscaler.runtime.f16_optimizer.MixedPrecisionAdam`` /
``MixedPrecisionAdamW``, and `mixed_precision` for any other torch optimizer class.

Each low-precision parameter gets an fp32 copy (``state['master_param']``) and fp32
optimizer state: a step casts the gradient to fp32, runs the wrapped algorithm on the
master copy and writes the result back, rounded, into the parameter. The master copy is
optimizer state like ``exp_avg``, so ``nnscaler.checkpoint`` saves, dedupes and merges it.
nnScaler keeps its copies in separate fp32 parameters instead; the Trainer's
``clip_gnorm`` / ``scale_grads`` act on the gradients here, which the step casts to fp32.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from nnscaler.errors import MixedPrecisionError

__all__ = ["MixedPrecisionAdam", "MixedPrecisionAdamW", "MixedPrecisionError", "mixed_precision"]


def _raw_step(cls: type) -> Any:
    """``cls.step`` without torch's hook wrapper (the wrapper of our own class runs the
    hooks once; the inner algorithm must not run them a second time)."""
    step = cls.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


class _MixedPrecisionMixin:
    """Master weights in fp32 for the parameters of lower precision (see module doc)."""

    _nnscaler_base: type[torch.optim.Optimizer]

    def _low_precision_params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.param_groups  # type: ignore[attr-defined]
                for p in group["params"]
                if p.is_floating_point() and p.dtype != torch.float32]

    def step(self, closure: Any = None) -> Any:
        """Run the wrapped optimizer on fp32 master copies of the low-precision params."""
        swapped = []
        for p in self._low_precision_params():
            # the master leaves the state during the step: optimizers initialise their
            # state when it is empty
            master = self.state[p].pop("master_param", None)  # type: ignore[attr-defined]
            if master is None:
                master = p.detach().to(torch.float32)
            low, grad = p.data, p.grad
            p.grad = None
            p.data = master
            p.grad = None if grad is None else grad.to(torch.float32)
            swapped.append((p, low, grad))
        try:
            loss = _raw_step(self._nnscaler_base)(self, closure)
        finally:
            for p, low, grad in swapped:
                master = p.data
                p.grad = None
                p.data = low
                p.grad = grad
                with torch.no_grad():
                    low.copy_(master)
                self.state[p]["master_param"] = master  # type: ignore[attr-defined]
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load, keeping the state of low-precision parameters (the master copies and
        their moments) in fp32: torch casts floating state to each parameter's dtype,
        so the parameters are shown to it as fp32 while it loads."""
        lows = []
        for group in self.param_groups:  # type: ignore[attr-defined]
            for p in group["params"]:
                if p.is_floating_point() and p.dtype != torch.float32:
                    lows.append((p, p.data, p.grad))
                    p.grad = None
                    p.data = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        try:
            super().load_state_dict(state_dict)  # type: ignore[misc]
        finally:
            for p, low, grad in lows:
                p.data = low
                p.grad = grad


@functools.cache
def mixed_precision(optimizer_cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """A subclass of ``optimizer_cls`` that keeps fp32 master weights and fp32 state for
    parameters of lower precision (fp32 parameters are updated as usual).

    ``mixed_precision(torch.optim.SGD)(params, lr=0.1)`` is built like the original.
    The same class is returned for the same ``optimizer_cls``.
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise MixedPrecisionError(
            f"mixed_precision wraps a torch.optim.Optimizer subclass, got {optimizer_cls!r}. "
            f"Fix: pass the optimizer class (e.g. torch.optim.AdamW), not a factory."
        )
    if issubclass(optimizer_cls, _MixedPrecisionMixin):
        return optimizer_cls
    name = f"MixedPrecision{optimizer_cls.__name__}"
    cls = type(name, (_MixedPrecisionMixin, optimizer_cls), {
        "_nnscaler_base": optimizer_cls,
        "__module__": __name__,
        "__doc__": f"{optimizer_cls.__name__} with fp32 master weights (see "
                   f"nnscaler.runtime.f16_optimizer).",
    })
    return cls


MixedPrecisionAdamW = mixed_precision(torch.optim.AdamW)
MixedPrecisionAdam = mixed_precision(torch.optim.Adam)
