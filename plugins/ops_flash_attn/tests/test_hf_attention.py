"""The Hugging Face attention ``"nnscaler_fa"``: the same logits, loss and gradients as
``attn_implementation="sdpa"`` (Gemma 2's softcap: as ``"eager"``, which sdpa cannot do)
on plain, padded and packed batches; traced by nnscaler with no data-dependent read, one
plugin operator per layer; and a clear refusal for what flash attention cannot express."""

from __future__ import annotations

import warnings

import nnscaler_ops_flash_attn as fa
import pytest
import torch
from _hf_cases import BATCHES, SEQ, WithLoss, build, packed_batch, packed_positions, padded_batch

from nnscaler import NNScalerError
from nnscaler.ir import verify_graph
from nnscaler.trace import trace

transformers = pytest.importorskip("transformers")

NAME = fa.register_hf_attention()
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _run(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _real(batch):
    mask = batch.get("attention_mask")
    rows, seq = batch["input_ids"].shape
    return mask.bool() if mask is not None else torch.ones(rows, seq, dtype=torch.bool)


def _assert_same(got, want, real):
    logits, loss, grads = got
    torch.testing.assert_close(logits[real], want[0][real], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, want[1], rtol=RTOL, atol=ATOL)
    assert grads.keys() == want[2].keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, want[2][name], rtol=RTOL, atol=ATOL, msg=name)


def test_registered_under_a_name_transformers_leaves_alone():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert NAME == fa.HF_ATTENTION == "nnscaler_fa" == fa.register_hf_attention()
    assert "flash" not in NAME  # transformers would look a "flash" name up as its own kernel
    assert AttentionInterface._global_mapping[NAME] is fa.hf.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[NAME] is fa.hf.attention_mask
    model = build("llama", NAME)
    assert model.config._attn_implementation == NAME


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("shape", sorted(BATCHES))
def test_equals_sdpa(kind: str, shape: str):
    batch = BATCHES[shape](seed=1)
    got = _run(build(kind, NAME), batch)
    want = _run(build(kind, "sdpa"), batch)
    _assert_same(got, want, _real(batch))


@pytest.mark.parametrize("shape", sorted(BATCHES))
def test_gemma2_softcap_equals_eager(shape: str):
    batch = BATCHES[shape](seed=2)
    _assert_same(_run(build("gemma2", NAME), batch), _run(build("gemma2", "eager"), batch),
                 _real(batch))


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_packed_sequences_do_not_see_each_other(kind: str):
    """Each packed sequence's logits are those of the sequence run alone, by position_ids
    (found by the mask builder) and by cu_seq_lens (padding-free collators)."""
    batch = packed_batch(seed=1)
    positions = packed_positions(seed=1)[0]
    starts = [i for i in range(SEQ) if positions[i] == 0] + [SEQ]
    cu = torch.tensor(starts, dtype=torch.int32)
    lengths = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    by_positions = build(kind, NAME)(**batch).logits
    with_cache = build(kind, NAME, use_cache=True)  # no packing found: cu_seq_lens decide
    by_cu = with_cache(**batch, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                       max_length_k=max(lengths)).logits
    alone = build(kind, NAME)
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        want = alone(input_ids=batch["input_ids"][:, a:b]).logits
        torch.testing.assert_close(by_positions[:, a:b], want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(by_cu[:, a:b], want, rtol=RTOL, atol=ATOL)


def _ops(graph):
    return [op.name for op in graph.ops if op.name.startswith("flash_attn.")]


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_traced_with_no_data_read_and_exact_on_other_batches(kind: str):
    model = WithLoss(build(kind, NAME))
    graph = trace(model, {"batch": padded_batch(seed=0)})
    assert graph.data_dependent == []
    assert _ops(graph) == ["flash_attn.flash_attn_segmented_func"] * 2
    for seed in (1, 2, 3):  # other padding than the dummy batch's
        verify_graph(graph, model, {"batch": padded_batch(seed)}, rtol=1e-6, atol=1e-7)
    packed = trace(model, {"batch": packed_batch(seed=0)})
    assert packed.data_dependent == [] and len(_ops(packed)) == 2
    for seed in (1, 2):
        verify_graph(packed, model, {"batch": packed_batch(seed)}, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("shape", sorted(BATCHES))
def test_traced_on_the_meta_device(shape: str, use_cache: bool):
    graph = trace(WithLoss(build("mistral", NAME, use_cache)), {"batch": BATCHES[shape](0)},
                  strategy="meta")
    assert graph.data_dependent == [] and len(_ops(graph)) == 2


def test_plain_batch_with_a_cache_is_one_flash_attn_func_per_layer():
    """With ``use_cache`` (transformers' default) the mask builder looks for no packing, as
    for sdpa: nothing to mask, each layer is one flash_attn_func."""
    model = WithLoss(build("llama", NAME, use_cache=True))
    graph = trace(model, {"batch": BATCHES["plain"](seed=0)})
    assert graph.data_dependent == []
    assert _ops(graph) == ["flash_attn.flash_attn_func"] * 2


# ---------------------------------------------------------------------------------------
# Refusals: each names the case and the fix
# ---------------------------------------------------------------------------------------


def test_4d_mask_is_refused():
    batch = padded_batch(seed=0)
    mask4d = torch.ones(2, 1, SEQ, SEQ, dtype=torch.bool).tril()
    with pytest.raises(fa.UnsupportedAttentionError, match="a 4D attention mask.*sdpa"):
        build("llama", NAME)(input_ids=batch["input_ids"], attention_mask=mask4d)


def test_padding_mask_with_a_cache_is_refused():
    model = build("llama", NAME, use_cache=True).eval()
    batch = padded_batch(seed=0)
    with torch.no_grad():
        first = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        mask = torch.cat([batch["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1)
        with pytest.raises(NNScalerError, match="decoding with a key/value cache.*sdpa"):
            model(input_ids=batch["input_ids"][:, :1], attention_mask=mask,
                  past_key_values=first.past_key_values)


def test_mask_overlays_are_refused():
    with pytest.raises(fa.UnsupportedAttentionError, match="adds its own rule to the mask"):
        fa.hf.attention_mask(2, SEQ, SEQ, mask_function=lambda *a: True, use_vmap=True)


def test_a_token_that_sees_a_later_one_is_refused_when_run():
    """A causal mask with a bidirectional block (tokens 2..4 see each other, as image or
    prefix blocks do) cannot be flash attention's sequences: the batch is refused."""

    def block(batch_idx, head_idx, q_idx, kv_idx):
        in_block = (q_idx >= 2) & (q_idx <= 4) & (kv_idx >= 2) & (kv_idx <= 4)
        return (kv_idx <= q_idx) | in_block

    segments = fa.hf.attention_mask(1, 6, 6, mask_function=block, allow_is_causal_skip=False)
    assert segments.tolist() == [[1, 1, -1, -1, 1, 1]]
    q = torch.randn(1, 6, 2, 4)
    with pytest.raises(ValueError, match="sees a later token under a causal mask.*sdpa"):
        fa.flash_attn_segmented_func(q, q, q, segments, causal=True)


def _attention_call(rows: int = 2, **kwargs):
    model = build("llama", NAME)
    q = torch.randn(rows, 4, SEQ, 8)
    k = torch.randn(rows, 2, SEQ, 8)
    return fa.hf.attention_forward(model.model.layers[0].self_attn, q, k, k, None, **kwargs)


def test_attention_sinks_are_refused():
    with pytest.raises(fa.UnsupportedAttentionError, match="attention sinks"):
        _attention_call(s_aux=torch.zeros(4))


def test_cu_seq_lens_need_one_row_and_both_halves():
    cu = torch.tensor([0, 4, SEQ], dtype=torch.int32)
    with pytest.raises(fa.UnsupportedAttentionError, match="a batch of one row whose queries"):
        _attention_call(cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(fa.UnsupportedAttentionError, match="without its partner"):
        _attention_call(cu_seq_lens_q=cu)


def _cu(seed: int) -> torch.Tensor:
    positions = packed_positions(seed)[0]
    return torch.tensor([i for i in range(SEQ) if positions[i] == 0] + [SEQ], dtype=torch.int32)


def _flattened(seed: int) -> dict[str, torch.Tensor]:
    """What a padding-free collator gives: cu_seq_lens and Python int max lengths."""
    batch, cu = packed_batch(seed), _cu(seed)
    longest = int((cu[1:] - cu[:-1]).max())
    return {**batch, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest,
            "max_length_k": longest}


def test_cu_seq_lens_trace_holds_for_other_lengths():
    """The dummy batch's max_length_q/k are not baked into the graph: batches with longer
    sequences replay exactly."""
    model = WithLoss(build("llama", NAME, use_cache=True))  # cu_seq_lens decide
    graph = trace(model, {"batch": _flattened(seed=1)})  # longest: 5
    assert graph.data_dependent == []
    assert _ops(graph) == ["flash_attn.flash_attn_segmented_func"] * 2
    for seed in (2, 3):  # longest 6, then 4
        verify_graph(graph, model, {"batch": _flattened(seed)}, rtol=1e-6, atol=1e-7)


def test_differing_cu_seq_lens_are_refused_when_run():
    cu_q, cu_k = torch.tensor([0, 4, SEQ]), torch.tensor([0, 5, SEQ])
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k put in different"):
        _attention_call(rows=1, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
