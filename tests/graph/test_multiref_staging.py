"""multiref (and its op, a built-in plugin), pipeline staging and recompute groups."""

from __future__ import annotations

import random

from plan_helpers import assert_reproduces, fresh, replicate_rest

from nnscaler.graph.ops import MULTIREF_NAME, multiref
from nnscaler.ops.verify import verify_op
from nnscaler.plugins import get_plugin_manager


def test_multiref_is_a_builtin_op_that_keeps_its_promise():
    ops = get_plugin_manager().ops
    assert ops.by_registrant("nnscaler.graph.ops") == [MULTIREF_NAME]
    opdef = ops.get(MULTIREF_NAME)
    rng = random.Random(0)
    for _ in range(10):
        args, kwargs = opdef.input_gen_fn(rng)
        verify_op(opdef, args, kwargs)
    x = args[0]
    assert all(y is x for y in multiref(x, 3))


def test_multiref_gives_each_consumer_its_own_copy():
    """ln_1's output feeds q, k and v: after multiref each reads its own copy, so q can be
    split on the batch, k on its output features, and v stay whole."""
    graph = fresh("gpt")
    q, k, v = graph.select(name="linear", module="gpt.blocks.0.attn")[:3]
    shared = q.inputs[0].full
    assert graph.consumers(shared) == [q, k, v]
    ref = graph.multiref(shared)
    assert ref.name == MULTIREF_NAME and str(ref.anno) == "d0 d1 d2 -> d0 d1 d2, d0 d1 d2, d0 d1 d2"
    assert graph.consumers(shared) == [ref] and graph.select(name="multiref") == [ref]
    q, k, v = graph.select(name="linear", module="gpt.blocks.0.attn")[:3]
    assert [op.inputs[0].full for op in (q, k, v)] == [t.full for t in ref.outputs]
    assert graph.nodes().index(ref) + 1 == graph.nodes().index(q)
    assert graph.origin(q).oid == q.oid and "reads a copy of" in graph.describe(q)

    q_parts = graph.partition(q, idx=0, dim=0, num=2)
    k_parts = graph.partition(k, idx=1, dim=0, num=2)
    ref_parts = graph.partition(ref, idx=0, dim=1, num=2)  # the copies split like any op
    assert [p.outputs[2].indmap[1] for p in ref_parts] == [(0, 3), (3, 6)]
    for parts in (q_parts, k_parts, ref_parts):
        for device, part in enumerate(parts):
            graph.assign(part, device)
    replicate_rest(graph, 2)
    assert_reproduces(graph, "gpt", ndevices=2)


def test_multiref_after_a_partition_shares_one_copy_per_op():
    graph = fresh("gpt")
    q = graph.select(name="linear", module="gpt.blocks.1.attn")[0]
    shared = q.inputs[0].full
    halves = graph.partition(q, idx=0, dim=0, num=2)
    ref = graph.multiref(shared)
    assert len(ref.outputs) == 3  # q (both halves), k, v
    halves = graph.instances(q)
    assert halves[0].inputs[0].full is halves[1].inputs[0].full is ref.outputs[0].full
    assert [h.inputs[0].indmap[0] for h in halves] == [(0, 2), (2, 4)]
    replicate_rest(graph, 1)
    assert_reproduces(graph, "gpt", ndevices=1)


def test_staging_numbers_every_op_and_later_instances_inherit():
    graph = fresh("gpt")
    ops = graph.nodes()
    cut = graph.select(module="gpt.blocks.1")[0]
    stages = graph.staging([ops[0], cut])
    assert [len(s) for s in stages] == [ops.index(cut), len(ops) - ops.index(cut)]
    assert [op.stage for op in ops] == [0] * ops.index(cut) + [1] * (len(ops) - ops.index(cut))
    parts = graph.partition(graph.select(module="gpt.lm_head")[0], idx=0, dim=0, num=2)
    assert [p.stage for p in parts] == [1, 1] and "stage 1" in str(parts[0])
    ref = graph.multiref(graph.select(name="linear", module="gpt.blocks.1.attn")[0].inputs[0])
    assert ref.stage == 1
    again = graph.staging([graph.nodes()[0], graph.select(module="gpt.blocks.0.mlp")[0], cut])
    assert len(again) == 3 and graph.num_stages == 3 and parts[0].stage == 2


def test_recompute_groups():
    graph = fresh("gpt")
    first = graph.recompute("gpt.blocks.0")
    second = graph.recompute(graph.select(module="gpt.blocks.1.mlp"))
    assert (first, second) == (0, 1)
    assert {op.recompute for op in graph.select(module="gpt.blocks.0")} == {0}
    assert {op.recompute for op in graph.select(module="gpt.blocks.1.mlp")} == {1}
    assert graph.select(module="gpt.ln_f")[0].recompute is None
    fc = graph.select(module="gpt.blocks.0.mlp.fc")[0]
    parts = graph.partition(fc, idx=0, dim=0, num=2)
    assert [p.recompute for p in parts] == [0, 0] and "recompute 0" in str(parts[1])
    assert graph.recompute(["gpt.ln_f", "gpt.lm_head"]) == 2
