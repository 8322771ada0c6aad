"""Models nobody here wrote: Hugging Face models from tiny random configs (no download).

Each is wrapped so that forward takes a dict and returns the loss, traced with the real
strategy, and replayed by the interpreter: loss and every parameter's gradient must match.
Llama and GPT-2 must trace without a single opaque op.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from nnscaler.ir import verify_graph
from nnscaler.trace import trace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 2, 16, 512
LLAMA = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
)


class WithLoss(nn.Module):
    """``forward(batch) -> loss`` for a Hugging Face model that computes its own loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss


def tokens() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def llama() -> tuple[nn.Module, dict]:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)), tokens()


def gpt2() -> tuple[nn.Module, dict]:
    config = transformers.GPT2Config(
        n_embd=128, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=256, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config), tokens()


def mixtral() -> tuple[nn.Module, dict]:
    config = transformers.MixtralConfig(**LLAMA, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config), tokens()


def bert() -> tuple[nn.Module, dict]:
    config = transformers.BertConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=256, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    batch = tokens()
    batch["labels"][:, ::2] = -100  # only some positions are masked-LM targets
    return transformers.BertForMaskedLM(config), batch


def vit() -> tuple[nn.Module, dict]:
    config = transformers.ViTConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        image_size=32, patch_size=8, num_channels=3, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    g = torch.Generator().manual_seed(0)
    batch = {
        "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
        "labels": torch.randint(0, 10, (BATCH,), generator=g),
    }
    return transformers.ViTForImageClassification(config), batch


MODELS: dict[str, tuple[Callable[[], tuple[nn.Module, dict]], bool]] = {
    # name: (builder, every op must be annotated)
    "llama": (llama, True),
    "gpt2": (gpt2, True),
    "mixtral": (mixtral, False),
    "bert": (bert, False),
    "vit": (vit, False),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_traces_and_the_graph_reproduces_it(name):
    build, fully_annotated = MODELS[name]
    torch.manual_seed(0)
    model, batch = build()
    module = WithLoss(model).train()
    args = {"batch": batch}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(module, args, strategy="real")
    assert len(graph.ops) > 20 and graph.output_tensors()[0].shape == ()
    assert {n for t in graph.parameters() for n in t.names} == {
        n for n, _ in module.named_parameters(remove_duplicate=False)
    }
    if fully_annotated:
        opaque = sorted({op.name for op in graph.opaque_ops()})
        assert opaque == [], f"{name}: functions with no annotation: {opaque}"
    try:
        verify_graph(graph, module, args)  # bitwise
    except AssertionError:
        verify_graph(graph, module, args, rtol=0.0, atol=1e-6)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "vit"])
def test_hf_model_traces_on_meta_too(name):
    """Mixtral is left out: torch's meta kernel of _grouped_mm accepts bf16 only."""
    torch.manual_seed(0)
    model, batch = MODELS[name][0]()
    module = WithLoss(model).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(module, {"batch": batch}, strategy="meta")
    verify_graph(graph, module, {"batch": batch}, rtol=0.0, atol=1e-6)
