"""What the plugin's tests share: the three models (the project's GPT, tiny random
Hugging Face Llama and GPT-2, 4 layers each so that 4 pipeline stages fit), their batches,
a gloo process launcher, and one parity worker that runs several plans per process group
(process start-up dominates on a small machine)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 64
SEQ = 8
SGD = {"lr": 0.05, "momentum": 0.9}


class WithLoss(nn.Module):
    """A Hugging Face causal LM whose forward takes the batch and returns the loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        from nnscaler.models.gpt import GPTConfig, GPTWithLoss

        return GPTWithLoss(GPTConfig(vocab_size=VOCAB, n_layer=4, n_head=4, d_model=16,
                                     seq_len=SEQ))
    import transformers

    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
        return WithLoss(transformers.LlamaForCausalLM(config))
    if kind in ("mistral", "qwen2"):  # Llama's structure under other names and classes
        cfg_cls, model_cls = {
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
        config = cfg_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=64)
        return WithLoss(model_cls(config))
    if kind == "mixtral":  # 4 experts, top-2, with the load-balancing loss
        config = transformers.MixtralConfig(
            hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
            num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
        return WithLoss(transformers.MixtralForCausalLM(config))
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_embd=32, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return WithLoss(transformers.GPT2LMHeadModel(config))
    raise ValueError(kind)


def make_batch(kind: str, seed: int, batch_size: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    if kind == "gpt":
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    ids = tokens[:, :-1].contiguous()
    return {"input_ids": ids, "labels": ids.clone()}


def samples(kind: str, steps: int, units: int, micro: int) -> list[list[list[dict]]]:
    """``[step][unit][micro-batch]``, all different."""
    return [[[make_batch(kind, 1000 * s + 10 * u + m) for m in range(micro)]
             for u in range(units)] for s in range(steps)]


def reference(kind: str, data: list[list[list[dict]]]) -> tuple[list, dict[str, torch.Tensor]]:
    """One process sees every unit's micro-batches: gradients summed, one SGD step per
    step. Returns ``losses[step][unit][micro]`` and the parameters after the steps."""
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    losses = []
    for step in data:
        opt.zero_grad()
        per_unit = []
        for unit in step:
            row = []
            for batch in unit:
                loss = model(batch)
                loss.backward()
                row.append(loss.item())
            per_unit.append(row)
        opt.step()
        losses.append(per_unit)
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, params


def parity_worker(rank: int, world: int, cases: list[tuple[str, dict[str, Any]]],
                  savedir: str, steps: int = 2, micro: int = 2) -> list[str]:
    """Train every ``(kind, megatron sizes)`` case of ``cases`` with the ``megatron``
    policy on this process group and compare losses and weights with one process
    (rtol 1e-5). Returns the case ids checked."""
    from nnscaler_policy_megatron import megatron_compute_config

    from nnscaler import build_optimizer, parallelize

    warnings.simplefilter("ignore")
    done = []
    refs: dict[tuple[str, int], Any] = {}
    for i, (kind, sizes) in enumerate(cases):
        sizes = dict(sizes)
        plan = sizes.get("tensor_model_parallel_size", 1) * sizes.get(
            "pipeline_model_parallel_size", 1) * sizes.get("context_parallel_size", 1)
        units = world // plan
        sizes["data_parallel"] = units
        if (kind, units) not in refs:
            data = samples(kind, steps, units, micro)
            refs[(kind, units)] = (data, *reference(kind, data))
        data, ref_losses, ref_params = refs[(kind, units)]
        cfg = megatron_compute_config(
            **sizes, use_end2end=True,
            pas_config={"pipeline_nmicros": micro, **(
                {"pipeline_scheduler": "1f1b_interleaved"}
                if sizes.get("virtual_pipeline_model_parallel_size", 1) > 1 else {})})
        case_id = f"{kind}-" + "-".join(f"{k}={v}" for k, v in sorted(sizes.items()))
        pm = parallelize(make_model(kind), {"batch": data[0][0][0]}, "megatron", cfg,
                         gen_savedir=savedir, instance_name=f"case{i}")
        opt = build_optimizer(pm, torch.optim.SGD, **SGD)
        unit = rank // plan
        losses = []
        for step in data:
            losses.append([float(x) for x in pm.train_step(step[unit])])
            opt.step()
        want = [step[unit] for step in ref_losses]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5,
                                   atol=1e-6, msg=lambda m, c=case_id: f"{c} losses: {m}")
        checked = 0
        for attr, meta in pm.fullmap.items():
            if meta.kind != "parameter" or meta.value != (0, 1):
                continue
            full = ref_params[meta.orig_name]
            torch.testing.assert_close(getattr(pm, attr).detach(), meta.take(full),
                                       rtol=1e-5, atol=1e-6,
                                       msg=lambda m, c=case_id, n=meta.orig_name: f"{c} {n}: {m}")
            checked += 1
        if checked == 0:
            raise AssertionError(f"{case_id}: rank {rank} holds no parameter")
        done.append(case_id)
    return done
