"""Plans code generation cannot emit fail with errors that state the rule, the value seen
and the fix."""

from __future__ import annotations

import pytest
import torch
from plan_helpers import data_parallel, fresh, megatron_mlp, replicate_rest
from torch import nn

from nnscaler.codegen import CodegenError, build_program, generate_rank
from nnscaler.codegen.literals import literal
from nnscaler.graph import IRGraph, PlanCheckError
from nnscaler.trace import trace


def test_unassigned_op():
    graph = fresh("mlp")
    ops = graph.nodes()
    for op in ops[:-1]:
        graph.assign(op, 0)
    with pytest.raises(PlanCheckError, match=r"(?s)must be assigned.*cross_entropy.*graph.assign"):
        build_program(graph, plan_ngpus=1, runtime_ngpus=1)


def test_two_instances_of_one_op_on_one_device():
    graph = fresh("mlp")
    gelu = graph.select(name="gelu")[0]
    for copy in graph.replicate(gelu, 2):
        graph.assign(copy, 0)
    replicate_rest(graph, 1)
    with pytest.raises(CodegenError, match=r"two instances of op #\d+ torch.nn.functional.gelu.*"
                                           r"device 0.*assign the instances to different"):
        build_program(graph, plan_ngpus=1, runtime_ngpus=1)


def test_nested_split_is_not_a_grid():
    """Half of the batch split again: pieces [0:1], [1:2], [2:4] are not equal chunks."""
    graph = fresh("mlp")
    first = graph.select(name="linear")[0]
    half, other = graph.partition(first, idx=0, dim=0, num=2)
    a, b = graph.partition(half, idx=0, dim=0, num=2)
    for device, op in enumerate((a, b, other)):
        graph.assign(op, device)
    replicate_rest(graph, 3)
    with pytest.raises(CodegenError, match=r"(?s)no RVD layout.*ranges \[0:1, 1:2, 2:4\].*"
                                           r"not equal chunks.*Fix the plan"):
        build_program(graph, plan_ngpus=3, runtime_ngpus=3)


def test_whole_and_halves_are_not_a_grid():
    """Device 0 holds the whole output of a linear, devices 1 and 2 a half each: no
    replica count and chunk count describe that."""
    graph = fresh("mlp")
    first = graph.select(name="linear")[0]
    whole, split = graph.replicate(first, 2)
    graph.assign(whole, 0)
    for device, part in zip((1, 2), graph.partition(split, idx=0, dim=0, num=2), strict=True):
        graph.assign(part, device)
    replicate_rest(graph, 3)
    with pytest.raises(CodegenError, match=r"(?s)reads input 0.*device 0: \[0:4, 0:8\].*not equal chunks"):
        build_program(graph, plan_ngpus=3, runtime_ngpus=3)


@pytest.mark.parametrize("rank", [2, -1, True, "0"])
def test_rank_outside_the_job(rank):
    program = build_program(data_parallel(fresh("mlp"), 2), plan_ngpus=2, runtime_ngpus=2)
    with pytest.raises(CodegenError, match=r"rank must be an int in \[0, 2\).*got"):
        generate_rank(program, rank)


def test_runtime_ngpus_must_repeat_the_unit():
    with pytest.raises(CodegenError, match=r"runtime_ngpus must be a multiple of plan_ngpus.*"
                                           r"runtime_ngpus=3, plan_ngpus=2.*2 or 4"):
        build_program(data_parallel(fresh("mlp"), 2), plan_ngpus=2, runtime_ngpus=3)


def test_forward_argument_with_a_reserved_name():
    class M(nn.Module):
        def forward(self, boundary):
            return boundary * 2

    graph = IRGraph.from_graph(trace(M(), {"boundary": torch.ones(2)}))
    for op in graph.nodes():
        graph.assign(op, 0)
    with pytest.raises(CodegenError, match=r"'boundary'.*reserves.*Rename"):
        build_program(graph, plan_ngpus=1, runtime_ngpus=1)


def test_constants_generated_code_cannot_write():
    with pytest.raises(CodegenError, match=r"cannot write object"):
        literal(object(), where="op #3")
    assert literal({"a": (1, [2.5, None]), "b": slice(1, None, 2)}) == \
        "{'a': (1, [2.5, None]), 'b': slice(1, None, 2)}"
    assert literal((float("inf"), float("nan"), -float("inf"))) == \
        "(float('inf'), float('nan'), float('-inf'))"
    assert literal((torch.bfloat16, torch.Size([2, 3]), ...)) == \
        "(torch.bfloat16, torch.Size([2, 3]), ...)"
    assert literal(torch.device("cpu")) == "self.device"


def test_zero_groups_must_divide_the_holders():
    graph = megatron_mlp(fresh("gpt"), 2)
    # the compute config refuses it first: the holders of a piece are a multiple of the units
    with pytest.raises(CodegenError, match=r"zero_ngroups must divide the number of scale "
                                           r"units.*got 4; pick one of \[1, 2\]"):
        build_program(graph, plan_ngpus=2, runtime_ngpus=4,
                      compute_config={"use_zero": True, "zero_ngroups": 4})
