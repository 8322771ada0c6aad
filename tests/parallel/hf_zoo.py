"""The Hugging Face zoo: tiny random models of architectures nobody here wrote, built
from ``transformers`` configs (offline), with the batches their users feed them.

Each entry builds ``(module, batch_fn)``: ``module(batch)`` returns the loss, and
``batch_fn(seed, padded)`` gives a batch; text models take an ``attention_mask`` and, when
``padded``, pad the end of some samples (labels ``-100`` there), as a collator does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, BATCH, SEQ = 64, 2, 8
HIDDEN = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4)
DECODER = dict(**HIDDEN, num_key_value_heads=2, vocab_size=VOCAB,
               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ENCODER = dict(**HIDDEN, vocab_size=VOCAB, max_position_embeddings=64,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)


class WithLoss(nn.Module):
    """``forward(batch) -> loss`` for a Hugging Face model that computes its own loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss


def text_batch(seed: int, padded: bool, *, masked_lm: bool = False,
               seq: int = SEQ) -> dict[str, torch.Tensor]:
    """Token ids with an attention mask; ``padded`` pads the tail of every other sample
    by a seed-dependent length (the labels there are ignored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, seq), generator=g)
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    if padded:
        for row in range(0, BATCH, 2):
            pad = int(torch.randint(1, seq // 2, (1,), generator=g))
            mask[row, seq - pad:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    if masked_lm:  # only some positions are masked-LM targets
        labels[:, ::2] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch(seed: int, packed: bool, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """Sequences packed into each row, as a packing collator gives them: no attention
    mask, ``position_ids`` restarting at 0 where a sequence starts (seed-dependent cuts;
    one sequence per row unless ``packed``), and no label across a boundary."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, seq), generator=g)
    rows = []
    for _ in range(BATCH):
        cuts = sorted(torch.randperm(seq - 1, generator=g)[:2].add(1).tolist()) if packed else []
        starts = [0, *cuts]
        lengths = [b - a for a, b in zip(starts, [*cuts, seq], strict=True)]
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    position_ids = torch.stack(rows)
    labels = ids.masked_fill(position_ids == 0, -100)  # a sequence's first token: no target
    return {"input_ids": ids, "position_ids": position_ids, "labels": labels}


def seq2seq_batch(seed: int, padded: bool) -> dict[str, torch.Tensor]:
    batch = text_batch(seed, padded)
    g = torch.Generator().manual_seed(seed + 1)
    batch["labels"] = torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=g)
    return batch


def image_batch(seed: int, padded: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 4, (BATCH,), generator=g)}


@dataclass(frozen=True)
class Arch:
    """One architecture: how to build it for an attention implementation, and its batch."""

    name: str
    build: Callable[[str], nn.Module]  # attn_implementation -> model
    batch: Callable[[int, bool], dict[str, torch.Tensor]]
    text: bool = True  # takes an attention mask (a padded batch applies)
    layered: bool = True  # has repeated layers a pipeline can cut between


def _t():
    import transformers

    return transformers


def _causal(config_cls: str, model_cls: str, **extra) -> Callable[[str], nn.Module]:
    def build(attn: str) -> nn.Module:
        t = _t()
        config = getattr(t, config_cls)(**{**DECODER, **extra}, attn_implementation=attn)
        return getattr(t, model_cls)(config)
    return build


def _gpt2(attn: str) -> nn.Module:
    t = _t()
    config = t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn)
    return t.GPT2LMHeadModel(config)


def _neox(attn: str) -> nn.Module:
    t = _t()
    config = t.GPTNeoXConfig(**HIDDEN, vocab_size=VOCAB, max_position_embeddings=64,
                             rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0,
                             attn_implementation=attn)
    return t.GPTNeoXForCausalLM(config)


def _falcon(attn: str) -> nn.Module:
    t = _t()
    config = t.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            vocab_size=VOCAB, new_decoder_architecture=True, num_kv_heads=2,
                            hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0, attn_implementation=attn)
    return t.FalconForCausalLM(config)


def _encoder(config_cls: str, model_cls: str) -> Callable[[str], nn.Module]:
    def build(attn: str) -> nn.Module:
        t = _t()
        return getattr(t, model_cls)(getattr(t, config_cls)(**ENCODER,
                                                           attn_implementation=attn))
    return build


def _t5(attn: str) -> nn.Module:
    t = _t()
    config = t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                        num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                        decoder_start_token_id=0, pad_token_id=0, eos_token_id=2,
                        attn_implementation=attn)
    return t.T5ForConditionalGeneration(config)


def _vit(attn: str) -> nn.Module:
    t = _t()
    config = t.ViTConfig(**HIDDEN, image_size=16, patch_size=4, num_channels=3, num_labels=4,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         attn_implementation=attn)
    return t.ViTForImageClassification(config)


MOE = dict(num_experts_per_tok=2)
ARCHS: dict[str, Arch] = {a.name: a for a in [
    Arch("llama", _causal("LlamaConfig", "LlamaForCausalLM"), text_batch),
    Arch("mistral", _causal("MistralConfig", "MistralForCausalLM"), text_batch),
    Arch("qwen2", _causal("Qwen2Config", "Qwen2ForCausalLM"), text_batch),
    Arch("qwen3", _causal("Qwen3Config", "Qwen3ForCausalLM", head_dim=8), text_batch),
    Arch("gemma3", _causal("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8,
                           query_pre_attn_scalar=8, sliding_window=4), text_batch),
    Arch("phi3", _causal("Phi3Config", "Phi3ForCausalLM"), text_batch),
    Arch("gpt2", _gpt2, text_batch),
    Arch("gpt_neox", _neox, text_batch),
    Arch("falcon", _falcon, text_batch),
    Arch("bert", _encoder("BertConfig", "BertForMaskedLM"),
         lambda seed, padded: text_batch(seed, padded, masked_lm=True)),
    Arch("roberta", _encoder("RobertaConfig", "RobertaForMaskedLM"),
         lambda seed, padded: text_batch(seed, padded, masked_lm=True)),
    Arch("t5", _t5, seq2seq_batch),
    Arch("vit", _vit, image_batch, text=False),
    Arch("mixtral", _causal("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                            **MOE), text_batch),
    Arch("qwen2_moe", _causal("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4,
                              moe_intermediate_size=32, shared_expert_intermediate_size=32,
                              **MOE), text_batch),
]}


def build(name: str, attn: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return WithLoss(ARCHS[name].build(attn)).train()
