"""The ``megatron`` policy on one process: the regions it finds by structure in the
project's GPT, Hugging Face Llama and GPT-2, every plan replayed with ``run_plan``
against the model, the sequence-parallel activation bytes, and the errors."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from _helpers import make_batch, make_model
from nnscaler_policy_megatron import MegatronConfigError, megatron_compute_config, plan

from nnscaler.graph import IRGraph, run_plan
from nnscaler.trace import trace

pytest.importorskip("transformers")

KINDS = ["gpt", "llama", "gpt2"]
_TRACED: dict[str, tuple] = {}


def traced(kind: str):
    if kind not in _TRACED:
        model = make_model(kind)
        batch = make_batch(kind, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _TRACED[kind] = (model, batch, trace(model, {"batch": batch}))
    return _TRACED[kind]


def config(tp: int = 1, pp: int = 1, cp: int = 1, **pas):
    pas = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
           "pipeline_nmicros": 2, **pas}
    if cp > 1:
        pas["context_parallel_size"] = cp
    if (pas.get("virtual_pipeline_model_parallel_size", 1) > 1
            or "num_layers_per_virtual_pipeline_stage" in pas):
        pas.setdefault("pipeline_scheduler", "1f1b_interleaved")
    return SimpleNamespace(plan_ngpus=tp * cp * pp, runtime_ngpus=tp * cp * pp,
                           use_end2end=True,
                           use_zero=False, pas_config=pas)


def planned(kind: str, cfg):
    model, batch, graph = traced(kind)
    return plan(IRGraph.from_graph(graph), cfg)


def test_entry_point_registers_megatron():
    eps = importlib.metadata.entry_points(group="nnscaler")
    assert "nnscaler_policy_megatron.plugin" in {ep.value for ep in eps}
    from nnscaler import get_plugin_manager

    assert get_plugin_manager().policies.get("megatron").__name__ == "megatron"


@pytest.mark.parametrize("kind", KINDS)
def test_regions_found_by_structure(kind):
    g, p = planned(kind, config(tp=2))
    seeds = {(r.kind, r.seed.module_path.rsplit(".", 1)[-1]) for r in p.regions}
    weights = {r.seed.module_path.rsplit(".", 1)[-1]: r for r in p.regions}
    split_weights = set()
    for r in p.regions:
        for op in r.choices:
            if op.name.endswith(("linear", "addmm")):
                split_weights.add(op.module_path.rsplit(".", 1)[-1])
    expected = {"gpt": {"q_proj", "k_proj", "v_proj", "o_proj", "fc", "proj", "lm_head"},
                "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj", "lm_head"},
                "gpt2": {"c_proj", "c_fc", "lm_head"}}[kind]
    assert expected <= split_weights, (seeds, split_weights)
    assert any(r.kind == "vocab" for r in p.regions)               # the token embedding
    assert any(op.name.endswith("cross_entropy") for op in weights["lm_head"].choices)
    per_layer = [r for r in p.regions if r.kind != "vocab" and "lm_head" not in r.seed.module_path]
    assert len(per_layer) == 2 * 4                                    # attention + MLP, 4 layers
    if kind == "gpt2":  # the fused qkv projection stays whole, and is reported
        assert [op.module_path.rsplit(".", 1)[-1] for op in p.unplaced
                if op.name.endswith("addmm")] == ["c_attn"] * 4
    else:
        assert [op for op in p.unplaced if not op.name.endswith("embedding")] == []


def _reproduces(kind, g):
    model, batch, _ = traced(kind)
    model.zero_grad(set_to_none=True)
    loss = model(batch)
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out = run_plan(g, model, {"batch": batch})
    torch.testing.assert_close(out, loss, rtol=1e-5, atol=1e-6)
    out.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{kind} {n}: {m}")
    model.zero_grad(set_to_none=True)


PLANS = {
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2": dict(pp=2),
    "pp2-vpp2": dict(pp=2, virtual_pipeline_model_parallel_size=2),
    "pp2-2layers-per-stage": dict(pp=2, num_layers_per_virtual_pipeline_stage=1),
    "tp2-pp2-sp": dict(tp=2, pp=2, sequence_parallel=True),
    "tp4": dict(tp=4),
}


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("kind", KINDS)
def test_plan_reproduces_model(kind, name):
    sizes = dict(PLANS[name])
    tp, pp = sizes.pop("tp", 1), sizes.pop("pp", 1)
    if kind == "llama" and tp == 4:  # 2 key/value heads: attention splits in 2 at most
        g, p = planned(kind, config(tp=tp, pp=pp, **sizes))
        assert any("self_attn" in op.module_path for op in p.unplaced)
    else:
        g, p = planned(kind, config(tp=tp, pp=pp, **sizes))
    g.check(tp * pp)
    if pp > 1:
        vpp = sizes.get("virtual_pipeline_model_parallel_size", 1)
        if "num_layers_per_virtual_pipeline_stage" in sizes:
            vpp = 4 // pp // sizes["num_layers_per_virtual_pipeline_stage"]
        assert g.num_stages == pp * vpp
        assert sorted(set(p.stages.values())) == list(range(pp * vpp))
    _reproduces(kind, g)


CP_PLANS = {
    "cp2": dict(cp=2),
    "cp4": dict(cp=4),
    "cp2-pp2": dict(cp=2, pp=2),
    "cp2-a2a": dict(cp=2, cp_comm_type="a2a"),
}


@pytest.mark.parametrize("name", list(CP_PLANS))
@pytest.mark.parametrize("kind", ["llama"])
def test_context_parallel_plan_reproduces_model(kind, name):
    from nnscaler.ops.builtin.context_parallel import CONTEXT_PARALLEL_ATTENTION

    sizes = dict(CP_PLANS[name])
    cp, pp = sizes.pop("cp"), sizes.pop("pp", 1)
    g, _ = planned(kind, config(pp=pp, cp=cp, **sizes))
    g.check(cp * pp)
    attention = [op for op in g.nodes() if op.opdef is not None
                 and op.opdef.name == CONTEXT_PARALLEL_ATTENTION]
    assert len(attention) == 4 * cp  # every layer's attention, one part per device
    want = "ulysses" if sizes.get("cp_comm_type") == "a2a" else "zigzag"
    assert {op.kwargs["strategy"] for op in attention} == {want}
    # each pipeline rank's attention parts run on its own cp devices
    for op in attention:
        assert op.device // cp == (op.stage or 0) % pp
    linears = [op for op in g.nodes() if op.name == "torch.nn.functional.linear"
               and op.input_tensors()[0].ndim == 3]
    assert linears and all(op.input_tensors()[0].shape[-2] == 8 // cp for op in linears)
    _reproduces(kind, g)


TPCP_PLANS = {
    "tp2-cp2": dict(tp=2, cp=2),
    "tp2-cp2-a2a": dict(tp=2, cp=2, cp_comm_type="a2a"),
    "tp2-cp2-sp": dict(tp=2, cp=2, sequence_parallel=True),
}


_SLOW = pytest.mark.skipif(os.environ.get("NNSCALER_SLOW_TESTS") != "1",
                           reason="slow: set NNSCALER_SLOW_TESTS=1")


@pytest.mark.parametrize(("kind", "name"), [
    ("gpt", "tp2-cp2"), ("gpt", "tp2-cp2-a2a"), ("gpt", "tp2-cp2-sp"),
    pytest.param("mixtral", "tp2-cp2", marks=[pytest.mark.slow, _SLOW]),
    pytest.param("llama", "tp2-cp2", marks=[pytest.mark.slow, _SLOW])])
def test_tensor_x_context_parallel_plan_reproduces_model(kind, name):
    """Attention split by heads over tp, each head part along the sequence over its own
    cp devices: the ring (or Ulysses) of head part t runs on devices t and t + tp."""
    from nnscaler.ops.builtin.context_parallel import CONTEXT_PARALLEL_ATTENTION

    sizes = dict(TPCP_PLANS[name])
    tp, cp = sizes.pop("tp"), sizes.pop("cp")
    g, p = planned(kind, config(tp=tp, cp=cp, **sizes))
    g.check(tp * cp)
    attention = [op for op in g.nodes() if op.opdef is not None
                 and op.opdef.name == CONTEXT_PARALLEL_ATTENTION]
    layers = 2 if kind == "mixtral" else 4
    assert len(attention) == layers * tp * cp  # every layer's attention, one per device
    want = "ulysses" if sizes.get("cp_comm_type") == "a2a" else "zigzag"
    assert {op.kwargs["strategy"] for op in attention} == {want}
    for op in attention:
        devices = [part.device for part in g.split_parts(op)]
        assert devices == [op.device % tp + c * tp for c in range(cp)]
        q = op.input_tensors()[0]
        assert q.shape[-3] == q.full.shape[-3] // tp and q.shape[-2] == q.full.shape[-2] // cp
    # the linears hold a tp slice of their weight and a cp chunk of the tokens
    linears = [op for op in g.nodes() if op.name == "torch.nn.functional.linear"
               and op.input_tensors()[0].ndim == 3]
    assert linears and all(op.input_tensors()[0].shape[-2] == 8 // cp for op in linears)
    assert all(op.input_tensors()[1].shape != op.input_tensors()[1].full.shape
               for op in linears)
    assert p.regions
    if sizes.get("sequence_parallel"):  # the norms between blocks: a quarter of the tokens
        norms = [op for op in g.nodes() if op.name == "torch.nn.functional.layer_norm"]
        assert norms and all(op.input_tensors()[0].shape[-2] == 8 // (tp * cp) for op in norms)
    if kind == "mixtral":  # each expert split by its intermediate units, then by tokens
        assert len(p.ffn_split) == 2
    if (kind, name) == ("gpt", "tp2-cp2"):
        _assert_generated_groups(g)
    _reproduces(kind, g)


def _assert_generated_groups(g) -> None:
    """Generated code: the rings of head parts 0 and 1 run over ranks (0, 2) and (1, 3),
    the vocabulary-parallel loss over (0, 1) and (2, 3) (its replicas, one per chunk)."""
    from nnscaler.codegen import build_program, generate_rank
    from nnscaler.codegen.wrap import unwrap

    program = build_program(g, plan_ngpus=4, runtime_ngpus=4)
    for rank in range(4):
        src = unwrap(generate_rank(program, rank))
        ring = [ln for ln in src.splitlines() if "context_parallel_attention(" in ln]
        loss = [ln for ln in src.splitlines() if "class_parallel_cross_entropy(" in ln]
        assert len(ring) == 4 and len(loss) == 1
        assert all(f"part_group({(rank % 2, rank % 2 + 2)!r})" in ln for ln in ring)
        assert f"part_group({(rank // 2 * 2, rank // 2 * 2 + 1)!r})" in loss[0]


@pytest.mark.parametrize(("kind", "sizes", "match"), [
    ("llama", dict(tp=2, cp=2, cp_comm_type="a2a"),
     r"(?s)cp_comm_type='a2a' \(Ulysses\).*op #\d+ torch.nn.functional."
     r"scaled_dot_product_attention in .*self_attn.*\[4, 2, 2\].*\[2, 1, 1\] per part.*"
     r"Use cp_comm_type='p2p'"),
    ("gpt", dict(tp=8, cp=2),
     r"(?s)tensor_model_parallel_size=8 with context_parallel_size=2 splits every "
     r"attention by heads.*scaled_dot_product_attention.*\[4\] query.*which 8 does not "
     r"divide.*Set tensor_model_parallel_size to a divisor"),
])
def test_tensor_x_context_parallel_errors_name_the_op_and_the_fix(kind, sizes, match):
    sizes = dict(sizes)
    tp, cp = sizes.pop("tp"), sizes.pop("cp")
    with pytest.raises(MegatronConfigError, match=match):
        planned(kind, config(tp=tp, cp=cp, **sizes))


@pytest.mark.parametrize("name", ["tp2", "tp2-sp"])
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_other_hf_families_plan_by_structure(kind, name):
    sizes = dict(PLANS[name])
    g, p = planned(kind, config(tp=sizes.pop("tp"), **sizes))
    assert [op for op in p.unplaced if not op.name.endswith("embedding")] == []
    assert sum(r.kind == "column" for r in p.regions) == 2 * 4 + 1  # attention, MLP; head
    _reproduces(kind, g)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_sequence_parallel_halves_activations_between_blocks(kind):
    g_tp, p_tp = planned(kind, config(tp=2))
    g_sp, p_sp = planned(kind, config(tp=2, sequence_parallel=True))
    outside = {op.oid for op in p_tp.replicated}
    tp_bytes = sum(x.full.dtype.itemsize * int(torch.Size(x.shape).numel())
                   for op in g_tp.nodes() if op.device == 0 and g_tp.origin(op).oid in outside
                   for x in op.output_tensors())
    sp_bytes = sum(x.full.dtype.itemsize * int(torch.Size(x.shape).numel())
                   for op in g_sp.nodes() if op.device == 0 and g_sp.origin(op).oid in outside
                   for x in op.output_tensors())
    # the norms, dropouts and adds of every block hold half their activations per rank;
    # what stays whole is position/rotary tables and the labels
    assert sp_bytes <= 0.6 * tp_bytes, (sp_bytes, tp_bytes)


def test_layers_are_logged_when_left_whole(caplog):
    with caplog.at_level(logging.INFO, logger="nnscaler_policy_megatron"):
        planned("gpt2", config(tp=2))
    assert "c_attn" in caplog.text and "stays replicated" in caplog.text


# -- the sizes, checked ------------------------------------------------------------------
@pytest.mark.parametrize("cfg, match", [
    (SimpleNamespace(plan_ngpus=4, runtime_ngpus=4, pas_config={
        "tensor_model_parallel_size": 2}), "plan_ngpus must be tensor_model_parallel_size"),
    (SimpleNamespace(plan_ngpus=2, runtime_ngpus=4, pas_config={
        "tensor_model_parallel_size": 2, "data_parallel": 4}), "data_parallel is the number"),
    (SimpleNamespace(plan_ngpus=2, runtime_ngpus=4, use_zero=False, pas_config={
        "use_distributed_optimizer": True}), "use_zero"),
    (SimpleNamespace(plan_ngpus=1, runtime_ngpus=1, pas_config={
        "sequence_parallel": True}), "needs tensor_model_parallel_size > 1"),
    (SimpleNamespace(plan_ngpus=2, runtime_ngpus=2, pas_config={
        "tensor_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
     "virtual pipeline stages need"),
    (SimpleNamespace(plan_ngpus=2, runtime_ngpus=2, pas_config={
        "tensor_model_parallel_size": "2"}), "positive int"),
    (SimpleNamespace(plan_ngpus=4, runtime_ngpus=4, pas_config={
        "tensor_model_parallel_size": 2, "context_parallel_size": 2,
        "expert_model_parallel_size": 2}),
     r"expert_model_parallel_size=2 with context_parallel_size=2 is not planned"),
    (SimpleNamespace(plan_ngpus=4, runtime_ngpus=4, pas_config={
        "context_parallel_size": 2, "pipeline_model_parallel_size": 1,
        "tensor_model_parallel_size": 1}), "plan_ngpus must be tensor_model_parallel_size "
                                           r"\* context_parallel_size"),
    (SimpleNamespace(plan_ngpus=2, runtime_ngpus=2, pas_config={
        "context_parallel_size": 2, "cp_comm_type": "ring"}), "cp_comm_type is one of"),
])
def test_bad_sizes_are_refused(cfg, match):
    with pytest.raises(MegatronConfigError, match=match):
        planned("gpt", cfg)


def test_pipeline_needs_divisible_layers_and_interleaved_schedule():
    with pytest.raises(MegatronConfigError, match="does not split evenly"):
        planned("gpt", config(pp=2, virtual_pipeline_model_parallel_size=3,
                              pipeline_scheduler="1f1b_interleaved"))
    with pytest.raises(MegatronConfigError, match="interleaved schedule"):
        planned("gpt", config(pp=2, virtual_pipeline_model_parallel_size=2,
                              pipeline_scheduler="1f1b"))
    cfg = config(pp=2)
    del cfg.pas_config["pipeline_nmicros"]
    with pytest.raises(MegatronConfigError, match="pipeline_nmicros"):
        planned("gpt", cfg)


def test_megatron_compute_config_maps_sizes():
    cfg = megatron_compute_config(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                  data_parallel=3, use_distributed_optimizer=True,
                                  pas_config={"pipeline_nmicros": 4}, use_end2end=True)
    assert (cfg.plan_ngpus, cfg.runtime_ngpus, cfg.use_zero) == (4, 12, True)
    assert cfg.pas_config["pipeline_nmicros"] == 4
    assert cfg.pas_config["data_parallel"] == 3
    assert "context_parallel_size" not in cfg.pas_config  # unchanged unless asked for
    cfg = megatron_compute_config(context_parallel_size=2, pipeline_model_parallel_size=2,
                                  data_parallel=2, pas_config={"pipeline_nmicros": 2})
    assert (cfg.plan_ngpus, cfg.runtime_ngpus) == (4, 8)
    assert cfg.pas_config["context_parallel_size"] == 2


def test_virtual_stages_default_to_the_interleaved_schedule():
    from nnscaler_policy_megatron import megatron_compute_config

    cfg = megatron_compute_config(pipeline_model_parallel_size=2,
                                  virtual_pipeline_model_parallel_size=2,
                                  pas_config={"pipeline_nmicros": 2})
    assert cfg.pipeline.scheduler == "1f1b_interleaved" and cfg.pipeline.nmicros == 2
    assert megatron_compute_config(pipeline_model_parallel_size=2).pipeline.scheduler == "1f1b"
