from __future__ import annotations

import warnings

import pytest
import torch

from nnscaler.ir import run_graph, verify_graph
from nnscaler.models import GPT, GPTConfig, GPTWithLoss
from nnscaler.models.gpt import make_batch
from nnscaler.trace import OpaqueOpWarning, trace

TINY = dict(vocab_size=96, n_layer=2, n_head=4, d_model=32, seq_len=16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(d_model=30), r"d_model \(30\) must be divisible by n_head \(4\)"),
        (dict(n_layer=0), r"GPTConfig.n_layer must be a positive int, got 0"),
        (dict(attn="flash"), r"attn must be one of \('sdpa', 'manual'\), got 'flash'"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
    ],
)
def test_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**TINY, **kwargs})


def test_lm_head_is_tied_and_too_long_input_is_refused():
    model = GPT(GPTConfig(**TINY))
    assert model.lm_head.weight is model.wte.weight
    with pytest.raises(ValueError, match="input_ids has 17 positions but GPTConfig.seq_len is 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_manual_attention_computes_what_sdpa_computes():
    torch.manual_seed(0)
    sdpa = GPTWithLoss(GPTConfig(**TINY, attn="sdpa"))
    manual = GPTWithLoss(GPTConfig(**TINY, attn="manual"))
    manual.load_state_dict(sdpa.state_dict())
    batch = make_batch(sdpa.gpt.config, 2)
    torch.testing.assert_close(manual(batch), sdpa(batch), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attn", ["sdpa", "manual"])
@pytest.mark.parametrize("strategy", ["real", "meta"])
def test_gpt_traces_with_both_strategies_and_the_graph_reproduces_it(attn, strategy):
    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(**TINY, attn=attn))
    args = {"batch": make_batch(model.gpt.config, 2)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpaqueOpWarning)  # every op is annotated
        graph = trace(model, args, strategy=strategy)
    assert graph.opaque_ops() == []
    params = graph.named_parameters()
    assert params["gpt.wte.weight"] is params["gpt.lm_head.weight"]
    assert len(graph.parameters()) == len(list(model.parameters()))
    assert graph.output_tensors()[0].shape == ()
    verify_graph(graph, model, args)  # bitwise, also for a graph traced on meta
    # one block's worth of ops per layer
    per_layer = [sum(op.module_path.startswith(f"gpt.blocks.{i}.") for op in graph.ops)
                 for i in range(2)]
    assert per_layer[0] == per_layer[1] > 10


def test_graph_prints_one_readable_line_per_op():
    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(**TINY))
    graph = trace(model, {"batch": make_batch(model.gpt.config, 2)})
    text = str(graph)
    lines = text.splitlines()
    assert len(lines) == len(graph.ops) + 4  # header, input, tied, ops..., return
    assert lines[0].startswith(f"Graph: {len(graph.ops)} ops (0 opaque), 36 parameters")
    assert lines[1] == "  input batch: batch['input_ids']:i64[2,16], batch['labels']:i64[2,16]"
    assert lines[2] == "  tied parameter gpt.wte.weight: also gpt.lm_head.weight"
    i, q_op = next((i, op) for i, op in enumerate(graph.ops) if op.module_path.endswith("q_proj"))
    q = lines[3 + i]
    assert "= torch.nn.functional.linear(t" in q and "gpt.blocks.0.attn.q_proj.weight" in q
    assert q.endswith(f"f32[2,16,32], f32[32,32], f32[32] -> f32[2,16,32] | "
                      f"gpt.blocks.0.attn.q_proj (Linear) | gpt.py:{q_op.source_line}")
    sdpa = next(line for line in lines if "scaled_dot_product_attention" in line)
    assert "is_causal=True" in sdpa and "| gpt.blocks.0.attn (CausalSelfAttention) | gpt.py:" in sdpa
    assert lines[-1].startswith("  return t")
    # the printed source line is the model's own code
    op = next(op for op in graph.ops if "scaled_dot_product_attention" in op.name)
    assert op.code.startswith("y = F.scaled_dot_product_attention(q, k, v")


def test_interpreter_runs_the_graph_on_other_weights_and_inputs():
    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(**TINY))
    graph = trace(model, {"batch": make_batch(model.gpt.config, 2)}, strategy="meta")
    other = GPTWithLoss(GPTConfig(**TINY))
    batch = make_batch(model.gpt.config, 2, seed=7)
    assert torch.equal(run_graph(graph, other, {"batch": batch}), other(batch))


def test_both_strategies_record_the_same_calls():
    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(**TINY))
    args = {"batch": make_batch(model.gpt.config, 2)}
    real, meta = (trace(model, args, strategy=s) for s in ("real", "meta"))

    def summary(graph):
        return [(op.name, [t.shape for t in op.output_tensors()], op.module_path) for op in graph]

    assert summary(real) == summary(meta)
