"""The graph's bookkeeping stays exact when it is updated in place: after any sequence of
partitions (nested, value splits), replications and multirefs in any order, the
producer/consumer index equals one rebuilt from the op list, every replaced op's
instances sit where it stood, and check_plan's memo of a passed check is dropped by any
change it reads (an op replaced, a device changed)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_helpers import fresh, replicate_rest
from test_plan_properties import legal_splits

import nnscaler.graph.check as check_module
from nnscaler.graph import IRGraph, PlanCheckError, check_plan
from nnscaler.ir import Op


def _rebuilt(graph: IRGraph) -> tuple[dict, dict]:
    copy = IRGraph.__new__(IRGraph)
    copy.ops = list(graph.ops)
    copy._producers, copy._consumers = {}, {}
    IRGraph.reindex(copy)
    return copy._producers, copy._consumers


def _assert_index_exact(graph: IRGraph) -> None:
    producers, consumers = _rebuilt(graph)
    assert graph._producers == producers
    assert graph._consumers == consumers
    assert len(set(map(id, graph.ops))) == len(graph.ops)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(["mlp", "gpt"]))
def test_index_after_random_edits_equals_a_rebuilt_one(data, name):
    graph = fresh(name)
    for _ in range(data.draw(st.integers(1, 12), label="edits")):
        ops = graph.nodes()
        op = data.draw(st.sampled_from(ops), label="op")  # any position: not program order
        at = ops.index(op)
        kind = data.draw(st.sampled_from(["partition", "replicate", "multiref"]), label="kind")
        if kind == "partition" and legal_splits(op):
            t = data.draw(st.sampled_from(legal_splits(op)), label="split")
            new = graph.partition(op, idx=t.idx, dim=t.dim, num=t.num)
        elif kind == "multiref":
            shared = [t for t in graph.tensors
                      if len({graph.origin(o) for o in graph.consumers(t)}) > 1]
            if not shared:
                continue
            graph.multiref(data.draw(st.sampled_from(shared), label="tensor"))
            _assert_index_exact(graph)
            continue
        elif op.opdef is not None and op.opdef.collective:
            continue
        else:
            new = graph.replicate(op, data.draw(st.integers(1, 3), label="times"))
        assert graph.ops[at:at + len(new)] == new  # in place, in order
        assert graph.ops[:at] == ops[:at] and graph.ops[at + len(new):] == ops[at + 1:]
        _assert_index_exact(graph)


def _planned(ndevices: int = 2) -> IRGraph:
    graph = fresh("mlp")
    replicate_rest(graph, ndevices)
    return graph


def test_a_passed_check_is_not_repeated(monkeypatch):
    graph = _planned()
    calls = []
    real = check_module._check_pieces
    monkeypatch.setattr(check_module, "_check_pieces", lambda g: calls.append(g) or real(g))
    check_plan(graph, 2)
    check_plan(graph, 2)
    graph.check(2)
    assert len(calls) == 1
    check_plan(graph, 3)  # another number of devices: checked again
    assert len(calls) == 2


def test_a_change_after_a_passed_check_is_checked():
    graph = _planned()
    check_plan(graph, 2)
    op: Op = graph.nodes()[0]
    op.plan.device = 5  # set behind the graph's back: still seen
    with pytest.raises(PlanCheckError, match="devices are numbered 0 to 1"):
        check_plan(graph, 2)
    op.plan.device = 0
    check_plan(graph, 2)
    first = graph.origin(graph.nodes()[0])
    graph.ops = [o for o in graph.ops if graph.origin(o) is not first]  # nobody writes it
    graph.reindex()
    with pytest.raises(PlanCheckError):
        check_plan(graph, 2)


def test_parts_with_equal_shapes_share_one_bound_annotation():
    graph = fresh("gpt")
    (fc,) = graph.select(name="linear", module="gpt.blocks.0.mlp.fc")
    parts = graph.partition(fc, idx=1, dim=0, num=4)
    assert len({id(p.anno) for p in parts}) == 1
    assert all(p.anno.input_shapes == parts[0].anno.input_shapes for p in parts)
