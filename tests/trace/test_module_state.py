"""Tracing leaves the user's module as it was: a training-mode forward on real values
moves BatchNorm's running statistics and ``num_batches_tracked``; the tracer puts them back
(and the random generators), so the initial weights a plan saves are the user's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnscaler import ComputeConfig, gendir, parallelize
from nnscaler.parallel import paths
from nnscaler.trace import trace

pytestmark = pytest.mark.filterwarnings("ignore::nnscaler.trace.OpaqueOpWarning")


class BasicBlock(nn.Module):
    """A resnet basic block with a downsampling shortcut, as in torchvision's resnet18."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.down(x))


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = BasicBlock(8, 16, 2)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, 5)

    def forward(self, x, y):
        h = self.block(self.stem(x)).mean(dim=(2, 3))
        return F.cross_entropy(self.head(self.drop(h)), y)


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(4, 3, 8, 8, generator=g), "y": torch.randint(0, 5, (4,), generator=g)}


def test_trace_restores_buffers_and_random_state():
    torch.manual_seed(0)
    model = TinyResNet()
    before = state_of(model)
    rng = torch.get_rng_state()
    graph = trace(model, batch(0))
    after = state_of(model)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert int(after["block.bn1.num_batches_tracked"]) == 0
    assert torch.equal(torch.get_rng_state(), rng)
    # the graph still records the updates (num_batches_tracked += 1 per BatchNorm; the
    # running statistics are written by batch_norm itself), so the generated code makes them
    assert sum(bool(op.mutations) for op in graph.ops) == 4


def test_parallelize_saves_the_users_weights_and_trains_like_eager(tmp_path):
    torch.manual_seed(0)
    model = TinyResNet()
    reference = copy.deepcopy(model)
    before = state_of(model)
    pm = parallelize(model, batch(0), "dp", ComputeConfig(plan_ngpus=1, runtime_ngpus=1),
                     gen_savedir=tmp_path)
    for name, value in state_of(model).items():  # the user's object is untouched
        assert torch.equal(value, before[name]), name
    saved = torch.load(paths.outdir_for(tmp_path, TinyResNet, None) / gendir.FULLMODEL,
                       weights_only=True)
    assert saved.keys() == before.keys()
    for name, value in before.items():  # and so are the initial weights the plan saved
        assert torch.equal(saved[name], value), name
    for m in (pm, reference):
        m.train()
    opt_p = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    opt_r = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        data = batch(step + 1)
        torch.manual_seed(100 + step)  # the same dropout mask on both sides
        loss_r = reference(**data)
        torch.manual_seed(100 + step)
        loss_p = pm(**data)
        torch.testing.assert_close(loss_p, loss_r, rtol=1e-5, atol=1e-6)
        for opt, loss in ((opt_r, loss_r), (opt_p, loss_p)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    mine = {meta.orig_name: getattr(pm, attr) for attr, meta in pm.fullmap.items()}
    theirs = reference.state_dict()
    buffers = [name for name, _ in reference.named_buffers()]
    assert len(buffers) == 12  # 4 BatchNorms x (running_mean, running_var, num_batches_tracked)
    for name in buffers:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)
    assert int(mine["block.bn1.num_batches_tracked"]) == 3


class WritesParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        with torch.no_grad():
            self.w.mul_(0.5)  # e.g. a weight constraint applied in forward
        return (x * self.w).sum()


def test_parameters_written_in_forward_are_restored():
    model = WritesParameter()
    graph = trace(model, {"x": torch.ones(3)})
    assert torch.equal(model.w.detach(), torch.ones(3))
    assert any(op.mutations for op in graph.ops)


class ReplacesBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count = self.count + 1  # an assignment, not an in-place update
        return x * 2


def test_buffers_replaced_by_assignment_are_put_back():
    model = ReplacesBuffer()
    original = model.count
    trace(model, {"x": torch.ones(3)})
    assert model.count is original and float(model.count) == 0.0


class WritesThroughData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))
        self.register_buffer("b", torch.zeros(2))

    def forward(self, x):
        self.w.data.fill_(3.0)  # through an alias whose version counter is its own
        self.b.data.add_(1.0)
        return x * self.w + self.b


def test_writes_through_data_are_restored():
    model = WritesThroughData()
    trace(model, {"x": torch.ones(2)})
    assert torch.equal(model.w.detach(), torch.ones(2))
    assert torch.equal(model.b, torch.zeros(2))
