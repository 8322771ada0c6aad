"""The parallel run of [`verify`][nnscaler.verify]: every runtime rank loads its generated
``gencode{rank}.py`` and runs one forward and backward while a ``sys.settrace`` function
keeps every tensor local of the generated methods and, after backward, its gradient.

The ranks are this process group's under torchrun; otherwise `spawn` forks CPU processes
joined by gloo. `fresh` and `backward` are shared with the single-device reference.
"""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from nnscaler.config import ComputeConfig
from nnscaler.errors import VerifyError
from nnscaler.testing import free_port


def fresh(tree: Any) -> Any:
    def copy_leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        return x

    return pytree.tree_map(copy_leaf, tree)


def _first_tensor(out: Any) -> torch.Tensor | None:
    """The loss of an end2end module: the first output, as ``train_step`` takes it."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(out, dict) and out:
        first = next(iter(out.values()))
        return first if isinstance(first, torch.Tensor) else None
    return None


def backward(out: Any, end2end: bool) -> None:
    """Backward from the loss (end2end) or from the sum of every output (otherwise)."""
    if end2end:
        loss = _first_tensor(out)
        roots = [loss] if loss is not None and loss.requires_grad else []
    else:
        roots = [t.float().sum() for t in pytree.tree_leaves(out)
                 if isinstance(t, torch.Tensor) and t.requires_grad]
    if roots:
        torch.stack([r.reshape(()) for r in roots]).sum().backward()


class Recorder:
    """A ``sys.settrace`` function that keeps every tensor local of the generated forward
    (``_forward_impl``) or stage methods (``_stage_{s}``) when it first appears: its value
    (a copy) and the tensor itself, whose gradient is read after backward."""

    def __init__(self, files: set[str], samples: list[Any]) -> None:
        self.files = files
        self.samples = samples
        self.values: dict[tuple[int, str], torch.Tensor] = {}
        self.live: dict[tuple[int, str], torch.Tensor] = {}
        self.calls: dict[str, int] = {}

    def _micro(self, frame: FrameType) -> int:
        code = frame.f_code
        args = [frame.f_locals.get(n) for n in code.co_varnames[1:code.co_argcount]]
        for m, sample in enumerate(self.samples):
            if any(a is sample for a in args):
                return m
        k = self.calls.get(code.co_name, 0)  # e.g. a forward of plain arguments
        self.calls[code.co_name] = k + 1
        return k

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if event != "call" or code.co_filename not in self.files:
            return None
        if code.co_name != "_forward_impl" and not code.co_name.startswith("_stage_"):
            return None
        micro = self._micro(frame)
        seen: set[str] = set()

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event in ("line", "return"):
                for name, value in frame.f_locals.items():
                    if name in seen or not isinstance(value, torch.Tensor):
                        continue
                    seen.add(name)
                    self.values[(micro, name)] = value.detach().to("cpu", copy=True)
                    if value.requires_grad:
                        if not value.is_leaf:
                            try:
                                value.retain_grad()
                            except RuntimeError:  # e.g. a view changed in place
                                continue
                        self.live[(micro, name)] = value
            return local

        return local

    def result(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]]:
        out = {}
        for key, value in self.values.items():
            t = self.live.get(key)
            grad = None if t is None or t.grad is None else t.grad.detach().to("cpu", copy=True)
            out[key] = (value, grad)
        return out


def _to(tree: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def run_rank(outdir: str, rank: int, args: Mapping[str, Any], end2end: bool,
              nmicros: int, zero: bool) -> dict[str, Any]:
    """Load rank ``rank``'s generated module, run one forward and backward while
    recording; return the records (``vars``) and, but under ZeRO (where they live in
    the optimizer's shards), the gradients of its parameter pieces after the reducers
    (``params``: attribute -> (its `AttrMeta`, gradient))."""
    from nnscaler.codegen.files import load_generated_class
    from nnscaler.gendir import gencode_name

    cls = load_generated_class(outdir, rank)
    model = cls()
    files = {str(Path(outdir).resolve() / gencode_name(rank)),
             inspect.getsourcefile(cls) or ""}
    if end2end:
        sample = next(iter(args.values()))
        samples = [_to(fresh(sample), model.device) for _ in range(nmicros)]
    else:
        samples = [_to(fresh(dict(args)), model.device)]
    recorder = Recorder(files, samples)
    previous = sys.gettrace()
    sys.settrace(recorder)
    try:
        if end2end:
            model.train_step(samples)
        else:
            out = model(**samples[0])
            sys.settrace(previous)
            backward(out, end2end=False)
    finally:
        sys.settrace(previous)
    params: dict[str, Any] = {}
    if not zero:
        model.sync_grad()
        for attr, p in model.named_parameters():
            meta = model.fullmap.get(attr)
            if meta is not None and p.grad is not None:
                params[attr] = (meta, p.grad.detach().to("cpu", copy=True))
    return {"vars": recorder.result(), "params": params}


def _worker(fn: Callable[[int], Any], rank: int, world: int, port: int, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      NNSCALER_DEVICE="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result: tuple[str, Any] = ("ok", fn(rank))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        result = ("error", traceback.format_exc())
    path = os.path.join(outdir, f"rank{rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)
    if result[0] == "error":  # the parent stops the other ranks, which may wait forever
        open(os.path.join(outdir, f"rank{rank}.failed"), "w").close()  # noqa: SIM115
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)  # a forked child: skip the parent's atexit handlers and finalisers


def spawn(fn: Callable[[int], Any], world: int, timeout: float) -> list[Any]:
    """``fn(rank)`` on ``world`` forked CPU processes joined by gloo; results by rank."""
    ctx = mp.get_context("fork")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="nnscaler-verify-") as outdir:
        procs = [ctx.Process(target=_worker, args=(fn, r, world, port, outdir))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(os.path.exists(os.path.join(outdir, f"rank{r}.failed")) or
                   (p.exitcode is not None and p.exitcode != 0) for r, p in enumerate(procs)):
                time.sleep(0.5)  # a rank failed: the others may wait for it forever
                break
            time.sleep(0.02)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        marks = {r: os.path.join(outdir, f"rank{r}.failed") for r in range(world)}
        failed = sorted((r for r in range(world) if os.path.exists(marks[r])),
                        key=lambda r: os.stat(marks[r]).st_mtime_ns)  # the first to fail
        results = []
        for r in failed + [r for r in range(world) if r not in failed]:  # a failure first
            path = os.path.join(outdir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise VerifyError(f"verify: rank {r} died or ran past {timeout:.0f} s (exit code "
                                  f"{procs[r].exitcode}); run it under torchrun to see its "
                                  f"output, or raise timeout=")
            status, value = torch.load(path, weights_only=False)
            if status == "error":
                raise VerifyError(f"verify: rank {r} failed running the parallel plan:\n{value}")
            results.append((r, value))
        return [value for _, value in sorted(results, key=lambda x: x[0])]


def run_everywhere(outdir: str, args: dict[str, Any], config: ComputeConfig, nmicros: int,
                    timeout: float) -> list[Any]:
    """Every rank's records of the files in ``outdir``: run by the ranks of the process
    group under torchrun, else by ``runtime_ngpus`` forked CPU processes."""

    def run(rank: int) -> Any:
        return run_rank(outdir, rank, args, config.use_end2end, nmicros, config.use_zero)

    if not (dist.is_available() and dist.is_initialized()):
        return spawn(run, config.runtime_ngpus, timeout)
    if dist.get_world_size() != config.runtime_ngpus:
        raise VerifyError(
            f"verify runs the plan on runtime_ngpus={config.runtime_ngpus} processes, "
            f"but the process group has {dist.get_world_size()}; launch torchrun "
            f"with --nproc-per-node {config.runtime_ngpus}, or call verify outside "
            f"torch.distributed to let it start its own processes")
    mine = run(dist.get_rank())
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, mine)
    return records
