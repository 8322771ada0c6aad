"""Aliased dummy arguments through ``parallelize``: the same tensor given for two
arguments (or twice inside a container) traces as separate inputs, so the generated code
reads each argument where the model did, trains as the single-device model does, and the
files generated for aliased dummies are the files generated for distinct ones (so reusing
them is safe). Before, ``{'x': t, 'y': t}`` generated ``torch.sub(t2, x)`` for ``x * w - y``."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

from nnscaler import ComputeConfig, build_optimizer, parallelize

from .common import ADAM, check_pieces, reference_train

ONE = ComputeConfig(plan_ngpus=1, runtime_ngpus=1)


class Sub(nn.Module):
    """The issue's repro."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * self.w - y).sum()


def test_the_same_tensor_for_two_arguments_under_dp(tmp_path):
    t = torch.ones(3)
    pm = parallelize(Sub(), {"x": t, "y": t}, "dp", ONE, gen_savedir=tmp_path)
    x, y = torch.ones(3), torch.zeros(3)
    loss = pm(x, y)
    assert float(loss.detach()) == 6.0 == float(Sub()(x, y).detach())
    loss.backward()
    assert pm.w.grad.tolist() == [1.0, 1.0, 1.0]
    assert float(pm(torch.ones(3), torch.full((3,), 2.0)).detach()) == 0.0


class Pairs(nn.Module):
    """Arguments that are read differently, at the top level and inside containers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.linspace(0.5, 2.0, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor, batch: dict, pair: list) -> torch.Tensor:
        d = self.fc(x) * self.w - y
        a = (d * d).mean()
        b = (self.fc(batch["a"]) * batch["b"]).mean()
        return a + b - (pair[0] * self.w).mean() + 3 * (pair[1] * self.w).mean()


def batches(step: int, unit: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + unit)

    def r() -> torch.Tensor:
        return torch.randn(4, 4, generator=g)

    return {"x": r(), "y": r(), "batch": {"a": r(), "b": r()}, "pair": [r(), r()]}


def aliased_dummy() -> dict:
    t = torch.randn(4, 4)
    return {"x": t, "y": t, "batch": {"a": t, "b": t}, "pair": [t, t[:]]}


def test_aliased_arguments_in_containers_under_dp(tmp_path):
    torch.manual_seed(0)
    model = Pairs()
    pm = parallelize(model, aliased_dummy(), "dp", ONE, gen_savedir=tmp_path)
    args = batches(0, 0)
    torch.testing.assert_close(pm(**args), model(**args), rtol=1e-6, atol=1e-6)


def _train(rank: int, world: int, policy: str, plan: int, gen_savedir: str) -> int:
    units, steps = world // plan, 2
    data = [[[batches(s, u)] for u in range(units)] for s in range(steps)]
    torch.manual_seed(0)
    ref_losses, ref_state = reference_train(Pairs(), data, lambda m, b: m(**b))
    torch.manual_seed(0)
    pm = parallelize(Pairs(), aliased_dummy(), policy,
                     ComputeConfig(plan_ngpus=plan, runtime_ngpus=world), gen_savedir=gen_savedir)
    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    unit = rank // plan
    for s in range(steps):
        loss = pm(**data[s][unit][0])
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(float(loss.detach()), ref_losses[s][unit][0], rtol=1e-5,
                                   atol=1e-6)
    return check_pieces(pm, ref_state)


@pytest.mark.parametrize(("policy", "plan"), [("dp", 1), ("tp", 2)])
def test_aliased_arguments_train_as_one_device_on_two_processes(policy, plan, tmp_path):
    checked = run_distributed(_train, 2, policy, plan, str(tmp_path), timeout=120)
    assert all(c > 0 for c in checked)


def test_files_for_aliased_dummies_are_the_files_for_distinct_ones(tmp_path):
    distinct = batches(9, 0)
    torch.manual_seed(0)
    parallelize(Pairs(), aliased_dummy(), "dp", ONE, gen_savedir=tmp_path / "a",
                load_module=False)
    parallelize(Pairs(), distinct, "dp", ONE, gen_savedir=tmp_path / "d", load_module=False)
    code = {d: sorted(p.relative_to(tmp_path / d) for p in (tmp_path / d).rglob("gencode*.py"))
            for d in ("a", "d")}
    assert code["a"] == code["d"] and code["a"]
    for rel in code["a"]:
        assert (tmp_path / "a" / rel).read_text() == (tmp_path / "d" / rel).read_text()
    # and a directory generated from aliased dummies is reused (MATCH) for distinct ones,
    # computing what the model computes
    torch.manual_seed(0)
    model = Pairs()
    pm = parallelize(model, distinct, "dp", ONE, gen_savedir=tmp_path / "a")
    torch.testing.assert_close(pm(**distinct), model(**distinct), rtol=1e-6, atol=1e-6)
