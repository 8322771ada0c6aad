"""Splits whose parts talk to each other, in the graph: cross_entropy split on its class
dim runs class_parallel_cross_entropy on its parts (a collective part op), which
run_plan runs together (threads joined by a PartGroup); the parts cannot be split again
or replicated. embedding split by rows runs row_parallel_embedding (value-partial)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from plan_helpers import Case, assert_case_reproduces, replicate_rest, traced_case
from torch import nn

from nnscaler.graph import IRGraph, PartitionError, PlanError
from nnscaler.ops.builtin.loss import CLASS_PARALLEL_CE
from nnscaler.ops.builtin.nn import ROW_PARALLEL_EMBEDDING

VOCAB, D, CLASSES, BATCH = 12, 8, 8, 6


class Tiny(nn.Module):
    """Embedding, a linear head over CLASSES classes, a mean cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, tokens: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.embedding(tokens, self.emb.weight)
        return F.cross_entropy(self.head(torch.tanh(h)), y)


@functools.cache
def _case() -> Case:
    torch.manual_seed(0)
    module = Tiny()
    g = torch.Generator().manual_seed(1)
    args = {"tokens": torch.randint(0, VOCAB, (BATCH,), generator=g),
            "y": torch.randint(0, CLASSES, (BATCH,), generator=g)}
    args["y"][2] = -100  # an ignored target: the mean is over the others
    return traced_case("tiny", module, args)


def _fresh() -> IRGraph:
    return IRGraph.from_graph(_case().graph)


def _assert_reproduces(graph: IRGraph, ndevices: int) -> None:
    """check_plan passes; run_plan gives the loss and every parameter's gradient."""
    assert_case_reproduces(graph, _case(), ndevices=ndevices)


def _class_parallel(graph: IRGraph, num: int, *, rows: bool = False) -> list:
    """The head split on its output features, the loss on its classes (parts on devices
    0..num-1); with ``rows`` the embedding table split by rows too; the rest replicated."""
    (head,) = graph.select(name="linear")
    for device, part in enumerate(graph.partition(head, idx=1, dim=0, num=num)):
        graph.assign(part, device)
    (ce,) = graph.select(name="cross_entropy")
    parts = graph.partition(ce, idx=0, dim=1, num=num)
    for device, part in enumerate(parts):
        graph.assign(part, device)
    if rows:
        (emb,) = graph.select(name="embedding")
        for device, part in enumerate(graph.partition(emb, idx=1, dim=0, num=num)):
            graph.assign(part, device)
    replicate_rest(graph, num)
    return parts


@pytest.mark.parametrize("num", [2, 4])
def test_class_parallel_loss_reproduces_the_module(num):
    graph = _fresh()
    parts = _class_parallel(graph, num)
    assert [op.opdef.name for op in parts] == [CLASS_PARALLEL_CE] * num
    assert all(op.opdef.collective for op in parts)
    assert [op.kwargs["class_start"] for op in parts] == [p * CLASSES // num for p in range(num)]
    assert {op.kwargs["num_classes"] for op in parts} == {CLASSES}
    # each part reads its classes of the logits and the whole targets, writes the whole loss
    for p, op in enumerate(parts):
        logits, target = op.inputs[:2]
        assert logits.indmap[1] == (p * CLASSES // num, (p + 1) * CLASSES // num)
        assert target.is_whole and op.outputs[0].is_whole
    assert graph.select(name="cross_entropy") == parts
    _assert_reproduces(graph, num)


def test_class_parallel_loss_with_a_row_parallel_embedding():
    graph = _fresh()
    _class_parallel(graph, 2, rows=True)
    emb = graph.select(name="embedding")
    assert [op.opdef.name for op in emb] == [ROW_PARALLEL_EMBEDDING] * 2
    assert not any(op.opdef.collective for op in emb)
    assert [op.kwargs["row_start"] for op in emb] == [0, VOCAB // 2]
    assert [op.outputs[0].valmap for op in emb] == [(0, 2), (1, 2)]
    _assert_reproduces(graph, 2)


def test_split_parts_are_the_siblings_in_part_order():
    graph = _fresh()
    parts = _class_parallel(graph, 2)
    for op in parts:
        assert graph.split_parts(op) == parts
    # an op that is not a part of a split is its own group; replicas are not a split
    tanh = graph.select(name="tanh")
    assert len(tanh) == 2 and graph.split_parts(tanh[0]) == [tanh[0]]
    heads = graph.select(name="linear")
    assert graph.split_parts(heads[1]) == heads


def test_a_collective_part_cannot_be_split_again_or_replicated():
    graph = _fresh()
    parts = _class_parallel(graph, 2)
    before = graph.nodes()
    # the part's annotation would allow a batch split, but its parts talk to each other
    with pytest.raises(PartitionError, match=r"(?s)cannot partition.*talk to each other.*"
                                             r"class_parallel_cross_entropy.*Split the op it "
                                             r"came from in more parts"):
        graph.partition(parts[0], idx=0, dim=0, num=2)
    with pytest.raises(PlanError, match=r"(?s)replicate.*talk to each other.*"
                                        r"class_parallel_cross_entropy.*runs exactly once"):
        graph.replicate(parts[1], 2)
    assert graph.nodes() == before  # nothing changed
    # one copy is not a replication: allowed
    (same,) = graph.replicate(parts[1], 1)
    assert same.opdef.collective


def test_row_parallel_parts_can_be_split_again():
    """row_parallel_embedding is a part op that does not talk: its parts are ordinary."""
    graph = _fresh()
    (emb,) = graph.select(name="embedding")
    rows = graph.partition(emb, idx=1, dim=0, num=2)
    halves = graph.partition(rows[1], idx=0, dim=0, num=2)
    assert [op.opdef.name for op in halves] == [ROW_PARALLEL_EMBEDDING] * 2
    copies = graph.replicate(rows[0], 2)
    for device, op in enumerate([*copies, *halves]):
        graph.assign(op, device)
    replicate_rest(graph, 4)
    _assert_reproduces(graph, 4)
