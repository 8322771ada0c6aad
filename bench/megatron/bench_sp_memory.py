"""Activation memory of the ``megatron`` policy's sequence parallelism at tp=2, against
tensor parallelism without it.

Two measurements on the GPT of ``bench/parallel/bench_tp_vs_dtensor.py`` (4 layers,
d_model 256, seq 128, batch 8):

1. *between-block regions* (from the plan, one process): the bytes written on device 0
   by the ops outside the tensor-parallel regions (norms, dropout, residual adds, the
   embeddings' sum), each op's output pieces as the plan places them;
2. *saved for backward* (measured, 2 gloo processes): the bytes of the distinct tensors
   autograd keeps during one forward of the parallel module on rank 0
   (``torch.autograd.graph.saved_tensors_hooks``; parameters excluded), for the whole
   model, which also holds the regions that sequence parallelism does not change.

Usage::

    python bench/megatron/bench_sp_memory.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "parallel"))
import bench_tp_vs_dtensor as tpb  # noqa: E402
from _launch import launch  # noqa: E402
from nnscaler_policy_megatron import megatron_compute_config, plan  # noqa: E402

from nnscaler import parallelize  # noqa: E402
from nnscaler.graph import IRGraph  # noqa: E402
from nnscaler.models.gpt import make_batch  # noqa: E402
from nnscaler.trace import trace  # noqa: E402

TARGET = 0.6


def _nbytes(x: Any) -> int:
    return x.full.dtype.itemsize * int(torch.Size(x.shape).numel())


def region_bytes() -> dict[str, int]:
    """Bytes the between-block ops write on device 0, without and with sp."""
    warnings.simplefilter("ignore")
    batch = make_batch(tpb.CONFIG, tpb.BATCH, seed=0)
    traced = trace(tpb._model(), {"batch": batch})
    out = {}
    outside: set[int] = set()
    for name, sp in (("tp", False), ("tp_sp", True)):
        cfg = SimpleNamespace(plan_ngpus=2, runtime_ngpus=2, use_zero=False,
                              pas_config={"tensor_model_parallel_size": 2,
                                          "sequence_parallel": sp})
        g, p = plan(IRGraph.from_graph(traced), cfg)
        if not sp:
            outside = {op.oid for op in p.replicated}
        out[name] = sum(_nbytes(x) for op in g.nodes()
                        if op.device == 0 and g.origin(op).oid in outside
                        for x in op.output_tensors())
    return out


def _saved(rank: int, world: int, gen: str) -> dict[str, int]:
    batch = make_batch(tpb.CONFIG, tpb.BATCH, seed=0)
    out = {}
    for name, sp in (("tp", False), ("tp_sp", True)):
        cfg = megatron_compute_config(tensor_model_parallel_size=world, sequence_parallel=sp)
        pm = parallelize(tpb._model(), {"batch": batch}, "megatron", cfg, gen_savedir=gen,
                         instance_name=name)
        params = {p.data_ptr() for p in pm.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, params: set[int] = params,
                 seen: dict[int, int] = seen) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = pm(batch)
        loss.backward()
        out[name] = sum(seen.values())
    return out


def main() -> None:
    regions = region_bytes()
    with tempfile.TemporaryDirectory() as gen:
        saved = launch(_saved, 2, gen)[0]
    r_ratio = regions["tp_sp"] / regions["tp"]
    s_ratio = saved["tp_sp"] / saved["tp"]
    print(f"GPTWithLoss {tpb.CONFIG}, batch {tpb.BATCH}, tp=2, rank 0")
    print(f"between-block regions (plan): tp {regions['tp'] / 2**20:.2f} MiB, tp+sp "
          f"{regions['tp_sp'] / 2**20:.2f} MiB, ratio {r_ratio:.3f} (target <= {TARGET}: "
          f"{'ok' if r_ratio <= TARGET else 'MISSED'})")
    print(f"saved for backward, whole model (measured): tp {saved['tp'] / 2**20:.2f} MiB, "
          f"tp+sp {saved['tp_sp'] / 2**20:.2f} MiB, ratio {s_ratio:.3f}")
    print(json.dumps({"bench": "megatron_sp_memory", "regions": regions,
                      "regions_ratio": round(r_ratio, 3), "saved": saved,
                      "saved_ratio": round(s_ratio, 3), "target": TARGET}))


if __name__ == "__main__":
    main()
