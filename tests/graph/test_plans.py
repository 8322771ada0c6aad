"""Whole plans on the project's models: data parallel, Megatron tensor parallel, both
nested, pipeline stages. Each passes check_plan and reproduces the module's loss and
parameter gradients under run_plan."""

from __future__ import annotations

import pytest
from plan_helpers import assert_reproduces, data_parallel, fresh, megatron_mlp, replicate_rest

from nnscaler.anno import Replicate, Split, ValuePartial
from nnscaler.graph import PartitionError


@pytest.mark.parametrize("name", ["mlp", "gpt", "gpt_manual"])
@pytest.mark.parametrize("ndevices", [2, 4])
def test_data_parallel(name, ndevices):
    graph = data_parallel(fresh(name), ndevices)
    linears = graph.select(name="linear")
    assert linears and all(op.anno.input_shapes[0][0] == 4 // ndevices for op in linears)
    assert sorted({op.device for op in graph.nodes()}) == list(range(ndevices))
    assert_reproduces(graph, name, ndevices=ndevices)


@pytest.mark.parametrize("ndevices", [2, 4])
def test_megatron_mlp(ndevices):
    graph = megatron_mlp(fresh("gpt_nobias"), ndevices)
    fc = graph.select(module="gpt.blocks.0.mlp.fc")
    proj = graph.select(module="gpt.blocks.0.mlp.proj")
    assert [op.device for op in fc] == list(range(ndevices))
    # columns: the weight and bias are split on the output features, the input replicated
    x, w, b = fc[1].inputs
    assert x.is_whole and w.indmap[0] == (32 // ndevices, 2 * 32 // ndevices) and not b.is_whole
    # rows: input and weight split on the reduction dim, the output value-partial
    x, w, _ = proj[1].inputs
    assert x.indmap[2] == w.indmap[1] == (32 // ndevices, 2 * 32 // ndevices)
    assert proj[1].outputs[0].valmap == (1, ndevices) and proj[1].outputs[0].shape == (4, 6, 8)
    assert_reproduces(graph, "gpt_nobias", ndevices=ndevices)


@pytest.mark.parametrize("ndevices", [2, 4])
def test_megatron_row_split_with_a_bias_puts_the_bias_on_one_part(ndevices):
    """linear's transform rule splits the reduction dim even with a bias: the bias is a
    value-partial input (whole on part 0, zeros elsewhere), so it is added once."""
    graph = megatron_mlp(fresh("gpt"), ndevices)
    proj = graph.select(module="gpt.blocks.0.mlp.proj")
    _, _, bias = proj[0].inputs
    assert bias.valmap == (0, ndevices) and proj[1].inputs[2].valmap == (1, ndevices)
    assert proj[1].outputs[0].valmap == (1, ndevices)
    assert_reproduces(graph, "gpt", ndevices=ndevices)


def test_frozen_dims_stay_frozen_without_a_rule():
    """A dim marked '^' with no rule cannot be split; the error lists what is legal."""
    graph = fresh("gpt")
    ln = graph.select(name="layer_norm", module="gpt.blocks.0.ln_1")[0]
    with pytest.raises(PartitionError, match=r"(?s)is marked '\^'.*legal") as e:
        graph.partition(ln, idx=0, dim=2, num=2)
    assert "gpt.py:" in str(e.value) and "layer_norm" in str(e.value)


def test_data_times_tensor_parallel_nests_partitions():
    """2-way data parallel, then each half of the MLP 2-way Megatron: 4 devices."""
    graph = fresh("gpt_nobias")
    megatron = {}  # op -> (idx, dim) of its tensor-parallel split
    megatron.update(dict.fromkeys(graph.select(name="linear", module="*.mlp.fc"), (1, 0)))
    megatron.update(dict.fromkeys(graph.select(name="gelu", module="*.mlp"), (0, 2)))
    megatron.update(dict.fromkeys(graph.select(name="linear", module="*.mlp.proj"), (0, 2)))
    assert len(megatron) == 6
    data_parallel(graph, 2)  # devices 0 and 1 are the data-parallel ranks for now
    for op in graph.nodes():
        dp = op.device
        origin = graph.origin(op)
        quarters = (graph.partition(op, idx=megatron[origin][0], dim=megatron[origin][1], num=2)
                    if origin in megatron else graph.replicate(op, 2))
        for tp, quarter in enumerate(quarters):
            graph.assign(quarter, 2 * dp + tp)
    proj = graph.select(module="gpt.blocks.1.mlp.proj")
    assert [(p.inputs[0].indmap[0], p.inputs[0].indmap[2], p.outputs[0].valmap) for p in proj] == [
        ((0, 2), (0, 16), (0, 2)), ((0, 2), (16, 32), (1, 2)),
        ((2, 4), (0, 16), (0, 2)), ((2, 4), (16, 32), (1, 2)),
    ]
    assert "part 1 of 2 of op" in graph.describe(proj[3])
    assert_reproduces(graph, "gpt_nobias", ndevices=4)


def test_pipeline_stages_with_data_parallel_inside():
    """Two stages (embeddings and block 0; block 1 and the head), each 2-way data parallel
    on its own two devices."""
    graph = fresh("gpt")
    first_of_block1 = graph.select(module="gpt.blocks.1")[0]
    stages = graph.staging([graph.nodes()[0], first_of_block1])
    assert graph.num_stages == 2 and sum(map(len, stages)) == len(graph.nodes())
    assert all(op.module_path.startswith("gpt.blocks.1") or op.stage == 1 for op in stages[1])
    data_parallel(graph, 2)
    for op in graph.nodes():
        graph.assign(op, 2 * op.stage + op.device)
    assert {op.device for op in graph.nodes() if op.stage == 0} == {0, 1}
    assert_reproduces(graph, "gpt", ndevices=4)


def test_layouts_of_a_split(name="gpt_manual"):
    """Splitting the reduction dim of q @ k^T gives value-partial scores; the consumer
    (a scale by a constant) reads them whole, which check accepts (an all-reduce)."""
    graph = fresh(name)
    matmul = graph.select(name="matmul")[0]
    t = matmul.anno.split(0, 3, 2)
    assert t.inputs == (Split(3), Split(2)) and t.outputs == (ValuePartial(),)
    parts = graph.partition(matmul, idx=0, dim=3, num=2)
    assert [p.outputs[0].valmap for p in parts] == [(0, 2), (1, 2)]
    assert isinstance(matmul.anno.split(0, 0, 2).inputs[1], Split)
    assert Replicate() in matmul.anno.split(0, 2, 2).inputs
    for k, part in enumerate(parts):
        graph.assign(part, k)
    replicate_rest(graph, 2)
    assert_reproduces(graph, name, ndevices=2)
