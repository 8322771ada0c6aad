"""Write the generated files of a few plans of a small GPT into a folder, to diff a
refactoring of code generation against the code before it::

    git stash; .venv/bin/python scripts/codegen_snapshot.py /tmp/before; git stash pop
    .venv/bin/python scripts/codegen_snapshot.py /tmp/after
    diff -r /tmp/before /tmp/after

The plans: tensor parallelism (with and without ZeRO, with recompute), a pipeline (plain,
interleaved, with each stage's block recomputed) and tensor parallelism inside pipeline stages (hybrid), over
more than one scale unit where it adds something; and ZeRO stage 3 under tp, pp with
recompute and hybrid. No process group is needed:
``parallelize`` only writes the files (``load_module=False``). Each plan's files land in
``OUT/<plan>/gencode{rank}.py``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import nnscaler
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.policies import pp, tp


def _recomputed(policy: Callable[..., Any], groups: list[Any]) -> Callable[..., Any]:
    """``policy``, then each of ``groups`` recomputed in backward."""
    def plan(graph: Any, config: Any) -> Any:
        graph = policy(graph, config)
        for group in groups:
            graph.recompute(group)
        return graph

    return plan


BLOCKS = ["gpt.blocks.0", "gpt.blocks.1"]
PIPE = {"pipeline_nmicros": 2}
PLANS: dict[str, tuple[Any, dict[str, Any]]] = {
    "tp": ("tp", dict(plan_ngpus=2, runtime_ngpus=4)),
    "tp_zero": ("tp", dict(plan_ngpus=2, runtime_ngpus=4, use_zero=True)),
    "tp_recompute": (_recomputed(tp, [BLOCKS]), dict(plan_ngpus=2, runtime_ngpus=2)),
    "pp": ("pp", dict(plan_ngpus=2, runtime_ngpus=4, pas_config=PIPE)),
    "pp_interleaved": ("pp", dict(plan_ngpus=2, runtime_ngpus=2, pas_config={
        "pipeline_nmicros": 4, "pipeline_nvirtual": 2, "pipeline_scheduler": "1f1b_interleaved"})),
    "pp_recompute": (_recomputed(pp, BLOCKS), dict(plan_ngpus=2, runtime_ngpus=4,
                                                   pas_config=PIPE)),
    "hybrid": ("hybrid", dict(plan_ngpus=4, runtime_ngpus=8,
                              pas_config={**PIPE, "pipeline_nstages": 2})),
    # ZeRO stage 3: the forward's zero3.gather / prefetch / free and the header's shards
    "tp_zero3": ("tp", dict(plan_ngpus=2, runtime_ngpus=4, zero_stage=3)),
    "pp_zero3_recompute": (_recomputed(pp, BLOCKS), dict(plan_ngpus=2, runtime_ngpus=4,
                                                         pas_config=PIPE, zero_stage=3)),
    "hybrid_zero3": ("hybrid", dict(plan_ngpus=4, runtime_ngpus=8, zero_stage=3,
                                    pas_config={**PIPE, "pipeline_nstages": 2})),
}


def snapshot(out: Path) -> None:
    config = GPTConfig(vocab_size=32, n_layer=2, n_head=4, d_model=16, seq_len=6)
    torch.manual_seed(0)
    batch = make_batch(config, batch_size=4)
    for name, (policy, fields) in PLANS.items():
        with tempfile.TemporaryDirectory() as gen:
            torch.manual_seed(0)
            nnscaler.parallelize(
                GPTWithLoss, {"batch": batch}, policy,
                nnscaler.ComputeConfig(use_end2end=True, **fields), gen_savedir=gen,
                reuse="override", load_module=False, module_fn=lambda: GPTWithLoss(config),
                broadcast_strategy="none")
            (out / name).mkdir(parents=True)
            files = sorted(Path(gen).rglob("gencode*.py"))
            for f in files:
                shutil.copy(f, out / name / f.name)
        print(f"{name}: {len(files)} files")


if __name__ == "__main__":
    if len(sys.argv) != 2 or Path(sys.argv[1]).exists():
        sys.exit("usage: codegen_snapshot.py OUT (a folder that does not exist yet)")
    snapshot(Path(sys.argv[1]))
