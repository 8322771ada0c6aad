"""Splits whose parts talk to each other, in the graph: cross_entropy split on its class
dim runs class_parallel_cross_entropy on its parts (a collective part op), which
run_plan runs together (threads joined by a PartGroup); parts split or replicated again
alike talk to the instances at their own position. embedding split by rows runs
row_parallel_embedding (value-partial)."""

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


def _replicated_parts(graph: IRGraph, times: int) -> list[list]:
    """The head split on its output features and the loss on its classes in 2 parts,
    each part then replicated ``times`` times: replica ``j`` of part ``p`` on device
    ``p + 2 j`` (a tensor-parallel loss replicated over context-parallel devices)."""
    out = []
    for name, idx, dim in (("linear", 1, 0), ("cross_entropy", 0, 1)):
        (op,) = graph.select(name=name)
        copies = [graph.replicate(part, times) for part in graph.partition(op, idx=idx,
                                                                           dim=dim, num=2)]
        for p, replicas in enumerate(copies):
            for j, copy in enumerate(replicas):
                graph.assign(copy, p + 2 * j)
        out.append(copies)
    replicate_rest(graph, 2 * times)
    return out[1]


def test_collective_parts_replicated_alike_talk_at_their_position():
    """Replica j of each part talks to replica j of the other parts: strided groups
    (devices 0, 2 and 1, 3 of a unit of 4), and the plan reproduces the module."""
    graph = _fresh()
    (first, second) = _replicated_parts(graph, 2)
    assert all(op.opdef.name == CLASS_PARALLEL_CE for op in (*first, *second))
    for j in range(2):
        assert graph.split_parts(first[j]) == [first[j], second[j]]
        assert graph.split_parts(second[j]) == [first[j], second[j]]
    assert [op.device for op in graph.split_parts(first[1])] == [2, 3]
    _assert_reproduces(graph, 4)


def test_collective_parts_replaced_unlike_are_refused():
    graph = _fresh()
    (ce,) = graph.select(name="cross_entropy")
    parts = graph.partition(ce, idx=0, dim=1, num=2)
    copies = graph.replicate(parts[1], 2)  # part 0 stays one instance
    with pytest.raises(PlanError, match=r"(?s)part of a split in 2 parts that talk.*"
                                        r"class_parallel_cross_entropy.*replaced otherwise "
                                        r"\(2 instances\).*replicate every part of the split "
                                        r"alike"):
        graph.split_parts(parts[0])
    with pytest.raises(PlanError, match="replaced otherwise"):
        graph.split_parts(copies[0])
    # one copy is not a replication: the group is unchanged
    graph = _fresh()
    parts = _class_parallel(graph, 2)
    (same,) = graph.replicate(parts[1], 1)
    assert same.opdef.collective and graph.split_parts(same) == [parts[0], same]


class _Lse(nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x).sum()


def test_a_collective_part_is_not_split_by_a_rule_that_talks_again(fresh_plugins):
    """A talking part splits again only along its own annotation: a rule of the part op
    whose parts would talk again (a log-sum-exp over split columns) is refused; a split of
    the free rows is allowed (each row's exchange is independent of the others)."""
    import nnscaler
    from nnscaler.anno import Replicate, Split, TransformRule
    from nnscaler.ops.partgroup import SINGLE

    def lse_part(x, *, group=SINGLE):
        peak = x.detach().amax(-1)
        mine = torch.stack([peak, (x - peak.unsqueeze(-1)).exp().sum(-1)])
        every = group.all_gather(mine)
        top = every[:, 0].amax(0)
        return top + (every[:, 1] * (every[:, 0] - top).exp()).sum(0).log()

    by_columns = TransformRule([Split(1)], [Replicate()], part_op="test.lse_part")
    nnscaler.register_op("a c^ -> a", name="test.lse_part", collective=True,
                         transform_rules=[by_columns])(lse_part)
    lse = nnscaler.register_op("a c^ -> a", name="test.lse", transform_rules=[by_columns])(
        lambda x: torch.logsumexp(x, -1))
    module, args = _Lse(lse), {"x": torch.randn(4, 8, requires_grad=True)}
    case = traced_case("lse", module, args)
    graph = IRGraph.from_graph(case.graph)
    (op,) = graph.select(name="test.lse")
    parts = graph.partition(op, idx=0, dim=1, num=2)
    before = graph.nodes()
    with pytest.raises(PartitionError, match=r"(?s)cannot partition.*talk to each other.*"
                                             r"test.lse_part.*run test.lse_part instead.*"
                                             r"split the op it came from differently"):
        graph.partition(parts[0], idx=0, dim=1, num=2)
    assert graph.nodes() == before  # nothing changed
    # rows: instance j of each column part talks to instance j of the other
    rows = [graph.partition(part, idx=0, dim=0, num=2) for part in parts]
    for p, halves in enumerate(rows):
        for j, half in enumerate(halves):
            graph.assign(half, p + 2 * j)
            assert graph.split_parts(half) == [rows[0][j], rows[1][j]]
    replicate_rest(graph, 4)
    assert_case_reproduces(graph, case, ndevices=4)


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
