"""An adapter's runtime side is registered with its planning side: a plugin primitive
registered through ``nnscaler_register_adapters`` runs, in `execute_plan`, with its own
``run_step``, and says through ``needs_process_group`` whether its groups need one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nnscaler.errors import CollectiveError
from nnscaler.extend import Layout, Plan, Primitive, execute_plan, hookimpl, plan_groups
from nnscaler.layout import Group, Step
from nnscaler.plugins import NNScalerPluginManager


class Doubling(Primitive):
    """A local primitive of no built-in kind: every device doubles its piece (its own
    adjoint, as doubling is symmetric)."""

    def forward(self, inputs, *, n_out, **params):  # noqa: ANN001, ANN201
        return [2 * x for x in inputs]

    def run_step(self, step: Step, rank: int, x: torch.Tensor | None,
                 ctx: dict[str, Any]) -> torch.Tensor | None:
        return None if x is None else 2 * x


class GroupDoubling(Doubling):
    needs_process_group = True


class NoRuntime(Primitive):
    """A primitive with a planning side only."""


class DoublingPlugin:
    @hookimpl
    def nnscaler_register_adapters(self, registry):  # noqa: ANN001, ANN201
        registry.register("double", Doubling(name="double", adjoint="double"))


def _plan(prim: Primitive, ndevices: int = 1) -> Plan:
    layout = Layout.parse(f"R({ndevices})V(1)D(1,1)", shape=(2, 3))
    step = Step(primitive=prim, adjoint=prim, groups=(Group.of(tuple(range(ndevices))),),
                before=layout, after=layout)
    return Plan(src=layout, dst=layout, steps=(step,))


def test_a_primitive_registered_through_the_hook_runs_its_own_runtime_side():
    pm = NNScalerPluginManager(autoload=False, plugins=[DoublingPlugin()])
    prim = pm.adapters.get("double")
    x = torch.arange(6.0).reshape(2, 3).requires_grad_(True)
    y = execute_plan(_plan(prim), x, rank=0)
    assert torch.equal(y, 2 * x.detach())
    y.backward(torch.ones(2, 3))  # the adjoint (doubling again) runs on the gradient
    assert torch.equal(x.grad, torch.full((2, 3), 2.0))


def test_needs_process_group_decides_the_groups_a_plan_needs():
    assert plan_groups(_plan(Doubling(name="double", adjoint="double"), 2)) == []
    assert plan_groups(_plan(GroupDoubling(name="gdouble", adjoint="gdouble"), 2)) == [(0, 1)]


def test_a_primitive_without_a_runtime_side_is_refused_with_the_fix():
    prim = NoRuntime(name="no_runtime", adjoint="no_runtime")
    with pytest.raises(CollectiveError, match=r"define NoRuntime\.run_step"):
        execute_plan(_plan(prim), torch.zeros(2, 3), rank=0)
