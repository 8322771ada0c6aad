"""Measure the peak memory of a training step on this rank, to hold the cost model's
memory estimate against.

autodist estimates the bytes per device of a plan (`model`: parameters, gradients,
optimizer state, activations kept for backward, in-flight micro-batches); this module
measures what a step really holds, on the device the step runs on:

- **CUDA**: the caching allocator's own statistics: ``torch.cuda.memory_allocated`` when
  the step starts and ``torch.cuda.max_memory_allocated`` after it (peak statistics reset
  first). Every allocation of the device is counted, whichever thread makes it.
- **CPU**: PyTorch keeps no allocation statistic for CPU tensors, so the peak is rebuilt
  from two measurements. The bytes resident when the step starts are counted from the
  tensors themselves: every storage reachable from ``roots`` (a module's parameters, their
  gradients and buffers; an optimizer's state; any tensor, list or dict), each storage
  once, whole (a gradient that is a view of a reducer's flat buffer counts the buffer).
  During the step, ``torch.profiler.profile(profile_memory=True)`` records every
  allocation and free of the CPU allocator with its time; their running sum, in time
  order, is the change of the bytes held, and its maximum added to the resident bytes is
  the peak. Garbage is collected first, so that no earlier object is freed during the
  step unseen by the resident count.

  The profiler records the allocations of the thread that runs the step and of the
  threads that carry its thread-local state: autograd's engine (on CPU it runs backward in
  the calling thread) and c10d's gloo workers (a collective's work runs with the caller's
  thread-local state, profiler included: the flat buffer an all-gather stages on the
  worker is seen). A thread that does not carry it (a plain ``threading.Thread``) is not
  seen.

  The CPU allocator reports a free with the size it recorded when the block was made
  under a memory profile (this one or an earlier one). A block made outside any profile
  and freed during the step is therefore not counted (the peak after it is too high), or,
  where a block made under an earlier profile had the same address and was freed outside
  one, counted at that block's size. A block freed on a thread without the profiler's
  state (a collective's input released as gloo's worker drops its work) stays counted as
  held. Each shows in `PeakMemory.unaccounted`; measuring every step from the first
  (so that what a step frees was made under a profile) avoids the first two. The true
  peak lies between `PeakMemory.low` and `PeakMemory.high`, equal to ``peak``
  when nothing is unaccounted. The allocator statistic of CUDA has none of these limits.

``PeakMemory.after`` recounts the roots (and what the step returned) when the step ends;
``PeakMemory.end`` is the resident bytes plus the step's net allocations. They are equal
when ``roots`` hold everything the step keeps, which is how a caller checks that the roots
were complete (`PeakMemory.unaccounted`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs
import torch

from nnscaler.errors import NNScalerError

__all__ = ["MeasureError", "PeakMemory", "measure_peak", "tensor_bytes"]

T = TypeVar("T")


class MeasureError(NNScalerError, ValueError):
    """A device `measure_peak` cannot measure."""


@attrs.frozen
class PeakMemory:
    """Bytes held by one rank around one step (see the module's docstring)."""

    device: str  # 'cpu' or 'cuda:N'
    resident: int  # held when the step started
    peak: int  # the most held at any moment of the step
    end: int  # resident + the step's net allocations
    after: int  # recounted from the roots and the step's result when it ended
    method: str  # how ``peak`` was measured

    @property
    def transient(self) -> int:
        """What the step held at its peak beyond what it started with."""
        return self.peak - self.resident

    @property
    def unaccounted(self) -> int:
        """``end - after``: 0 when the roots reach all the step keeps and every free was
        seen (always 0 on CUDA, where both come from the allocator)."""
        return self.end - self.after

    @property
    def low(self) -> int:
        """The least the true peak can be: frees not seen (``unaccounted > 0``) can only
        have made the running sum too high, by at most their total."""
        return self.peak - max(0, self.unaccounted)

    @property
    def high(self) -> int:
        """The most the true peak can be: a free counted too large (``unaccounted < 0``)
        made the running sum too low, by at most the difference."""
        return self.peak + max(0, -self.unaccounted)


def _storages(obj: Any, device: torch.device, seen: dict[int, int],
              visited: dict[int, Any]) -> None:
    """Record in ``seen`` (data pointer -> bytes) every storage on ``device`` reachable
    from ``obj``. ``visited`` keeps what it saw alive, so that no id is reused."""
    if id(obj) in visited:
        return
    visited[id(obj)] = obj
    if isinstance(obj, torch.Tensor):
        if obj.device == device and obj.layout == torch.strided:
            storage = obj.untyped_storage()
            if storage.data_ptr():
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        if obj.grad is not None:
            _storages(obj.grad, device, seen, visited)
    elif isinstance(obj, torch.nn.Module):
        for t in (*obj.parameters(), *obj.buffers()):
            _storages(t, device, seen, visited)
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            _storages(group["params"], device, seen, visited)
        _storages(list(obj.state.values()), device, seen, visited)
    elif isinstance(obj, dict):
        for v in obj.values():
            _storages(v, device, seen, visited)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _storages(v, device, seen, visited)


def tensor_bytes(*roots: Any, device: torch.device | str = "cpu") -> int:
    """Bytes of the distinct storages on ``device`` reachable from ``roots`` (modules:
    parameters, gradients, buffers; optimizers: parameters and state; tensors and their
    gradients; lists, tuples and dicts of these)."""
    seen: dict[int, int] = {}
    _storages(list(roots), torch.device(device), seen, {})
    return sum(seen.values())


def _device_of(roots: Iterable[Any]) -> torch.device:
    """The current CUDA device when ``roots`` hold tensors there, else the CPU."""
    if torch.cuda.is_available():
        cuda = torch.device("cuda", torch.cuda.current_device())
        seen: dict[int, int] = {}
        _storages(list(roots), cuda, seen, {})
        if seen:
            return cuda
    return torch.device("cpu")


def measure_peak(step: Callable[[], T], *roots: Any,
                 device: torch.device | str | None = None) -> tuple[T, PeakMemory]:
    """Run ``step()`` once and measure the bytes this rank held: when it started, at its
    peak and when it ended. ``roots`` must reach what persists across steps (the module,
    the optimizer, the batch). ``device``: where to measure (default: CUDA when the roots
    live there, else CPU). Returns the step's result and the measurement."""
    dev = torch.device(device) if device is not None else _device_of(roots)
    # garbage of earlier work (a replaced module's cycles) would otherwise be freed at some
    # moment of the step: bytes neither in the resident count nor the step's
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        resident = torch.cuda.memory_allocated(dev)
        out = step()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        end = torch.cuda.memory_allocated(dev)
        return out, PeakMemory(device=str(dev), resident=resident, peak=peak, end=end,
                               after=end, method="torch.cuda.max_memory_allocated")
    if dev.type != "cpu":
        raise MeasureError(f"measure_peak measures CPU and CUDA devices, got device={dev}: "
                           f"pass device='cpu' or a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    resident = tensor_bytes(*roots, device=dev)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = step()
    changes = sorted(
        ((e.start_ns(), i, e.nbytes()) for i, e in enumerate(prof.profiler.kineto_results.events())
         if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
    )
    held = top = 0
    for _, _, nbytes in changes:
        held += nbytes
        top = max(top, held)
    after = tensor_bytes(*roots, out, device=dev)
    return out, PeakMemory(device="cpu", resident=resident, peak=resident + top,
                           end=resident + held, after=after,
                           method="resident tensors + torch.profiler memory events")

