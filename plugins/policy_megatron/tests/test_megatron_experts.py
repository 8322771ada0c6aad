"""``expert_model_parallel_size``: the experts of every MoE layer split over the
tensor-parallel devices; without it, every expert split by its intermediate units over
them. Parity with one process (losses and weights, rtol 1e-5) on tiny Hugging Face Mixtral
with its load-balancing loss: tp = ep = 2 inside data parallel 2, and inside two pipeline
stages (4 processes), and tp 2 inside the experts (2 processes); sizes that cannot work
are refused with the fix."""

from __future__ import annotations

import pytest
from _helpers import make_model, parity_worker

from nnscaler.testing import run_distributed

pytest.importorskip("transformers")


@pytest.mark.slow
def test_expert_parallel_parity_inside_tp_and_dp(tmp_path):
    cases = [("mixtral", {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2})]
    done = run_distributed(parity_worker, 4, cases, str(tmp_path), timeout=600)
    assert all(len(d) == 1 for d in done)


def _ffn_worker(rank: int, world: int, savedir: str) -> int:
    """tp 2 inside the experts: the first step's gradients (the halves of down_proj and of
    gate_up_proj, each half its gate rows and its up rows), then the losses and weights
    after two steps, against one process."""
    import warnings

    import torch
    from _helpers import SGD, reference, samples
    from nnscaler_policy_megatron import megatron_compute_config

    from nnscaler import parallelize

    warnings.simplefilter("ignore")
    data = samples("mixtral", 2, 1, 2)
    model = make_model("mixtral")
    for batch in data[0][0]:
        model(batch).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    ref_losses, ref_params = reference("mixtral", data)
    cfg = megatron_compute_config(tensor_model_parallel_size=2, use_end2end=True)
    pm = parallelize(make_model("mixtral"), {"batch": data[0][0][0]}, "megatron", cfg,
                     gen_savedir=savedir)
    opt = torch.optim.SGD(pm.parameters_for_optimizer(), **SGD)
    losses, checked = [], 0
    for i, step in enumerate(data):
        losses.append([float(x) for x in pm.train_step(step[0])])
        pm.sync_grad()
        for attr, meta in pm.fullmap.items():
            if i == 0 and meta.kind == "parameter" and ".experts." in meta.orig_name:
                torch.testing.assert_close(getattr(pm, attr).grad,
                                           meta.take(want[meta.orig_name]), rtol=1e-5,
                                           atol=1e-6, msg=lambda m, n=meta.orig_name: f"{n}: {m}")
                checked += 1
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([s[0] for s in ref_losses]),
                               rtol=1e-5, atol=1e-6)
    for attr, meta in pm.fullmap.items():
        if meta.kind == "parameter":
            torch.testing.assert_close(getattr(pm, attr).detach(),
                                       meta.take(ref_params[meta.orig_name]), rtol=1e-5,
                                       atol=1e-6, msg=lambda m, n=meta.orig_name: f"{n}: {m}")
    return checked


@pytest.mark.slow
def test_tensor_parallel_inside_the_experts_parity(tmp_path):
    # two layers' gate_up_proj and down_proj on each rank
    assert run_distributed(_ffn_worker, 2, str(tmp_path), timeout=600) == [4, 4]


@pytest.mark.slow
def test_expert_parallel_inside_pipeline_stages_parity(tmp_path):
    cases = [("mixtral", {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2,
                          "expert_model_parallel_size": 2})]
    done = run_distributed(parity_worker, 4, cases, str(tmp_path), timeout=600)
    assert all(len(d) == 1 for d in done)


def test_the_plan_splits_the_experts_and_names_bad_sizes():
    from _helpers import make_batch
    from nnscaler_policy_megatron import megatron_compute_config
    from nnscaler_policy_megatron.config import MegatronConfigError
    from nnscaler_policy_megatron.policy import plan

    from nnscaler.trace import trace

    graph = trace(make_model("mixtral"), {"batch": make_batch("mixtral", 0)})
    cfg = megatron_compute_config(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    g, result = plan(graph, cfg)
    assert [op.module_path for op in result.expert_split] == [
        "model.model.layers.0.mlp.experts", "model.model.layers.1.mlp.experts"]
    g, result = plan(graph, megatron_compute_config(tensor_model_parallel_size=2))
    assert result.expert_split == [] and len(result.ffn_split) == 2
    parts = [op for op in g.nodes() if op.name.endswith("moe_experts")]
    assert [op.inputs[4].shape for op in parts] == [(4, 32, 16)] * 4  # down_proj's halves
    assert all(op.kwargs["ffn_part"] == (k % 2, 2) for k, op in enumerate(parts))
    with pytest.raises(MegatronConfigError, match="expert_model_parallel_size splits the "
                                                  "experts over the tensor-parallel devices"):
        plan(graph, megatron_compute_config(tensor_model_parallel_size=2,
                                            expert_model_parallel_size=4))
