"""``pas_config['devices_per_node']``: where a node ends, collectives slow down to the
network's bandwidth, and the estimate (and so the choice) knows it; a node size that does
not fit the job is refused."""

from __future__ import annotations

import pytest
import torch
from nnscaler_policy_autodist import AutoDistError, plan_graph

from nnscaler.config import ComputeConfig
from nnscaler.graph import IRGraph
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.trace import trace

# large enough that communication shows in the estimate for H100s
CFG = GPTConfig(vocab_size=1024, n_layer=2, n_head=8, d_model=256, seq_len=64)


@pytest.fixture(scope="module")
def traced():
    with torch.device("meta"):
        model = GPTWithLoss(CFG)
    return trace(model, {"batch": make_batch(CFG, 8)}, strategy="meta")


def _plan(traced, tmp_path, **pas):
    cfg = ComputeConfig(8, 16, use_end2end=True, pas_config={
        "device_type": "H100", "profile_dir": str(tmp_path), **pas})
    return plan_graph(IRGraph.from_graph(traced), cfg)[1]


def test_a_unit_across_nodes_is_estimated_slower(traced, tmp_path):
    """The same 8-device unit inside one node and spread over four nodes of two: every
    collective inside the unit (and the gradient sum across units) crosses the network,
    so no plan is estimated faster, and tensor splits lose their edge."""
    inside = _plan(traced, tmp_path)
    across = _plan(traced, tmp_path, devices_per_node=2)
    assert across.pipeline.step_time > inside.pipeline.step_time


def test_a_node_that_does_not_divide_the_job_is_named(traced, tmp_path):
    with pytest.raises(AutoDistError, match=r"pas_config\['devices_per_node'\] is 6, which "
                                            r"does not divide runtime_ngpus=16.*one of "
                                            r"\[1, 2, 4, 8, 16\]"):
        _plan(traced, tmp_path, devices_per_node=6)


@pytest.mark.parametrize("value", [0, -2, 2.5, True, "8"])
def test_devices_per_node_is_a_positive_int(traced, tmp_path, value):
    with pytest.raises(AutoDistError, match=r"devices_per_node"):
        _plan(traced, tmp_path, devices_per_node=value)


def test_a_job_inside_part_of_a_node(traced, tmp_path):
    """Four devices of an eight-device node: nothing crosses the network."""
    cfg = ComputeConfig(4, 4, use_end2end=True, pas_config={
        "device_type": "H100", "profile_dir": str(tmp_path)})
    plain = plan_graph(IRGraph.from_graph(traced), cfg)[1]
    cfg = ComputeConfig(4, 4, use_end2end=True, pas_config={
        "device_type": "H100", "profile_dir": str(tmp_path), "devices_per_node": 8})
    inside = plan_graph(IRGraph.from_graph(traced), cfg)[1]
    assert inside.pipeline.step_time == pytest.approx(plain.pipeline.step_time)
