"""The README's main job, at the project's current stage.

Traces the project's GPT into an annotated graph, prints the graph, shows the transform
space of one op, then trains a few Adam steps twice from the same initial weights: once
eagerly and once by replaying the traced graph with the reference interpreter, and
compares the losses step by step. (When the runtime lands, this becomes a 2-process
tensor-parallel training run compared against the single-device loss.)
"""

from __future__ import annotations

import copy
import time

import torch

from nnscaler.ir import run_graph
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.trace import trace


def train(model: torch.nn.Module, forward, batches) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = forward(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=32)
    model = GPTWithLoss(config)
    batches = [make_batch(config, batch_size=4, seed=step) for step in range(5)]

    start = time.perf_counter()
    graph = trace(model, {"batch": batches[0]}, strategy="meta")
    print(f"traced {len(graph.ops)} ops in {time.perf_counter() - start:.3f} s (meta strategy)")
    print("\n".join(str(graph).splitlines()[:12]))
    print("  ...")
    linear = next(op for op in graph.ops if op.name == "torch.nn.functional.linear")
    print(f"transform space of {linear.name} at {linear.short_source}:")
    for t in linear.anno.transform_space(num=2)[:4]:
        print(f"  {t}")

    eager_model = copy.deepcopy(model)
    graph_model = copy.deepcopy(model)
    eager = train(eager_model, lambda m, b: m(b), batches)
    replay = train(graph_model, lambda m, b: run_graph(graph, m, {"batch": b}), batches)
    for step, (a, b) in enumerate(zip(eager, replay)):
        print(f"step {step}: eager loss {a:.6f}  graph loss {b:.6f}  |diff| {abs(a - b):.2e}")
    if eager != replay:
        raise SystemExit("the traced graph does not reproduce the eager model")
    print("graph replay matches the eager model bitwise at every step")


if __name__ == "__main__":
    main()
