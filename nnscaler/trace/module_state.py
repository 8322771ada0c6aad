"""What the real-strategy trace changes in the user's module, saved before forward runs
and put back after, so that tracing leaves the module as it was.
"""

from __future__ import annotations

from typing import Any

import torch

from nnscaler.trace.call_kinds import storage_of, version_of


class SavedState:
    """What the tracing forward may change in the user's module, saved before it runs and
    put back after, so that tracing leaves the module as it was: buffers (BatchNorm's
    running statistics and ``num_batches_tracked``), the parameters a call may write in
    place, module attributes that held a buffer or parameter, and the random number
    generators (dropout draws from them)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.slots: list[tuple[dict[str, Any], str, torch.Tensor | None]] = []
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.params: dict[int, tuple[torch.Tensor, int]] = {}
        self.param_copies: dict[int, torch.Tensor] = {}
        self.storages: dict[int, torch.Tensor] = {}  # storage address -> parameter
        for m in module.modules(remove_duplicate=False):
            for attr, b in m._buffers.items():
                self.slots.append((m._buffers, attr, b))
                if b is not None and id(b) not in self.buffers:
                    self.buffers[id(b)] = (b, b.detach().clone(), version_of(b))
            for attr, p in m._parameters.items():
                self.slots.append((m._parameters, attr, p))
                if p is not None:
                    self.params.setdefault(id(p), (p, version_of(p)))
                    self.storages.setdefault(storage_of(p), p)
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def keep(self, tensors: list[torch.Tensor]) -> None:
        """Copy the parameters that ``tensors`` are or alias (``p.data``, views) before a
        call that may write them."""
        for t in tensors:
            p = self.storages.get(storage_of(t))
            if p is not None and id(p) not in self.param_copies:
                self.param_copies[id(p)] = p.detach().clone()

    def restore(self) -> list[str]:
        """Put everything back; returns the shapes of parameters that changed in a way
        that cannot be undone (none were copied before the write)."""
        for slots, attr, tensor in self.slots:
            if slots.get(attr) is not tensor:
                slots[attr] = tensor
        changed: list[str] = []
        with torch.no_grad():
            for t, copy, _ in self.buffers.values():  # also written through aliases
                if t.device.type != "meta" and (version_of(t) == -1 or not torch.equal(t, copy)):
                    t.copy_(copy)
            for key, (p, version) in self.params.items():
                copy = self.param_copies.get(key)
                if copy is not None:
                    p.copy_(copy)
                elif version_of(p) != version:
                    changed.append(str(list(p.shape)))
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        return changed
