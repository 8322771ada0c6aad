"""A short 2-process training script that ends with a plain return (for exit_loop.py).

Run under torchrun: ``torchrun --nproc-per-node 2 bench/runtime/exit_job.py CASE GEN_DIR``
with CASE one of ``dp`` (the project's GPT, data parallel), ``pp`` (the GPT cut into 2
pipeline stages, 1F1B over 2 micro-batches) or ``bert`` (a tiny random Hugging Face
``BertModel``, tensor parallel). It parallelizes (reusing ``GEN_DIR`` after the first run),
trains 3 Adam steps, checks the losses are finite and returns, never through
``os._exit``. ``--end return`` returns right away (the process groups are left to
nnscaler's exit hook); ``--end destroy`` first calls ``dist.destroy_process_group()``, as
a careful script (and ``examples/main_job.py`` until now) does. ``--without-teardown``
unregisters nnscaler's exit hook (:mod:`nnscaler.runtime.teardown`), to count what happens
without it.
"""

from __future__ import annotations

import argparse
import atexit
import math
import os
import warnings

import torch
from torch import nn

from nnscaler import ComputeConfig, build_optimizer, parallelize
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.runtime import init_distributed, teardown

GPT = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16)


class BertWithLoss(nn.Module):
    """A tiny random BERT encoder (built from a config: nothing is downloaded) with a
    scalar loss on its hidden states."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
        self.bert = transformers.BertModel(config, add_pooling_layer=False)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.bert(input_ids=batch["input_ids"]).last_hidden_state
        return hidden.square().mean()


def build(case: str) -> tuple[nn.Module, list[dict[str, torch.Tensor]], str, ComputeConfig]:
    torch.manual_seed(0)
    if case == "dp":
        batches = [make_batch(GPT, batch_size=4, seed=s) for s in range(3)]
        return (GPTWithLoss(GPT), batches, "dp",
                ComputeConfig(plan_ngpus=1, runtime_ngpus=2, use_end2end=True))
    if case == "pp":
        batches = [make_batch(GPT, batch_size=2, seed=s) for s in range(6)]
        return (GPTWithLoss(GPT), batches, "pp",
                ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_end2end=True,
                              pas_config={"pipeline_nmicros": 2,
                                          "pipeline_scheduler": "1f1b"}))
    if case == "bert":
        g = torch.Generator().manual_seed(0)
        batches = [{"input_ids": torch.randint(0, 64, (4, 16), generator=g)} for _ in range(3)]
        return (BertWithLoss(), batches, "tp",
                ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_end2end=True))
    raise SystemExit(f"unknown case {case!r}: dp, pp or bert")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("case", choices=["dp", "pp", "bert"])
    parser.add_argument("gen_dir")
    parser.add_argument("--end", choices=["return", "destroy"], default="return")
    parser.add_argument("--without-teardown", action="store_true")
    args = parser.parse_args()
    if args.without_teardown:
        atexit.unregister(teardown.shutdown)
    os.environ.setdefault("NNSCALER_DEVICE", "cpu")
    warnings.simplefilter("ignore")
    init_distributed()
    model, batches, policy, config = build(args.case)
    parallel = parallelize(model, {"batch": batches[0]}, policy, config,
                           gen_savedir=args.gen_dir, reuse="moo")
    optimizer = build_optimizer(parallel, torch.optim.Adam, lr=1e-3)
    per_step = 2 if args.case == "pp" else 1
    losses = []
    for i in range(0, len(batches), per_step):
        out = parallel.train_step(batches[i:i + per_step])
        optimizer.step()
        optimizer.zero_grad()
        losses += [float(x) for x in out]
    if not all(math.isfinite(x) for x in losses):
        raise SystemExit(f"losses not finite: {losses}")
    if args.end == "destroy":
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
