"""Value splits in the graph: ``partition(op, idx=k, dim=None, num=n)`` splits an op by
its value rule (add/sub of two tensors): the parts read value parts of the inputs and
write value-partial outputs. Value-partial producers (row-parallel embeddings, a
row-split linear) feed them without communication; the plans reproduce the module. The
tp policy uses this on the GPT: both embeddings split by rows, their sum all-reduced
once."""

from __future__ import annotations

import functools
import os
import re
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from plan_helpers import Case, assert_case_reproduces, replicate_rest, traced_case
from torch import nn

from nnscaler.anno import ValuePartial
from nnscaler.graph import IRGraph, PartitionError
from nnscaler.ops.builtin.nn import ROW_PARALLEL_EMBEDDING
from nnscaler.policies import adapters, tp

# the policies' test models (as tests/codegen reaches tests/graph)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "policies"))
import policy_cases  # noqa: E402

VOCAB, POS, D, CLASSES, BATCH = 12, 4, 8, 5, 3


class Tiny(nn.Module):
    """Token plus position embeddings, then ``h - proj(tanh(h) * h)`` and a linear head
    under a mean cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(POS, D)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1])
        h = F.embedding(ids, self.wte.weight) + F.embedding(pos, self.wpe.weight)
        r = h - self.proj(torch.tanh(h) * h)
        return F.cross_entropy(self.head(r).view(-1, CLASSES), y.view(-1))


@functools.cache
def _case() -> Case:
    torch.manual_seed(0)
    module = Tiny()
    g = torch.Generator().manual_seed(1)
    args = {"ids": torch.randint(0, VOCAB, (BATCH, POS), generator=g),
            "y": torch.randint(0, CLASSES, (BATCH, POS), generator=g)}
    return traced_case("tiny", module, args)


def _fresh() -> IRGraph:
    return IRGraph.from_graph(_case().graph)


def _assert_reproduces(graph: IRGraph, ndevices: int) -> None:
    """check_plan passes; run_plan gives the loss and every parameter's gradient."""
    assert_case_reproduces(graph, _case(), ndevices=ndevices)


def _split(graph: IRGraph, op: Any, **how: Any) -> list:
    parts = graph.partition(op, **how)
    for device, part in enumerate(parts):
        graph.assign(part, device)
    return parts


def _row_parallel_embeddings(graph: IRGraph, num: int) -> list[list]:
    return [_split(graph, emb, idx=1, dim=0, num=num) for emb in graph.select(name="embedding")]


@pytest.mark.parametrize("num", [2, 4])
def test_sum_of_row_parallel_embeddings(num):
    """Both tables split by rows (value-partial lookups), the add split by values: part p
    adds the p-th value parts and writes the p-th value part of the sum, and nothing
    moves between the lookups and the add."""
    graph = _fresh()
    embs = _row_parallel_embeddings(graph, num)
    (add,) = graph.select(name="add")
    parts = _split(graph, add, idx=0, dim=None, num=num)
    replicate_rest(graph, num)

    for lookups in embs:
        assert [op.opdef.name for op in lookups] == [ROW_PARALLEL_EMBEDDING] * num
        assert [op.outputs[0].valmap for op in lookups] == [(p, num) for p in range(num)]
    assert [op.opdef.name for op in parts] == ["torch.add"] * num
    assert graph.select(name="add") == parts and graph.split_parts(parts[-1]) == parts
    for p, op in enumerate(parts):
        assert [x.valmap for x in op.input_tensors()] == [(p, num), (p, num)]
        assert [x.shape for x in op.input_tensors()] == [(BATCH, POS, D), (POS, D)]
        out = op.outputs[0]
        assert out.valmap == (p, num) and out.shape == (BATCH, POS, D) and out.indmap == (
            (0, BATCH), (0, POS), (0, D))
        assert graph.value_key(op, 0) == ((("+", num), p),)
        assert f"split the values of input 0 in {num}: V, V -> V" in graph.describe(op)
    # the parts read exactly what the lookups wrote
    lookup_outs = {op.outputs[0].full for lookups in embs for op in lookups}
    assert not [a for a in adapters(graph, num) if a.tensor in lookup_outs]
    _assert_reproduces(graph, num)


def test_add_parts_have_valmaps_0_2_and_1_2():
    graph = _fresh()
    _row_parallel_embeddings(graph, 2)
    (add,) = graph.select(name="add")
    parts = _split(graph, add, idx=0, dim=None, num=2)
    assert [op.outputs[0].valmap for op in parts] == [(0, 2), (1, 2)]
    assert [op.device for op in parts] == [0, 1]
    replicate_rest(graph, 2)
    _assert_reproduces(graph, 2)


def test_a_value_split_of_whole_inputs_splits_them_for_free():
    """Replicated producers: the add's parts take value parts of whole tensors (free)."""
    graph = _fresh()
    (add,) = graph.select(name="add")
    _split(graph, add, idx=0, dim=None, num=2)
    replicate_rest(graph, 2)
    moved = [a for a in adapters(graph, 2) if a.op is not None and a.op.name == "torch.add"]
    assert len(moved) == 2 and all(a.primitives == ("value_split",) and a.cost == 0
                                   for a in moved)
    _assert_reproduces(graph, 2)


def test_residual_sub_of_a_row_split_linear():
    """proj split on its reduction dim writes value parts; the residual ``h`` is the value
    parts of the add; the sub split by values (asked by its input 1) subtracts part from
    part, so neither of its inputs moves."""
    graph = _fresh()
    _row_parallel_embeddings(graph, 2)
    (add,) = graph.select(name="add")
    _split(graph, add, idx=0, dim=None, num=2)
    (proj,) = graph.select(module="proj")
    rows = _split(graph, proj, idx=0, dim=-1, num=2)
    assert [op.outputs[0].valmap for op in rows] == [(0, 2), (1, 2)]
    (sub,) = graph.select(name="sub")
    parts = _split(graph, sub, idx=1, dim=None, num=2)
    replicate_rest(graph, 2)
    for p, op in enumerate(parts):
        assert op.opdef.name == "torch.sub"
        assert [x.valmap for x in op.input_tensors()] == [(p, 2), (p, 2)]
        assert op.outputs[0].valmap == (p, 2)
    read_by_sub = {x.full for x in parts[0].input_tensors()}
    assert not [a for a in adapters(graph, 2) if a.tensor in read_by_sub and a.op is not None
                and a.op.name == "torch.sub"]
    _assert_reproduces(graph, 2)


def test_a_value_part_can_be_split_again():
    graph = _fresh()
    (add,) = graph.select(name="add")
    first = graph.partition(add, idx=0, dim=None, num=2)
    again = graph.partition(first[1], idx=0, dim=None, num=2)
    assert [op.outputs[0].valmap for op in again] == [(2, 4), (3, 4)]
    assert [[x.valmap for x in op.input_tensors()] for op in again] == [[(2, 4)] * 2,
                                                                       [(3, 4)] * 2]
    for op, device in zip([first[0], *again], [0, 1, 0], strict=True):
        graph.assign(op, device)
    replicate_rest(graph, 2)
    _assert_reproduces(graph, 2)


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", ["x", 1.5, (0,)])
def test_dim_must_be_an_int_or_none(dim):
    graph = _fresh()
    (add,) = graph.select(name="add")
    before = graph.nodes()
    with pytest.raises(TypeError, match=r"dim must be an int or None \(split the values\), "
                                        r"got " + re.escape(repr(dim))):
        graph.partition(add, idx=0, dim=dim, num=2)
    assert graph.nodes() == before


@pytest.mark.parametrize(("key", "value"), [("idx", None), ("num", None)])
def test_idx_and_num_must_be_ints(key, value):
    graph = _fresh()
    (add,) = graph.select(name="add")
    how = {"idx": 0, "dim": None, "num": 2, key: value}
    with pytest.raises(TypeError, match=rf"{key} must be an int, got None"):
        graph.partition(add, **how)


def test_a_value_split_of_mul_lists_the_legal_choices():
    graph = _fresh()
    (mul,) = graph.select(name="mul")
    before = graph.nodes()
    with pytest.raises(PartitionError) as info:
        graph.partition(mul, idx=0, dim=None, num=2)
    text = str(info.value)
    assert text.startswith("cannot partition op #")
    assert "torch.mul" in text and "with idx=0, dim=None, num=2" in text
    assert ("cannot split the values of input 0 in 2: no value rule of the op takes input 0 "
            "value-partial") in text
    assert "legal choices (idx, dim, num):" in text
    assert "idx=0, dim=0 ('a'): num in [3]" in text
    assert "idx=0, dim=2 ('c'): num in [2, 4, 8]" in text
    assert "dim=None" not in text.split("legal choices")[1]
    assert "Pick one of the legal choices, or replicate the op" in text
    assert graph.nodes() == before


def test_a_value_split_in_one_part_is_refused():
    graph = _fresh()
    (add,) = graph.select(name="add")
    with pytest.raises(PartitionError) as info:
        graph.partition(add, idx=0, dim=None, num=1)
    text = str(info.value)
    assert "cannot split the values of input 0 in 1: num must be at least 2" in text
    assert "idx=0, dim=None (its values): any num >= 2" in text


def test_the_value_split_of_add_is_in_its_transform_space():
    graph = _fresh()
    (add,) = graph.select(name="add")
    space = add.anno.transform_space(rules=add.opdef.rules_for(add.anno))
    values = [t for t in space if t.dim is None]
    assert [(t.idx, t.num, t.ident) for t in values] == [(0, 2, "+"), (0, 3, "+"), (0, 4, "+")]
    assert all(t.inputs == (ValuePartial(), ValuePartial()) for t in values)


# -- the tp policy on the GPT ----------------------------------------------------------------


def test_tp_all_reduces_the_sum_of_the_gpt_embeddings_once():
    """tp splits both embedding tables by rows (row-parallel, value-partial lookups),
    adds the value parts, and all-reduces the sum once before the first layer norm."""
    graph = tp(policy_cases.fresh("gpt"), policy_cases.config(2))
    for name in ("gpt.wte", "gpt.wpe"):
        lookups = [op for op in graph.select(module=name) if "embedding" in op.name]
        assert [op.opdef.name for op in lookups] == [ROW_PARALLEL_EMBEDDING] * 2
        assert [op.outputs[0].valmap for op in lookups] == [(0, 2), (1, 2)]
    adds = [op for op in graph.ops if op.name == "torch.add" and op.module_path == "gpt"]
    assert len(adds) == 2 and [op.outputs[0].valmap for op in adds] == [(0, 2), (1, 2)]
    assert [[x.valmap for x in op.input_tensors()] for op in adds] == [[(0, 2)] * 2,
                                                                      [(1, 2)] * 2]

    order = {}
    for at, op in enumerate(graph.ops):
        order.setdefault(graph.origin(op), at)
    first_ln = next(at for at, op in enumerate(graph.ops) if op.name.endswith("layer_norm"))
    found = adapters(graph, 2)
    before = [a for a in found if a.cost > 0 and (a.op is None or order[a.op] < first_ln)]
    assert len(before) == 1, [str(a) for a in before]
    (reduce,) = before
    assert reduce.primitives == ("all_reduce",)
    assert reduce.tensor == adds[0].outputs[0].full  # the embeddings' sum
    policy_cases.assert_reproduces(graph, "gpt", 2)
