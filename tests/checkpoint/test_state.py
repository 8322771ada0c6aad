"""What a checkpoint carries besides the parameters the graph reads: tied parameters,
parameters and buffers no op reads, non-persistent buffers and captured constants
survive save, merge and load (one process, the ``dp`` plan)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nnscaler
from nnscaler import checkpoint as ck

from .common import ADAM, make_batch, make_model, parallelize_net, run_parallel, steps_data


@pytest.fixture
def trained(tmp_path):
    """A one-process parallel module trained 2 steps, with its optimizer."""
    pm = parallelize_net("dp", 1, 1, str(tmp_path))
    opt = nnscaler.build_optimizer(pm, torch.optim.Adam, **ADAM)
    run_parallel(pm, opt, steps_data(0, 2, 1), rank=0)
    return pm, opt, str(tmp_path)


def test_per_rank_state_dict_carries_the_metadata(trained):
    pm, _, _ = trained
    sd = pm.state_dict()
    extra = sd["_extra_state"]
    assert extra["nnscaler_checkpoint"] == 1
    assert (extra["rank"], extra["plan_ngpus"], extra["runtime_ngpus"]) == (0, 1, 1)
    emb = next(r for r in extra["attrs"] if r["attr"] == "emb_weight")
    assert emb["names"] == ["emb.weight", "head.weight"]
    assert (emb["shape"], emb["index"], emb["value"]) == ([16, 8], [[0, 16], [0, 8]], [0, 1])
    assert set(extra["nonpersistent"]) == {"scale"}
    assert set(extra["unheld"]) == {"unused", "unused_buf"}
    held = {e["names"][0]: e["held"] for e in extra["manifest"]}
    assert held["unused"] is False and held["unused_buf"] is False and held["fc1.weight"]
    assert [d["kind"] for d in extra["optimizer"]] == ["param"] * 5
    assert "scale" not in sd  # non-persistent: not a state dict entry of its own


def test_per_rank_round_trip_into_a_module_built_without_weights(trained, tmp_path):
    pm, _, gen = trained
    ck.save(pm.state_dict(), tmp_path / "rank0.pt")
    empty = parallelize_net("dp", 1, 1, gen, init_params=False)
    with torch.no_grad():
        for t in [*empty.parameters(), *empty.buffers()]:
            t.fill_(7.0)
    empty.load_state_dict(ck.load(tmp_path / "rank0.pt"))
    for (name, a), (_, b) in zip(pm.named_buffers(), empty.named_buffers()):
        assert torch.equal(a, b), name  # the non-persistent 'scale' too
    for (name, a), (_, b) in zip(pm.named_parameters(), empty.named_parameters()):
        assert torch.equal(a, b), name
    batch = make_batch(7)
    assert torch.equal(empty(batch), pm(batch))


def test_merged_state_has_tied_and_unused_entries_and_no_non_persistent(trained):
    pm, _, _ = trained
    merged, _ = ck.merge_state_dicts([pm.state_dict()])
    model = make_model(seed=3)
    assert set(merged) == set(model.state_dict())  # 'scale' is not in it, like torch
    assert merged["head.weight"] is merged["emb.weight"]
    model.load_state_dict(merged)  # strict
    original = make_model()
    assert torch.equal(merged["unused"], original.unused)
    assert torch.equal(merged["unused_buf"], original.unused_buf)
    assert torch.equal(model.head.weight, pm.emb_weight)


def test_unused_values_loaded_from_a_merged_dict_survive_the_next_save(trained, tmp_path):
    pm, opt, gen = trained
    merged, merged_opt = ck.merge_state_dicts([pm.state_dict()], [opt.state_dict()])
    merged["unused"] = torch.full((3, 4), 5.0)
    merged["unused_buf"] = torch.tensor([1.0, 2.0])
    other = parallelize_net("dp", 1, 1, gen)
    other_opt = nnscaler.build_optimizer(other, torch.optim.Adam, **ADAM)
    ck.load_merged_state_dicts(other, merged, other_opt, merged_opt)
    ck.save(other.state_dict(), tmp_path / "r0.pt")
    again, _ = ck.merge_state_dicts([ck.load(tmp_path / "r0.pt")])
    assert torch.equal(again["unused"], torch.full((3, 4), 5.0))
    assert torch.equal(again["unused_buf"], torch.tensor([1.0, 2.0]))
    # and a per-rank reload into a module without weights keeps them as well
    empty = parallelize_net("dp", 1, 1, gen, init_params=False)
    empty.load_state_dict(ck.load(tmp_path / "r0.pt"))
    third, _ = ck.merge_state_dicts([empty.state_dict()])
    assert torch.equal(third["unused"], torch.full((3, 4), 5.0))


def test_the_single_device_state_dict_loads_into_a_parallel_module(trained):
    """A full state dict need not come from merge_state_dicts: the original module's own
    (and its optimizer's, over all parameters in order) loads too."""
    _, _, gen = trained
    model = make_model(seed=5)
    opt = torch.optim.Adam(model.parameters(), **ADAM)
    for batch in (make_batch(1), make_batch(2)):
        opt.zero_grad()
        model(batch).backward()
        opt.step()
    pm = parallelize_net("dp", 1, 1, gen)
    pm_opt = nnscaler.build_optimizer(pm, torch.optim.Adam, **ADAM)
    ck.load_merged_state_dicts(pm, model.state_dict(), pm_opt, opt.state_dict())
    batch = make_batch(3)
    torch.testing.assert_close(pm(batch), model(batch))
    merged, merged_opt = ck.merge_state_dicts([pm.state_dict()], [pm_opt.state_dict()])
    for i, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(merged_opt["state"][i][key], value)


class Counted(nn.Module):
    """A captured constant, and a non-persistent buffer that forward updates."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()), persistent=False)
        self.table = torch.arange(4.0)  # captured: a constant of the generated code

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.steps.add_(1)
        return (self.lin(x) + self.table).sum()


def test_constants_and_updated_non_persistent_buffers_survive_a_per_rank_reload(tmp_path):
    from nnscaler import ComputeConfig, parallelize

    torch.manual_seed(0)
    x = torch.randn(2, 4)
    one = ComputeConfig(plan_ngpus=1, runtime_ngpus=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(Counted(), {"x": x}, "dp", one, gen_savedir=tmp_path)
        pm(x)
        pm(x)
        empty = parallelize(Counted(), {"x": x}, "dp", one, gen_savedir=tmp_path,
                            init_module_params=False)
    kinds = {m.kind for m in pm.fullmap.values()}
    assert kinds == {"parameter", "buffer", "constant"}
    with torch.no_grad():
        for t in [*empty.parameters(), *empty.buffers()]:
            t.fill_(7.0)
    ck.save(pm.state_dict(), tmp_path / "r0.pt")
    empty.load_state_dict(ck.load(tmp_path / "r0.pt"))
    assert pm.steps.item() == empty.steps.item() >= 2.0  # (the trace ran forward too)
    assert torch.equal(empty(x), pm(x))
    merged, _ = ck.merge_state_dicts([pm.state_dict()])
    assert set(merged) == {"lin.weight", "lin.bias"}  # as Counted().state_dict()
