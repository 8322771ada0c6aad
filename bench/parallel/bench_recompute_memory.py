"""Activation memory per rank with and without recomputation (``graph.recompute``).

Runs ``--world`` CPU processes (gloo, OMP_NUM_THREADS=1). Each parallelizes the 24-layer
``GPTWithLoss`` (d_model 256, 8 heads, seq 128, vocab 1024, batch 4 per scale unit) with a
policy, once as the policy plans it and once with every transformer block in its own
recompute group (the policy, then ``graph.recompute(f"gpt.blocks.{i}")`` for each block),
and runs one forward and backward of each in the same processes. Policies: ``dp``
(``plan_ngpus=1``: the whole model on each rank) and ``tp`` (``plan_ngpus=world``).

How memory is measured: a ``TorchDispatchMode`` sees every tensor that every op makes
during the step (the generated forward, the adapters' collectives, autograd's backward
and the recomputation inside it) and counts the bytes of each new storage until the
storage is freed (a ``weakref.finalize`` on it). Parameters, gradient buffers and the
batch exist before the step and are not counted. Reported per rank, in MiB:

- ``after forward``: the bytes still alive when the forward returns: what autograd keeps
  for backward (the activations), the figure recomputation is for;
- ``peak``: the largest count during forward and backward (with recomputation it
  includes one block's recomputed activations and the gradients being made).

The loss of both runs must be equal (recomputation changes memory, not results). Prints
a table and the ratios (recompute / plain), then one JSON line.

Usage::

    python bench/parallel/bench_recompute_memory.py [--world 2] [--layers 24]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/_launch.py
from _launch import launch  # noqa: E402

from nnscaler import ComputeConfig, parallelize
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.policies import dp, tp

BATCH = 4
TARGET = 0.5  # recompute / plain, activations after forward
POLICIES = {"dp": dp, "tp": tp}


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages the ops make while it is active, until each is
    freed; ``peak`` is the largest count seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self._seen:
                nbytes = storage.nbytes()
                self._seen[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key, nbytes)
        return out


def _config(layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=1024, n_layer=layers, n_head=8, d_model=256, seq_len=128)


def _policy(name: str, recompute: bool) -> Any:
    base = POLICIES[name]

    def policy(graph: Any, compute_config: Any) -> Any:
        graph = base(graph, compute_config)
        if recompute:
            blocks = sorted({int(op.module_path.split(".")[2]) for op in graph.nodes()
                             if op.module_path.startswith("gpt.blocks.")})
            for i in blocks:
                graph.recompute(f"gpt.blocks.{i}")
        return graph

    policy.__qualname__ = f"{name}{'_recompute' if recompute else ''}"
    return policy


def _measure(rank: int, world: int, layers: int, gen_savedir: str) -> dict[str, Any]:
    config = _config(layers)
    out: dict[str, Any] = {}
    for name in POLICIES:
        plan_ngpus = 1 if name == "dp" else world
        batch = make_batch(config, BATCH, seed=rank // plan_ngpus)
        for recompute in (False, True):
            torch.manual_seed(0)
            model = GPTWithLoss(config)
            cfg = ComputeConfig(plan_ngpus=plan_ngpus, runtime_ngpus=world)
            mode = f"{name}{'+recompute' if recompute else ''}"
            pm = parallelize(model, {"batch": batch}, _policy(name, recompute), cfg,
                             gen_savedir=gen_savedir, instance_name=mode.replace("+", "_"))
            del model
            counter = LiveBytes()
            with counter:
                loss = pm(batch)
                after_forward = counter.live
                loss.backward()
            out[mode] = {"after_forward": after_forward, "peak": counter.peak,
                         "loss": loss.item()}
            del pm, loss
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--world", type=int, default=2, help="processes")
    ap.add_argument("--layers", type=int, default=24, help="transformer blocks")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as gen_savedir:
        results = launch(_measure, args.world, args.layers, gen_savedir)
    mib = 2 ** 20
    print(f"{'mode':>14} | {'rank':>4} | {'after forward':>13} | {'peak':>9} | loss")
    summary: dict[str, Any] = {}
    for mode in results[0]:
        for rank, r in enumerate(results):
            m = r[mode]
            print(f"{mode:>14} | {rank:>4} | {m['after_forward'] / mib:9.1f} MiB | "
                  f"{m['peak'] / mib:5.1f} MiB | {m['loss']:.6f}")
        summary[mode] = {"after_forward_mib": [round(r[mode]["after_forward"] / mib, 2)
                                               for r in results],
                         "peak_mib": [round(r[mode]["peak"] / mib, 2) for r in results],
                         "loss": [r[mode]["loss"] for r in results]}
    ratios: dict[str, Any] = {}
    for name in POLICIES:
        plain, rec = f"{name}", f"{name}+recompute"
        fwd = max(r[rec]["after_forward"] / r[plain]["after_forward"] for r in results)
        peak = max(r[rec]["peak"] / r[plain]["peak"] for r in results)
        same = all(r[rec]["loss"] == r[plain]["loss"] for r in results)
        ratios[name] = {"after_forward": round(fwd, 3), "peak": round(peak, 3),
                        "same_loss": same}
        verdict = "ok" if fwd <= TARGET and same else "MISSED"
        print(f"{name}: recompute / plain, worst rank: activations after forward {fwd:.3f} "
              f"(target <= {TARGET}: {verdict}), peak of the step {peak:.3f}; "
              f"equal losses: {'yes' if same else 'NO'}")
    print(json.dumps({"bench": "recompute_memory", "world": args.world, "layers": args.layers,
                      "batch": BATCH, "modes": summary, "ratios": ratios,
                      "target": TARGET}))


if __name__ == "__main__":
    main()
