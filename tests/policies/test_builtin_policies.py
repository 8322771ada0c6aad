"""The built-in policies dp, data and tp on the project's models and on Hugging Face GPT-2
and Llama: each plan passes check and reproduces the module's loss and gradients under
run_plan; tp finds Megatron's MLP; data follows the batch; the errors say what to do."""

from __future__ import annotations

import pytest
import torch
from policy_cases import BATCH, MODELS, assert_reproduces, case, config, fresh

from nnscaler.codegen import build_program
from nnscaler.errors import UnknownNameError
from nnscaler.graph import IRGraph, run_plan
from nnscaler.ir import TensorKind
from nnscaler.plugins import get_plugin_manager
from nnscaler.policies import PolicyError, adapters, data, dp, tp

POLICIES = {"dp": dp, "data": data, "tp": tp}


def _placements(policy: str) -> list[int]:
    return [1] if policy == "dp" else [1, 2, 4]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    ("policy", "ndevices"),
    [(p, n) for p in POLICIES for n in _placements(p)],
    ids=lambda x: str(x),
)
def test_policy_reproduces_the_model(name, policy, ndevices):
    graph = POLICIES[policy](fresh(name), config(ndevices))
    assert all(op.device is not None for op in graph.nodes())
    assert sorted({op.device for op in graph.nodes()}) == list(range(ndevices))
    assert_reproduces(graph, name, ndevices)


@pytest.mark.parametrize("policy", ["dp", "data", "tp"])
def test_policies_are_registered_by_the_builtin_plugin(policy, fresh_plugins):
    pm = get_plugin_manager()
    assert pm.policies.get(policy) is POLICIES[policy]
    assert pm.policies.registrant(policy) == "nnscaler.policies"
    assert policy in pm.contributions("nnscaler.policies")["policies"]


def test_policy_through_the_registry_plans_the_graph(fresh_plugins):
    policy = get_plugin_manager().policies.get("data")
    graph = policy(fresh("mlp"), config(2))
    assert_reproduces(graph, "mlp", 2)


def test_unknown_policy_lists_the_registered_ones(fresh_plugins):
    with pytest.raises(UnknownNameError) as e:
        get_plugin_manager().policies.get("tpp")
    text = str(e.value)
    assert "no policy named 'tpp' is registered" in text
    assert "Did you mean 'tp'" in text
    assert "Registered policies:" in text
    for name in ("data", "dp", "tp"):
        assert name in text.split("Registered policies:")[1]


# -- dp -----------------------------------------------------------------------------------


def test_dp_puts_every_op_on_device_0_and_needs_no_adapter():
    graph = dp(fresh("gpt"), config(1))
    assert {op.device for op in graph.nodes()} == {0}
    assert len(graph.nodes()) == len(case("gpt").graph.ops)  # nothing split or copied
    assert adapters(graph, 1) == []


def test_dp_with_two_plan_devices_says_what_to_use_instead():
    with pytest.raises(PolicyError) as e:
        dp(fresh("mlp"), config(2))
    text = str(e.value)
    assert "policy 'dp' plans a scale unit of one device" in text
    assert "plan_ngpus is 2" in text
    assert "Set plan_ngpus=1 and runtime_ngpus to the number of replicas" in text
    assert "'data' policy" in text


@pytest.mark.parametrize("policy", ["dp", "data", "tp"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_plan_ngpus_must_be_a_positive_int(policy, bad):
    with pytest.raises(PolicyError, match=rf"policy '{policy}': ComputeConfig.plan_ngpus "
                                          rf"must be a positive int, got"):
        POLICIES[policy](fresh("mlp"), config(bad))


@pytest.mark.parametrize("policy", ["dp", "data", "tp"])
def test_zero_stage_auto_is_refused_by_policies_that_do_not_choose_it(policy):
    from nnscaler import ComputeConfig

    with pytest.raises(PolicyError, match=rf"policy '{policy}' needs the ZeRO stage: "
                                          rf"zero_stage='auto' is chosen by the autodist"):
        POLICIES[policy](fresh("mlp"), ComputeConfig(1, 2, zero_stage="auto"))


def test_a_compute_config_without_plan_ngpus_is_named():
    with pytest.raises(PolicyError, match=r"policy 'tp': a compute config must be an "
                                          r"nnscaler.ComputeConfig \(or an object with its "
                                          r"fields: plan_ngpus"):
        tp(fresh("mlp"), object())


def test_a_traced_graph_is_accepted_and_left_unchanged():
    traced = case("mlp").graph
    before = [op.plan.device for op in traced.ops]
    graph = data(traced, config(2))
    assert isinstance(graph, IRGraph) and graph is not traced
    assert [op.plan.device for op in traced.ops] == before


# -- data ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "gpt", "hf_llama"])
def test_data_splits_every_linear_on_the_batch(name):
    graph = data(fresh(name), config(2))
    linears = graph.select(name="linear") + graph.select(name="addmm")
    assert linears
    for op in linears:
        x = op.inputs[0] if op.name.endswith("linear") else op.inputs[1]
        assert x.shape[0] == x.full.shape[0] // 2, op
    # the loss (a mean cross-entropy) splits on its tokens too: each part sums its own
    # samples' losses and counts them, and the parts all-reduce the two numbers
    loss = graph.select(name="cross_entropy")
    assert [op.inputs[0].indmap[0] for op in loss] == [
        (0, loss[0].inputs[0].full.shape[0] // 2),
        (loss[0].inputs[0].full.shape[0] // 2, loss[0].inputs[0].full.shape[0])]
    assert all(op.opdef.name.endswith("token_parallel_cross_entropy") for op in loss)
    assert_reproduces(graph, name, 2)


def test_data_replicates_ops_without_the_batch():
    graph = data(fresh("gpt"), config(2))
    pos = graph.select(module="gpt.wpe")  # the position embedding: no batch dim
    assert len(pos) == 2 and all(op.outputs[0].is_whole for op in pos)
    tok = graph.select(module="gpt.wte")
    assert [op.outputs[0].indmap[0] for op in tok] == [(0, 2), (2, 4)]


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("units", [1, 2])
def test_data_program_is_dp_program(name, units):
    """A batch split is data parallelism: every parameter is held whole on every device
    (its gradient summed once, by the reducer, over the unit's devices and the other
    units together), and the only adapters slice the forward arguments locally; no op
    gathers activations or reduces a weight gradient by itself."""
    program = build_program(data(fresh(name), config(2)), plan_ngpus=2,
                            runtime_ngpus=2 * units)
    assert program.adapters
    assert {s.name for a in program.adapters for s in a.plan.steps} == {"chunk"}
    assert all(a.full.kind is TensorKind.INPUT for a in program.adapters)
    params = [leaf for leaf in program.leaves.values() if leaf.kind is TensorKind.PARAMETER]
    assert params and all(leaf.layout.r == 2 for leaf in params)
    assert program.reducer_groups == [tuple(range(2 * units))]


def test_data_loss_is_the_mean_over_the_whole_batch_when_parts_ignore_unevenly():
    """The first half of the batch has most labels ignored (-100), the second none: a
    mean over each part's own tokens would weigh them wrongly; the split loss divides the
    parts' summed losses by the count over every part."""
    c = case("gpt")
    batch = {k: v.clone() for k, v in c.args["batch"].items()}
    batch["labels"][: BATCH // 2, 1:] = -100
    graph = data(fresh("gpt"), config(2))
    c.module.zero_grad(set_to_none=True)
    try:
        expected = c.module(batch)
        expected.backward()
        grads = {n: p.grad.clone() for n, p in c.module.named_parameters()}
        c.module.zero_grad(set_to_none=True)
        out = run_plan(graph, c.module, {"batch": batch})
        torch.testing.assert_close(out.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
        out.backward()
        for n, p in c.module.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6)
    finally:
        c.module.zero_grad(set_to_none=True)


def test_data_batch_dims_option_names_arguments():
    graph = data(fresh("mlp"), config(2, batch_dims={"batch": 0}))
    assert_reproduces(graph, "mlp", 2)
    # the labels without a batch dim: only x is split; the loss, split on its samples
    # as x reaches it, reads its slice of the labels (a local chunk, no communication)
    graph = data(fresh("mlp"), config(2, batch_dims={"batch['y']": None}))
    assert_reproduces(graph, "mlp", 2)
    loss = graph.select(name="cross_entropy")
    assert [op.inputs[1].indmap for op in loss] == [((0, 2),), ((2, 4),)]


def test_data_batch_dims_unknown_argument():
    with pytest.raises(PolicyError) as e:
        data(fresh("mlp"), config(2, batch_dims={"inputs": 0}))
    text = str(e.value)
    assert "['inputs']" in text and "\"batch['x']\"" in text and "Use one of those names" in text


def test_data_batch_dims_bad_dim():
    with pytest.raises(PolicyError, match=r"batch dim of batch\['x'\] .* must be an int in "
                                          r"\[-2, 2\) or None .*got 5"):
        data(fresh("mlp"), config(2, batch_dims={"batch['x']": 5}))


def test_data_batch_not_divisible():
    with pytest.raises(PolicyError) as e:
        data(fresh("mlp"), config(3))
    text = str(e.value)
    assert "batch dim 0 of batch['x'] (shape [4, 8]) has size 4" in text
    assert "3 devices cannot split evenly" in text and "batch_dims" in text


def test_data_without_any_batch_dim():
    with pytest.raises(PolicyError, match=r"no forward argument has a batch dim"):
        data(fresh("mlp"), config(2, batch_dims={"batch": None}))


# -- tp -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt", "gpt_nobias", "gpt_manual"])
@pytest.mark.parametrize("ndevices", [2, 4])
def test_tp_finds_megatron_mlp(name, ndevices):
    """fc split on its output features (columns), gelu on the same dim, proj on its
    reduction dim (rows) with value-partial outputs; the bias of proj on part 0 only."""
    graph = tp(fresh(name), config(ndevices))
    hidden = 4 * 16
    for block in (0, 1):
        fc = graph.select(module=f"gpt.blocks.{block}.mlp.fc")
        act = graph.select(name="gelu", module=f"gpt.blocks.{block}.mlp")
        proj = graph.select(module=f"gpt.blocks.{block}.mlp.proj")
        assert len(fc) == len(act) == len(proj) == ndevices
        step = hidden // ndevices
        for p, (f, a, r) in enumerate(zip(fc, act, proj)):
            x, w, b = f.inputs
            assert x.is_whole  # column: the input replicated
            assert w.indmap == ((p * step, (p + 1) * step), (0, 16))
            assert b.indmap == ((p * step, (p + 1) * step),)
            assert f.outputs[0].indmap[2] == (p * step, (p + 1) * step)
            assert a.inputs[0].indmap[2] == (p * step, (p + 1) * step)
            x, w, b = r.inputs  # row: the reduction dim split, the output value-partial
            assert x.indmap[2] == (p * step, (p + 1) * step)
            assert w.indmap == ((0, 16), (p * step, (p + 1) * step))
            assert r.outputs[0].valmap == (p, ndevices) and r.outputs[0].shape == (4, 6, 16)
            if name == "gpt_nobias":
                assert b is None
            else:
                assert b.valmap == (p, ndevices)  # the bias is added by part 0 only
    assert_reproduces(graph, name, ndevices)


@pytest.mark.parametrize("name", ["gpt", "gpt_manual"])
def test_tp_splits_attention_by_heads(name):
    graph = tp(fresh(name), config(4))
    for proj in ("q_proj", "k_proj", "v_proj"):
        parts = graph.select(module=f"gpt.blocks.0.attn.{proj}")
        assert [op.inputs[1].indmap[0] for op in parts] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    views = graph.select(name="view", module="gpt.blocks.0.attn")[:4]  # q's [B,T,H,D] view
    assert [op.outputs[0].indmap[2] for op in views] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_tp_shards_every_weight_matrix_of_gpt():
    """Every parameter with two or more dims is held in pieces, none replicated."""
    graph = tp(fresh("gpt"), config(2))
    first: dict = {}
    for op in graph.nodes():
        for x in op.input_tensors():
            if x.full.is_param and x.full.ndim >= 2:
                first.setdefault(graph.origin(op), {}).setdefault(x.full, []).append(x)
    seen = set()
    for pieces in first.values():
        for full, held in pieces.items():
            if full in seen:
                continue  # a tied weight: its first reader fixes where it lives
            seen.add(full)
            assert all(not p.is_whole for p in held), full


def test_tp_llama_mlp_and_attention_are_megatron():
    graph = tp(fresh("hf_llama"), config(2))
    for proj in ("mlp.gate_proj", "mlp.up_proj", "self_attn.q_proj"):
        parts = graph.select(module=f"model.model.layers.0.{proj}")
        assert [op.inputs[1].indmap[0][0] for op in parts] == [0, parts[0].inputs[1].shape[0]]
    for proj in ("mlp.down_proj", "self_attn.o_proj"):
        parts = graph.select(module=f"model.model.layers.0.{proj}")
        assert [op.outputs[0].valmap for op in parts] == [(0, 2), (1, 2)]


def test_tp_lookahead_option():
    for depth in (0, 1):
        graph = tp(fresh("gpt"), config(2, tp_lookahead=depth))
        assert_reproduces(graph, "gpt", 2)
    with pytest.raises(PolicyError, match=r"tp_lookahead.*int >= 0.*got -1"):
        tp(fresh("gpt"), config(2, tp_lookahead=-1))


def test_tp_moves_less_than_no_lookahead():
    near = adapters(tp(fresh("gpt"), config(2, tp_lookahead=0)), 2)
    far = adapters(tp(fresh("gpt"), config(2)), 2)
    assert sum(a.cost for a in far) < sum(a.cost for a in near)


def _lm_head(graph: IRGraph) -> list:
    return [op for op in graph.ops if op.name.endswith("linear")
            and "lm_head" in (op.module_path or "")]


def test_tp_compute_term_splits_the_lm_head_and_its_loss():
    """The GPT's LM head splits by vocabulary, the tied table by rows (row-parallel
    embedding) and the loss by classes; with or without computation costed, the plans
    compute what the model does."""
    split = tp(fresh("gpt"), config(2, tp_bytes_per_mac=0.04))
    assert_reproduces(split, "gpt", 2)
    heads = _lm_head(split)
    assert len(heads) == 2 and all(op.outputs[0].indmap != heads[0].outputs[0].full.whole().indmap
                                   for op in heads)
    parts = {op.opdef.name.rsplit(".", 1)[-1] for op in split.ops if op.opdef is not None}
    assert {"class_parallel_cross_entropy", "row_parallel_embedding"} <= parts
    assert_reproduces(tp(fresh("gpt"), config(2, tp_bytes_per_mac=0)), "gpt", 2)


@pytest.mark.parametrize("value", [-1, "0.1", True, float("nan")])
def test_tp_bytes_per_mac_is_checked(value):
    with pytest.raises(PolicyError, match=r"tp_bytes_per_mac.*number >= 0.*got"):
        tp(fresh("gpt"), config(2, tp_bytes_per_mac=value))
