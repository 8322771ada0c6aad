"""The plan of one adapter in every scale unit: nnscaler's planner with its own
primitives gives, for layouts shifted by ``k`` devices, the plan of the unshifted layouts
with its devices renamed (so codegen renames the plan of the first unit instead of
planning each unit anew); with a primitive of another module it plans anew."""

from __future__ import annotations

import os
import sys

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "layout"))

from layout_strategies import layout_pairs  # noqa: E402

from nnscaler.codegen.layouts import relabel_invariant, shifted, shifted_plan, unit_plan  # noqa: E402
from nnscaler.layout import Layout, plan  # noqa: E402
from nnscaler.layout.primitives import AllGather  # noqa: E402
from nnscaler.registry import active_registry  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(layout_pairs(), st.integers(1, 3))
def test_a_shifted_pair_plans_like_the_pair_renamed(pair, units):
    src, dst = pair
    offset = 16 * units  # past every device id the strategy draws (< 12)
    assert relabel_invariant()
    want = plan(shifted(src, offset), shifted(dst, offset))
    assert shifted_plan(plan(src, dst), offset) == want
    assert unit_plan(plan(src, dst), offset) == want
    assert unit_plan(plan(src, dst), 0) == plan(src, dst)


@attrs.frozen(kw_only=True)
class NodeAwareGather(AllGather):
    """A primitive of another module: its cost could read device numbers."""

    name: str = "node_aware_gather"


class _Registry:
    def __init__(self, items):
        self._items = items

    def items(self):
        return list(self._items)


def test_a_foreign_primitive_plans_each_unit_anew(monkeypatch):
    base = list(active_registry("adapters").items())
    foreign = _Registry([*base, ("node_aware_gather", NodeAwareGather())])
    assert relabel_invariant(_Registry(base))
    assert not relabel_invariant(foreign)
    src = Layout(shape=(4, 6), d=(2, 1), devices=(0, 1))  # split rows -> all_gather
    dst = Layout(shape=(4, 6), r=2, devices=(0, 1))
    called = []

    def spy(a, b, registry=None):
        called.append((a, b))
        return plan(a, b, registry)

    import nnscaler.codegen.layouts as layouts

    monkeypatch.setattr(layouts, "make_plan", spy)
    p = plan(src, dst)
    out = unit_plan(p, 8, invariant=False)
    assert called == [(shifted(src, 8), shifted(dst, 8))]
    assert out == plan(shifted(src, 8), shifted(dst, 8)) and out.steps
