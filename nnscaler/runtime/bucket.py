"""`Bucket`: parameters of one dtype whose gradients share one flat buffer, with the
ZeRO shard they own (stage 1 and up) and, for stage 3, whether their values are
gathered. `nnscaler.runtime.reducer.Reducer` owns the buckets (and re-exports this class).
"""

from __future__ import annotations

from typing import Any

import torch

from nnscaler.runtime.zero import padded_numel

__all__ = ["Bucket"]


class Bucket:
    """A group of same-dtype parameters whose gradients share one flat buffer."""

    def __init__(
        self, params: list[torch.nn.Parameter], nshards: int, shard_index: int, zero: bool,
        stage: int | None = None, unit: str = "",
    ):
        self.params = params
        self.stage = (1 if zero else 0) if stage is None else stage
        self.unit = unit  # stage 3: the gathering unit ('' the rest)
        self.gathered = True  # stage 3: whether param_buffer has storage
        self.gather_work: Any = None
        self.gather_src: torch.Tensor | None = None
        self.offsets: list[int] = []
        numel = 0
        for p in params:
            self.offsets.append(numel)
            numel += p.numel()
        self.numel = numel
        self.zero = zero
        self.nshards = nshards if zero else 1
        self.shard_index = shard_index if zero else 0
        self.padded_numel = padded_numel(numel, self.nshards)
        self.shard_numel = self.padded_numel // self.nshards
        dtype, device = params[0].dtype, params[0].device
        # stage 2 keeps no full gradient: the buffer is empty and a transient one is packed
        # at each launch (`pack_grads`)
        self.grad_buffer = torch.zeros(0 if self.stage >= 2 else self.padded_numel,
                                       dtype=dtype, device=device)
        self.param_buffer: torch.Tensor | None = None
        self.shard_param: torch.nn.Parameter | None = None
        if zero:
            # parameters become views of one flat buffer so gather_params() can all-gather
            # straight into them
            self.param_buffer = torch.zeros(self.padded_numel, dtype=dtype, device=device)
            with torch.no_grad():
                for p, view in zip(params, self.param_views()):
                    view.copy_(p.detach())
                    p.data = view
            lo = self.shard_index * self.shard_numel
            shard = self.param_buffer[lo : lo + self.shard_numel].detach().clone().float()
            self.shard_param = torch.nn.Parameter(shard)
            self.shard_param.grad = None
        self.attach_grads()
        # async bookkeeping
        self.ready: set[int] = set()
        self.work: Any = None
        self.launched = False
        self.shard_out: torch.Tensor | None = None  # zero: reduced gradient shard in flight
        self.packed: torch.Tensor | None = None  # stage 2: the flat gradient being reduced

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [
            buffer[off : off + p.numel()].view(p.shape) for p, off in zip(self.params, self.offsets)
        ]

    def grad_views(self) -> list[torch.Tensor]:
        return self._views(self.grad_buffer)

    def param_views(self) -> list[torch.Tensor]:
        if self.param_buffer is None:
            raise RuntimeError("param_views() needs zero=True (parameters are flat only with ZeRO)")
        return self._views(self.param_buffer)

    def attach_grads(self) -> None:
        """Make every ``param.grad`` the view of the bucket buffer (stage 2: None)."""
        if self.stage >= 2:
            for p in self.params:
                p.grad = None
            return
        for p, view in zip(self.params, self.grad_views()):
            p.grad = view

    def adopt_grad(self, i: int, view: torch.Tensor | None = None) -> None:
        """Bring param ``i``'s gradient back into the buffer if something replaced it.

        ``param.grad`` may have been set to None (``optimizer.zero_grad(set_to_none=True)``)
        or to a fresh tensor (autograd then allocates one); the buffer slot is made to hold
        the current gradient (zero when None) and ``param.grad`` becomes the view again.
        """
        p = self.params[i]
        if view is None:
            off = self.offsets[i]
            view = self.grad_buffer[off : off + p.numel()].view(p.shape)
        g = p.grad
        if g is None:
            view.zero_()
        elif g.data_ptr() == view.data_ptr() and g.shape == view.shape:
            return
        else:
            view.copy_(g)
        p.grad = view

    def adopt_all(self) -> None:
        for i, view in enumerate(self.grad_views()):
            self.adopt_grad(i, view)

    def pack_grads(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stage 2: the parameters' gradients in one new flat tensor of ``dtype`` (None:
        the parameters'; zero where a gradient is None); the parameters' ``.grad``
        become None."""
        flat = torch.zeros(self.padded_numel, dtype=dtype or self.params[0].dtype,
                           device=self.params[0].device)
        for p, off in zip(self.params, self.offsets):
            if p.grad is not None:
                flat[off : off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        return flat

    def shard_slice(self, buffer: torch.Tensor) -> torch.Tensor:
        lo = self.shard_index * self.shard_numel
        return buffer[lo : lo + self.shard_numel]
