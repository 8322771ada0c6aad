"""Random plans on the project's models: any sequence of legal partitions (nested ones
included), replications and multirefs, with any assignment, passes check_plan, keeps every
instance's pieces in agreement with its annotation, and reproduces the module."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from plan_helpers import CASES, assert_reproduces, fresh

from nnscaler.anno import Transform, ValuePartial
from nnscaler.graph import IRGraph
from nnscaler.ir import Op, SubTensor, tensors_in

_SPLITS: dict[Op, list[Transform]] = {}


def legal_splits(op: Op) -> list[Transform]:
    if op not in _SPLITS:
        rules = op.opdef.rules_for(op.anno) if op.opdef is not None else ()
        whole = op.anno is None or _collective(op)  # a collective part runs once, whole
        _SPLITS[op] = [] if whole else op.anno.transform_space(rules=rules)
    return _SPLITS[op]


def _collective(op: Op) -> bool:
    return op.opdef is not None and op.opdef.collective


def gives_partial(op: Op) -> bool:
    return any(ValuePartial() in t.outputs for t in legal_splits(op))


def draw_plan(data: st.DataObject, graph: IRGraph, ndevices: int) -> IRGraph:
    if data.draw(st.booleans(), label="multiref first"):
        shared = [t for t in graph.tensors
                  if len({graph.origin(op) for op in graph.consumers(t)}) > 1]
        if shared:
            graph.multiref(data.draw(st.sampled_from(shared), label="multiref tensor"))
    for _ in range(data.draw(st.integers(0, 4), label="steps")):
        splittable = [op for op in graph.nodes() if legal_splits(op)]
        partial = [op for op in splittable if gives_partial(op)]
        if partial and data.draw(st.booleans(), label="value-partial"):
            splittable = partial  # rarer in these models: ask for them half of the time
        op = data.draw(st.sampled_from(splittable), label="op")
        t = data.draw(st.sampled_from(legal_splits(op)), label="split")
        parts = graph.partition(op, idx=t.idx, dim=t.dim, num=t.num)
        again = [p for p in parts if legal_splits(p)]
        if again and data.draw(st.booleans(), label="nested"):
            part = data.draw(st.sampled_from(again), label="part")
            t = data.draw(st.sampled_from(legal_splits(part)), label="nested split")
            graph.partition(part, idx=t.idx, dim=t.dim, num=t.num)
        copyable = [op for op in graph.nodes() if not _collective(op)]
        if data.draw(st.booleans(), label="replicate"):
            graph.replicate(data.draw(st.sampled_from(copyable), label="copied"),
                            data.draw(st.integers(1, 3), label="times"))
    rng = data.draw(st.randoms(use_true_random=False), label="devices")
    for op in graph.nodes():
        graph.assign(op, rng.randrange(ndevices))
    return graph


def assert_pieces_fit_annotations(graph: IRGraph) -> None:
    for op in graph.nodes():
        if op.anno is None:
            continue
        shapes = [x.shape if isinstance(x, SubTensor) else None for x in op.inputs]
        assert op.anno.input_shapes == tuple(shapes)
        bound = op.anno.anno.bind(shapes, op.kwargs)
        outs = [t.shape or (1,) for t in tensors_in(op.outputs)]
        assert [s for s in bound.output_shapes if s is not None] == outs, str(op)


@pytest.mark.parametrize("name", CASES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), ndevices=st.sampled_from([1, 2, 4]))
def test_random_plans_reproduce_the_module(name, data, ndevices):
    graph = draw_plan(data, fresh(name), ndevices)
    event("op instances", len(graph.nodes()) // 25 * 25)
    event("multiref", any(op.name.endswith("multiref") for op in graph.nodes()))
    event("nested", any(d.count("part ") > 1 for d in map(graph.describe, graph.nodes())))
    event("value-partial", any(t.valmap != (0, 1) for op in graph.nodes() for t in op.output_tensors()))
    assert_pieces_fit_annotations(graph)
    assert_reproduces(graph, name, ndevices=ndevices)
