"""``torch.autocast`` inside forward is honoured: the tracer records each op's autocast, the
interpreter and the generated code run the op under it, so every op computes in the dtype
eager did (before, the region was dropped and the parallel loss equalled the fp32 one)."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

from nnscaler import ComputeConfig, parallelize
from nnscaler.ir import run_graph
from nnscaler.trace import trace

pytestmark = pytest.mark.filterwarnings("ignore::nnscaler.trace.OpaqueOpWarning")

BF16 = (("cpu", torch.bfloat16),)


class Mixed(nn.Module):
    """bf16 autocast around two linears, one op forced back to fp32 inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.fc1(x))
            with torch.autocast("cpu", enabled=False):
                h = h.float() * 1.5
            h = self.fc2(h)
        out = self.head(h.float())
        return nn.functional.mse_loss(out, y)


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(8, 16, generator=g), "y": torch.randn(8, 4, generator=g)}


def test_each_op_records_its_autocast_and_the_graph_replays_eager_bitwise():
    torch.manual_seed(0)
    model = Mixed()
    data = batch(0)
    graph = trace(model, data)
    by_name = [(op.name.rsplit(".", 1)[-1], op.autocast) for op in graph.ops]
    assert by_name[0] == ("linear", BF16) and by_name[1] == ("relu", BF16)
    assert ("mul", ()) in by_name  # the enabled=False region
    assert [a for n, a in by_name if n == "linear"] == [BF16, BF16, ()]
    linear = next(op for op in graph.ops if op.name.endswith("linear"))
    assert linear.outputs[0].full.dtype == torch.bfloat16
    assert torch.equal(run_graph(graph, model, data), model(**data))


def test_generated_code_runs_under_the_traced_autocast(tmp_path):
    torch.manual_seed(0)
    model = Mixed()
    reference = copy.deepcopy(model)
    pm = parallelize(model, batch(0), "dp", ComputeConfig(plan_ngpus=1, runtime_ngpus=1),
                     gen_savedir=tmp_path)
    source = next(tmp_path.rglob("gencode0.py")).read_text()
    assert source.count("with torch.autocast('cpu', dtype=torch.bfloat16):") == 2
    data = batch(1)
    loss = pm(**data)
    assert torch.equal(loss, reference(**data))  # bitwise: the same kernels in the same dtypes
    plain = nn.functional.mse_loss(
        reference.head(reference.fc2(torch.relu(reference.fc1(data["x"])) * 1.5)), data["y"])
    assert not torch.equal(loss, plain)  # autocast changes the result: it was not dropped


def _worker(rank, world, gen_savedir, steps):
    torch.manual_seed(0)
    model = Mixed()
    pm = parallelize(model, batch(0), "dp", ComputeConfig(plan_ngpus=1, runtime_ngpus=2),
                     gen_savedir=gen_savedir)
    from nnscaler import build_optimizer

    opt = build_optimizer(pm, torch.optim.SGD, lr=0.05)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = pm(**batch(100 * step + rank))
        loss.backward()
        opt.step()
        losses.append(float(loss))
    weights = {meta.orig_name: getattr(pm, attr).detach().clone()
               for attr, meta in pm.fullmap.items()}
    return losses, weights


def test_data_parallel_autocast_equals_one_device(tmp_path):
    steps = 3
    results = run_distributed(_worker, 2, str(tmp_path), steps)
    torch.manual_seed(0)
    model = Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        for rank in range(2):
            loss = model(**batch(100 * step + rank))  # gradients summed over the units
            loss.backward()
            assert results[rank][0][step] == float(loss)  # same kernels, same dtypes
        opt.step()
    for _, weights in results:
        for name, value in model.state_dict().items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _split_worker(rank, world, gen_savedir, policy):
    from nnscaler import ComputeConfig, parallelize

    torch.manual_seed(0)
    pm = parallelize(Mixed(), batch(0), policy, ComputeConfig(plan_ngpus=2, runtime_ngpus=2),
                     gen_savedir=gen_savedir)
    loss = pm(**batch(1))
    loss.backward()
    return float(loss)


@pytest.mark.parametrize("policy", ["tp", "data"])
def test_split_plans_run_under_autocast(tmp_path, policy):
    torch.manual_seed(0)
    want = float(Mixed()(**batch(1)))
    for got in run_distributed(_split_worker, 2, str(tmp_path), policy):
        # bf16 rounding: a split plan may add partial sums in another order
        assert got == pytest.approx(want, rel=4e-3)


def test_recomputed_autocast_region(tmp_path):
    """A recompute group inside an autocast region recomputes in the same dtypes."""
    from nnscaler.plugins import get_plugin_manager

    dp = get_plugin_manager().policies.get("dp")

    def dp_recompute(graph, cfg):
        graph = dp(graph, cfg)
        graph.recompute(["fc1", "fc2"])
        return graph

    torch.manual_seed(0)
    model = Mixed()
    reference = copy.deepcopy(model)
    pm = parallelize(model, batch(0), dp_recompute, ComputeConfig(plan_ngpus=1, runtime_ngpus=1),
                     gen_savedir=tmp_path)
    source = next(tmp_path.rglob("gencode0.py")).read_text()
    assert "torch.utils.checkpoint.checkpoint(" in source and "torch.autocast(" in source
    data = batch(1)
    loss, want = pm(**data), reference(**data)
    assert torch.equal(loss, want)
    loss.backward()
    want.backward()
    for name, p in reference.named_parameters():
        got = next(getattr(pm, a).grad for a, m in pm.fullmap.items() if m.orig_name == name)
        assert torch.equal(got, p.grad), name
