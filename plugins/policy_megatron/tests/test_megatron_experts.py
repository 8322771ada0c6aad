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


@pytest.mark.slow
def test_tensor_parallel_inside_the_experts_parity(tmp_path):
    cases = [("mixtral", {"tensor_model_parallel_size": 2})]
    done = run_distributed(parity_worker, 2, cases, str(tmp_path), timeout=600)
    assert all(len(d) == 1 for d in done)


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
