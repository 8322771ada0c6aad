"""ZeRO stage 3 on one process: the gathering units, how many are gathered at a time, and
the unit names a user gives (the parity runs are in tests/parallel/test_zero_parity.py)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from nnscaler import ComputeConfig, ComputeConfigError, build_optimizer, parallelize
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.runtime import zero3
from nnscaler.runtime.zero3 import check_units, gathered, unit_of

CONFIG = GPTConfig(vocab_size=32, n_layer=4, n_head=2, d_model=16, seq_len=8)


def test_units_are_layer_paths_or_the_named_modules():
    assert unit_of("gpt.blocks.3.attn.q_proj.weight") == "gpt.blocks.3"
    assert unit_of("model.layers.10.mlp.up.weight") == "model.layers.10"
    assert unit_of("gpt.wte.weight") == "" and unit_of("bias") == ""
    named = ("gpt.blocks", "gpt.blocks.1", "gpt.wte")
    assert unit_of("gpt.blocks.1.ln_1.weight", named) == "gpt.blocks.1"  # the longest
    assert unit_of("gpt.blocks.2.ln_1.weight", named) == "gpt.blocks"
    assert unit_of("gpt.ln_f.weight", named) == ""
    assert unit_of("gpt.wtex.weight", ("gpt.wte",)) == ""  # a path, not a string prefix


def test_a_unit_naming_no_module_names_the_closest():
    names = ["gpt.blocks.0.attn.q_proj.weight", "gpt.wte.weight"]
    check_units(["gpt.blocks.0.attn", "gpt"], names)
    with pytest.raises(ComputeConfigError,
                       match=r"names 'gpt.block.0', which is no module.*'gpt.blocks.0'"):
        check_units(["gpt.block.0"], names)
    with pytest.raises(ComputeConfigError, match="no module"):
        check_units(["gpt.wte.weight"], names)  # a parameter, not a module


def _parallel(tmp_path, **kw):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parallelize(GPTWithLoss(CONFIG), {"batch": make_batch(CONFIG, 2)}, "dp",
                           ComputeConfig(1, 1, zero_stage=3, **kw), gen_savedir=str(tmp_path),
                           instance_name="z3" + "-".join(kw.get("zero_units", ())))


def test_parallelize_refuses_a_unit_that_is_no_module(tmp_path):
    with pytest.raises(ComputeConfigError, match=r"'gpt.blok.1'.*closest.*'gpt.blocks.1'"):
        _parallel(tmp_path, zero_units=["gpt.blok.1"])


def test_the_generated_file_says_what_the_rank_holds(tmp_path):
    import inspect

    pm = _parallel(tmp_path)
    src = open(inspect.getfile(type(pm))).read()
    head = src.split('"""')[1]
    assert "ZeRO stage 3: this rank holds a shard of each parameter piece below" in head
    assert "    unit gpt.blocks.0, sharded over ranks [0]:\n" \
           "        gpt_blocks_0_ln_1_weight (16,): [0, 16) of 16\n" in head
    assert "        gpt_wte_weight (32, 16): [0, 512) of 512\n" in head
    # the forward gathers each unit before its first reader
    assert "        zero3.gather(self, 'gpt.blocks.0')\n" \
           "        zero3.prefetch(self, 'gpt.blocks.1')\n" in src


def test_few_units_hold_values_at_a_time(tmp_path, monkeypatch):
    """Forward and backward of a 4-block GPT: at most the block in use, the one
    prefetched and the rest unit hold values; afterwards none."""
    pm = _parallel(tmp_path)
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-3)
    buckets = [b for r in pm.reducers for b in r.buckets]
    assert sorted(b.unit for b in buckets) == ["", *(f"gpt.blocks.{i}" for i in range(4))]
    most, prefetched = [], []
    real = zero3.gather_unit

    def counting(reducer, bucket, async_op=False):
        if async_op and not bucket.gathered:
            prefetched.append(bucket.unit)
        real(reducer, bucket, async_op)
        most.append(sum(b.gathered for b in buckets))

    monkeypatch.setattr(zero3, "gather_unit", counting)
    for step in range(2):  # the second forward prefetches in the first one's order
        pm(make_batch(CONFIG, 2, seed=1)).backward()
        if step == 0:
            prefetched.clear()
        opt.step()
        opt.zero_grad()
        assert not any(b.gathered for b in buckets)
        assert all(b.param_buffer.untyped_storage().nbytes() == 0 for b in buckets)
    assert len(most) > 2 * len(buckets) and max(most) <= 3, most
    blocks = [f"gpt.blocks.{i}" for i in range(4)]
    # every block is prefetched in forward (the first by the rest unit's gather: the
    # generated code knows the order), every block but the last in backward
    assert sorted(prefetched) == sorted(blocks + blocks[:-1]), prefetched
    with gathered(pm):
        assert all(p.untyped_storage().nbytes() > 0 for p in pm.parameters())
    assert pm.state_dict()["gpt_wte_weight"].abs().sum() > 0  # saved values, not freed


@pytest.mark.parametrize("stage", [1, 3])
def test_an_optimizer_needing_whole_tensors_is_refused(tmp_path, stage):
    from nnscaler.parallel.optimizer import OptimizerError

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(GPTWithLoss(CONFIG), {"batch": make_batch(CONFIG, 2)}, "dp",
                         ComputeConfig(1, 1, zero_stage=stage), gen_savedir=str(tmp_path))
    with pytest.raises(OptimizerError, match=rf"Adafactor needs whole tensors.*ZeRO stage "
                                             rf"{stage}.*elementwise optimizer"):
        build_optimizer(pm, torch.optim.Adafactor)
    build_optimizer(pm, torch.optim.SGD, lr=0.1)  # elementwise: fine


def test_kept_gathered_gathers_each_unit_once_and_trains_the_same(tmp_path, monkeypatch):
    """Two micro-batches inside `kept_gathered`: one gather per unit (instead of one per
    forward and backward), every unit freed on the way out and by the optimizer's step,
    and the same losses and weights as without it (bitwise, one process)."""
    from nnscaler.runtime.zero3 import kept_gathered

    batches = [make_batch(CONFIG, 2, seed=s) for s in (1, 2)]
    runs = []
    real = zero3.gather_unit
    for keep in (False, True):
        pm = _parallel(tmp_path)
        opt = build_optimizer(pm, torch.optim.Adam, lr=1e-3)
        buckets = [b for r in pm.reducers for b in r.buckets]
        gathers = []

        def counting(reducer, bucket, async_op=False, gathers=gathers):
            gathers.append(not bucket.gathered)
            real(reducer, bucket, async_op)

        monkeypatch.setattr(zero3, "gather_unit", counting)
        losses = []
        for _ in range(2):
            gathers.clear()
            with kept_gathered(pm) if keep else contextlib.nullcontext():
                for batch in batches:
                    loss = pm(batch)
                    loss.backward()
                    losses.append(loss.item())
                if keep:
                    assert all(b.gathered for b in buckets)
                    opt.step()  # a kept unit would be stale after the step: freed
                    assert not any(b.gathered for b in buckets)
            if not keep:
                opt.step()
            opt.zero_grad()
            assert not any(b.gathered for b in buckets)
            # without: each unit in each forward and each backward of the 2 micro-batches
            assert sum(gathers) == (len(buckets) if keep else 2 * 2 * len(buckets))
        with gathered(pm):
            weights = {n: p.detach().clone() for n, p in pm.named_parameters()}
        runs.append((losses, weights))
    assert runs[0][0] == runs[1][0]
    for name, w in runs[0][1].items():
        assert torch.equal(w, runs[1][1][name]), name


def test_the_generated_gathers_are_the_mechanism(tmp_path, monkeypatch):
    """Forward gathers nothing but what the generated zero3 calls gather: a statement that
    read a unit whose gather is skipped fails (its storage is empty) instead of reading
    stale values; a unit the rank does not hold is a ParallelModuleError."""
    from nnscaler.errors import ParallelModuleError

    pm = _parallel(tmp_path)
    batch = make_batch(CONFIG, 2, seed=1)
    real = zero3.Zero3Runner.enter

    def skipping(self, unit):
        if unit != "gpt.blocks.2":
            real(self, unit)

    monkeypatch.setattr(zero3.Zero3Runner, "enter", skipping)
    monkeypatch.setattr(zero3.Zero3Runner, "start", lambda self, unit: None)
    with pytest.raises(RuntimeError, match="storage|not allocated"):
        pm(batch)
    monkeypatch.undo()
    pm(batch).backward()  # as generated: fine
    with pytest.raises(ParallelModuleError, match=r"unit 'gpt.blocks.9', which this rank's "
                                                  r"reducers do not hold"):
        zero3.gather(pm, "gpt.blocks.9")
