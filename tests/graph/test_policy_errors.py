"""Every error a policy can run into names the op (name, annotation, model source line),
states the rule and the value seen, and says what to do instead."""

from __future__ import annotations

import warnings

import attrs
import pytest
import torch
from plan_helpers import case, data_parallel, fresh, replicate_rest

from nnscaler.graph import (
    IRGraph,
    PartitionError,
    PlanCheckError,
    PlanError,
    RunPlanError,
    StagingError,
    check_plan,
    run_plan,
)
from nnscaler.models import MLP, MLPConfig
from nnscaler.models.mlp import make_batch
from nnscaler.trace import OpaqueOpWarning, trace

LOSS_LINE = "mlp.py:45"  # F.cross_entropy(h, batch["y"])
LINEAR_LINE = "mlp.py:42"  # h = layer(h)


# -- partition ----------------------------------------------------------------------------


def test_partition_a_frozen_dim_lists_the_legal_splits():
    graph = fresh("mlp")
    linear = graph.nodes()[0]
    with pytest.raises(PartitionError) as e:
        graph.partition(linear, idx=0, dim=0, num=3)
    text = str(e.value)
    for needed in (
        "cannot partition op #0 torch.nn.functional.linear",
        "annotation 'b0 k^, n k^, n -> b0 n'",
        LINEAR_LINE, "`h = layer(h)`", "module layers.0",
        "idx=0, dim=0, num=3", "input shapes [4,8], [16,8], [16]",
        "legal choices (idx, dim, num):", "idx=0, dim=0 ('b0'): num in [2, 4]",
        "idx=1, dim=0 ('n'): num in [2, 4, 8, 16]", "Pick one of the legal choices",
    ):
        assert needed in text, needed
    # the reduction dim 'k' is legal through linear's bias rule
    assert "idx=0, dim=1 ('k'): num in [2, 4, 8]" in text
    loss = graph.nodes()[-1]
    with pytest.raises(PartitionError, match=r"'a' is marked '\^' \(never split\)"):
        graph.partition(loss, idx=0, dim=0, num=2)
    assert linear in graph.nodes()  # nothing changed


class _WeightedLoss(torch.nn.Module):
    """A class-weighted mean cross-entropy: every dim is '^' and no rule applies."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.ones(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(x, y, weight=self.w)


def test_partition_where_nothing_is_legal_says_replicate():
    args = {"x": torch.randn(4, 4), "y": torch.zeros(4, dtype=torch.long)}
    graph = IRGraph.from_graph(trace(_WeightedLoss(), args))
    with pytest.raises(PartitionError, match=r"(?s)cross_entropy.*test_policy_errors.py:\d+.*no "
                                             r"split is legal: replicate the op.*Replicate the op"):
        graph.partition(graph.nodes()[-1], idx=0, dim=0, num=2)


@pytest.mark.parametrize(("idx", "dim", "num", "reason"), [
    (3, 0, 2, "the op has 3 inputs"),
    (0, 5, 2, "input 0 has 2 dims"),
    (0, 0, 3, "'b0' has size 4; num must be a divisor of it, at least 2"),
    (0, 0, 1, "num must be a divisor of it, at least 2"),
    (2, 0, 32, "'n' has size 16"),
])
def test_partition_bad_index_dim_or_num(idx, dim, num, reason):
    graph = fresh("mlp")
    with pytest.raises(PartitionError, match="legal choices") as e:
        graph.partition(graph.nodes()[0], idx=idx, dim=dim, num=num)
    assert reason in str(e.value) and LINEAR_LINE in str(e.value)


def test_partition_argument_types_and_algorithm():
    graph = fresh("mlp")
    op = graph.nodes()[0]
    with pytest.raises(TypeError, match="num must be an int, got '2'"):
        graph.partition(op, idx=0, dim=0, num="2")
    with pytest.raises(PartitionError, match="the algorithm 'tp' is not known; the only one is 'dim'"):
        graph.partition(op, "tp", idx=0, dim=0, num=2)
    with pytest.raises(TypeError, match="takes an op of this graph"):
        graph.partition("linear", idx=0, dim=0, num=2)


def test_partition_an_opaque_op_says_replicate(fresh_plugins):
    fresh_plugins.get_plugin_manager().ops.unregister("torch.nn.functional.gelu")
    torch.manual_seed(0)
    config = MLPConfig(d_in=8, d_hidden=16, n_classes=4)
    module = MLP(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OpaqueOpWarning)
        graph = IRGraph.from_graph(trace(module, {"batch": make_batch(config, 4)}))
    gelu = graph.select(name="gelu")[0]
    assert gelu.is_opaque
    with pytest.raises(PartitionError, match=r"opaque: no annotation.*mlp.py:44.*has no dim "
                                             r"annotation.*graph.replicate\(op, times=...\).*register_op"):
        graph.partition(gelu, idx=0, dim=0, num=2)
    assert len(graph.replicate(gelu, 2)) == 2  # what an opaque op allows


def test_an_op_that_was_replaced_names_its_instances():
    graph = fresh("mlp")
    op = graph.nodes()[0]
    parts = graph.partition(op, idx=0, dim=0, num=2)
    ids = ", ".join(f"#{p.oid}" for p in parts)
    for call in (lambda: graph.partition(op, idx=0, dim=0, num=2),
                 lambda: graph.assign(op, 0), lambda: graph.replicate(op, 2)):
        with pytest.raises(PlanError, match=rf"op #0 .*{LINEAR_LINE}.* is no longer in the graph: it "
                                            rf"was replaced by 2 instances \(ops {ids}\)"):
            call()
    other = fresh("mlp")
    with pytest.raises(PlanError, match="is not an op of this graph"):
        other.assign(parts[0], 0)


def test_replicate_and_assign_check_their_numbers():
    graph = fresh("mlp")
    op = graph.nodes()[-1]
    with pytest.raises(PlanError, match=rf"replicate op #5 .*{LOSS_LINE}.*a positive int; got 0"):
        graph.replicate(op, 0)
    with pytest.raises(PlanError, match=rf"assign op #5 .*{LOSS_LINE}.*an int >= 0; got -1"):
        graph.assign(op, -1)
    with pytest.raises(PlanError, match="got True"):
        graph.assign(op, True)


# -- check --------------------------------------------------------------------------------


def test_check_names_unassigned_ops():
    graph = fresh("mlp")
    for op in graph.nodes()[:-1]:
        graph.assign(op, 0)
    with pytest.raises(PlanCheckError) as e:
        graph.check(2)
    text = str(e.value)
    assert "every op instance must be assigned to a device, but 1 of 6 are not" in text
    assert "op #5 torch.nn.functional.cross_entropy" in text and LOSS_LINE in text
    assert "graph.assign(op, device)" in text


def test_check_lists_at_most_a_few_unassigned_ops():
    graph = fresh("gpt")
    with pytest.raises(PlanCheckError, match=r"(?s)but 56 of 56 are not.*and 48 more"):
        check_plan(graph, 2)


def test_check_names_devices_out_of_range():
    graph = data_parallel(fresh("mlp"), 4)
    with pytest.raises(PlanCheckError) as e:
        graph.check(2)
    text = str(e.value)
    assert "devices are numbered 0 to 1 in a scale unit of 2" in text
    assert "assigned to device(s) [2, 3]" in text and LINEAR_LINE in text
    with pytest.raises(PlanCheckError, match="a positive int; got 0"):
        graph.check(0)


def test_check_finds_a_missing_piece():
    """A part removed from the graph (a policy editing ``ops`` by hand) leaves its
    consumer's piece unformed: check names the consumer and the missing box."""
    graph = data_parallel(fresh("mlp"), 2)
    gone = graph.select(name="gelu")[1]  # writes t[2:4, :]
    graph.ops.remove(gone)
    graph.reindex()
    with pytest.raises(PlanCheckError) as e:
        graph.check(2)
    text = str(e.value)
    assert "op #" in text and "torch.nn.functional.linear" in text and LINEAR_LINE in text
    assert "[2:4, 0:16]: no piece holds these elements" in text
    with pytest.raises(RunPlanError, match=r"\[2:4, 0:16\]: no piece holds"):
        run_plan(graph, case("mlp").module, case("mlp").args)


def test_check_finds_missing_value_parts():
    graph = fresh("gpt")
    head = graph.select(module="gpt.lm_head")[0]
    parts = graph.partition(head, idx=0, dim=2, num=2)
    graph.ops.remove(parts[1])
    graph.reindex()
    replicate_rest(graph, 1)
    with pytest.raises(PlanCheckError, match=r"the value parts there \(0/2\) do not sum to the "
                                             r"whole value"):
        graph.check(1)


def test_check_finds_pieces_that_disagree_with_the_annotation():
    graph = fresh("mlp")
    replicate_rest(graph, 1)
    op = graph.nodes()[0]
    half = attrs.evolve(op.inputs[0], indmap=((0, 2), (0, 8)))
    graph.ops[0] = attrs.evolve(op, inputs=(half, *op.inputs[1:]))  # edited by hand
    graph.reindex()
    with pytest.raises(PlanCheckError, match=rf"(?s)op #\d+ .*{LINEAR_LINE}.*bound to the input "
                                             r"shapes \[\(4, 8\).*reads pieces of shapes \[\(2, 8\)"):
        graph.check(1)


# -- staging, recompute, multiref --------------------------------------------------------


def test_staging_errors():
    graph = fresh("mlp")
    ops = graph.nodes()
    with pytest.raises(StagingError, match=rf"stage 0 must start at the first op of the graph, "
                                           rf"op #0 .*{LINEAR_LINE}.*it starts at op #2"):
        graph.staging([ops[2], ops[4]])
    with pytest.raises(StagingError, match=r"stages must start in program order, but stage 2 "
                                           r"starts at op #1 .* \(position 1\), before stage 1's"):
        graph.staging([ops[0], ops[3], ops[1]])
    with pytest.raises(StagingError, match="is given twice \\(entries 1 and 2\\)"):
        graph.staging([ops[0], ops[3], ops[3]])
    with pytest.raises(StagingError, match="non-empty list of ops"):
        graph.staging([])
    with pytest.raises(StagingError, match="non-empty list of ops"):
        graph.staging(ops[0])
    assert all(op.stage is None for op in graph.nodes())  # a failed call changes nothing


def test_recompute_errors():
    graph = fresh("gpt")
    graph.recompute("gpt.blocks.0")
    with pytest.raises(PlanError, match=r"(?s)already in recompute group 0.*one group"):
        graph.recompute(graph.select(module="gpt.blocks.0.mlp"))
    with pytest.raises(PlanError, match=r"no op runs in module 'gpt.blocks.7'; did you mean.*'gpt.blocks.1'"):
        graph.recompute("gpt.blocks.7")
    with pytest.raises(PlanError, match="no ops given"):
        graph.recompute([])
    graph.staging([graph.nodes()[0], graph.select(module="gpt.blocks.1")[0]])
    with pytest.raises(PlanError, match=r"span the pipeline stages \[0, 1\]"):
        graph.recompute([graph.select(module="gpt.ln_f")[0], graph.select(module="gpt.drop")[0]])


def test_multiref_errors():
    graph = fresh("mlp")
    first = graph.nodes()[0].outputs[0]
    with pytest.raises(PlanError, match=r"multiref t\d+:f32\[4, 16\]: the tensor is read by 1 op"):
        graph.multiref(first)
    with pytest.raises(TypeError, match="multiref takes a tensor of the graph"):
        graph.multiref(torch.zeros(2))
