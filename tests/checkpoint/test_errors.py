"""Interrupted saves leave the previous checkpoint intact; loading a state dict of another
model or plan fails naming the first mismatching key and both shapes; files are read with
``weights_only=True``."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import signal

import pytest
import torch
from dist_utils import run_distributed

import nnscaler
from nnscaler import checkpoint as ck
from nnscaler.checkpoint import files as ck_files

from .common import ADAM, V, make_batch, parallelize_net, run_parallel, steps_data


# -- atomic saves ----------------------------------------------------------------------
def _killed_save(path: str) -> None:
    """A save that the OS kills half way through writing (SIGKILL: no cleanup runs)."""
    real_save = torch.save

    def half_then_die(obj, f):
        buf = io.BytesIO()
        real_save(obj, buf)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    ck_files.torch.save = half_then_die  # type: ignore[attr-defined]
    ck.save({"step": 2, "w": torch.ones(1000)}, path)


def test_a_killed_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "ckpt.pt"
    ck.save({"step": 1, "w": torch.zeros(1000)}, path)
    child = mp.get_context("fork").Process(target=_killed_save, args=(str(path),))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert leftovers and all(n.startswith(".ckpt.pt.") for n in leftovers)  # the partial file
    state = ck.load(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.zeros(1000))
    # the next save succeeds over it and removes the killed save's temporary file
    ck.save({"step": 3, "w": torch.ones(2)}, path)
    assert ck.load(path)["step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def _slow_save(path: str, started, release) -> None:
    """A save that stops half way until ``release`` is set (a live writer)."""
    real_save = torch.save

    def half_then_wait(obj, f):
        buf = io.BytesIO()
        real_save(obj, buf)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        started.set()
        release.wait(60)
        f.write(data[len(data) // 2:])

    ck_files.torch.save = half_then_wait  # type: ignore[attr-defined]
    ck.save({"step": 5, "w": torch.ones(1000)}, path)


def test_cleaning_never_touches_a_live_writers_temporary_file(tmp_path):
    """clean_stale removes temporary files and directories of dead processes only: a
    save in progress (its lock held, its process alive) keeps its file and completes."""
    ctx = mp.get_context("fork")
    started, release = ctx.Event(), ctx.Event()
    path = tmp_path / "ckpt.pt"
    child = ctx.Process(target=_slow_save, args=(str(path), started, release))
    child.start()
    try:
        assert started.wait(60)
        (live,) = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.pt.")]
        dead = tmp_path / ".ckpt.pt.999999999-0123abcd.tmp"  # no such process
        dead.write_bytes(b"partial")
        stale_dir = tmp_path / ".ckpt-10.tmp-999999999-0123abcd"
        stale_dir.mkdir()
        (stale_dir / "rank0.pt").write_bytes(b"partial")
        assert sorted(ck_files.clean_stale(tmp_path)) == sorted([dead, stale_dir])
        assert live.exists()  # the writer is alive and holds its lock
    finally:
        release.set()
        child.join(60)
    assert child.exitcode == 0
    assert ck.load(path)["step"] == 5
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_temporary_dir_appears_complete_or_not_at_all(tmp_path):
    target = tmp_path / "ckpt-0001"
    with pytest.raises(RuntimeError, match="boom"), ck_files.temporary_dir(target) as tmp:
        ck.save({"step": 1}, tmp / "rank0.pt")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with ck_files.temporary_dir(target) as tmp:
        ck.save({"step": 1}, tmp / "rank0.pt")
        assert not target.exists()
        assert ck_files.clean_stale(tmp_path) == []  # ours, in use
    assert sorted(p.name for p in target.iterdir()) == ["rank0.pt"]
    with ck_files.temporary_dir(target) as tmp:
        ck.save({"step": 2}, tmp / "rank0.pt")
    assert ck.load(target / "rank0.pt") == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-0001"]
    with pytest.raises(ck.CheckpointError, match="already exists"), \
            ck_files.temporary_dir(target, replace=False):
        pass


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    ck.save({"step": 1}, path)
    with pytest.raises(Exception):  # noqa: B017 - torch.save's own error for a lambda
        ck.save({"step": 2, "bad": lambda: None}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    assert ck.load(path) == {"step": 1}


def test_save_needs_an_existing_directory(tmp_path):
    with pytest.raises(ck.CheckpointError, match="does not exist; create it first"):
        ck.save({}, tmp_path / "missing" / "x.pt")


class Custom:
    pass


def test_load_is_weights_only(tmp_path):
    torch.save({"obj": Custom()}, tmp_path / "custom.pt")
    with pytest.raises(ck.CheckpointError, match="weights_only=True"):
        ck.load(tmp_path / "custom.pt")


# -- mismatched loads --------------------------------------------------------------------
def _tp_dicts(rank, world, directory):
    pm = parallelize_net("tp", 2, 2, directory)
    opt = nnscaler.build_optimizer(pm, torch.optim.Adam, **ADAM)
    ck.track_optimizer(opt)
    run_parallel(pm, opt, steps_data(0, 1, 1), rank)
    sd, osd = pm.state_dict(), opt.state_dict()
    # every rank loads the other rank's state dict: the same shapes, other slices
    others = [None, None]
    torch.distributed.all_gather_object(others, (sd, osd))
    other_sd, other_osd = others[1 - rank]
    errors = []
    for load, arg in ((pm.load_state_dict, other_sd), (opt.load_state_dict, other_osd)):
        try:
            load(arg)
            errors.append(None)
        except ck.StateDictMismatchError as e:
            errors.append(str(e))
    return sd, osd, errors


@pytest.fixture(scope="module")
def tp_dicts(tmp_path_factory):
    return run_distributed(_tp_dicts, 2, str(tmp_path_factory.mktemp("tp")))


def test_another_ranks_state_dict_names_the_first_mismatching_key(tp_dicts):
    module_error, opt_error = tp_dicts[0][2]
    assert "the first mismatching key is 'emb_weight'" in module_error
    assert ("the state dict holds parameter emb.weight[0:16, 4:8] of (16, 8) (shape (16, 4)), "
            "this module holds parameter emb.weight[0:16, 0:4] of (16, 8) (shape (16, 4))"
            in module_error)
    assert "merge_state_dicts" in module_error
    assert "the first mismatching entry is 0" in opt_error
    assert "emb.weight[0:16,4:8]" in opt_error and "(shape (16, 4))" in opt_error


@pytest.fixture
def dp_module(tmp_path):
    pm = parallelize_net("dp", 1, 1, str(tmp_path))
    opt = nnscaler.build_optimizer(pm, torch.optim.Adam, **ADAM)
    run_parallel(pm, opt, steps_data(0, 1, 1), rank=0)
    return pm, opt


def test_a_state_dict_of_another_plan_names_the_first_mismatching_key(tp_dicts, dp_module):
    pm, opt = dp_module
    tp_rank0 = tp_dicts[0][0]
    with pytest.raises(ck.StateDictMismatchError,
                       match=r"the first mismatching key is 'emb_weight': the state dict holds "
                       r"parameter emb\.weight\[0:16, 0:4\] of \(16, 8\) \(shape \(16, 4\)\), "
                       r"this module holds parameter emb\.weight\[0:16, 0:8\] of \(16, 8\) "
                       r"\(shape \(16, 8\)\)"):
        pm.load_state_dict(tp_rank0)
    with pytest.raises(ck.CheckpointError, match="merge the ranks' state dicts"):
        ck.load_merged_state_dicts(pm, tp_rank0)


def test_a_merged_state_dict_of_another_model_names_the_first_mismatching_key(dp_module):
    pm, opt = dp_module
    merged, merged_opt = ck.merge_state_dicts([pm.state_dict()], [opt.state_dict()])
    wider = dict(merged)
    wider["fc1.weight"] = torch.zeros(24, 8)
    with pytest.raises(ck.StateDictMismatchError,
                       match=r"the first mismatching key is 'fc1\.weight': shape \(24, 8\) in "
                       r"the state dict, shape \(12, 8\) in the module"):
        ck.load_merged_state_dicts(pm, wider)
    missing = {k: v for k, v in merged.items() if k != "fc2.bias"}
    with pytest.raises(ck.StateDictMismatchError,
                       match=r"'fc2\.bias': absent in the state dict, shape \(8,\)"):
        ck.load_merged_state_dicts(pm, missing)
    extra = {**merged, "decoder.weight": torch.zeros(2, 2)}
    with pytest.raises(ck.StateDictMismatchError,
                       match=r"'decoder\.weight': shape \(2, 2\) in the state dict, absent"):
        ck.load_merged_state_dicts(pm, extra)
    bad_opt = {**merged_opt, "state": dict(merged_opt["state"])}
    bad_opt["state"][1] = {**bad_opt["state"][1], "exp_avg": torch.zeros(V, 3)}
    before = {k: v.clone() for k, v in pm.state_dict().items() if isinstance(v, torch.Tensor)}
    changed = {k: v + 1 for k, v in merged.items()}
    with pytest.raises(ck.OptimizerStateError, match=r"'exp_avg' of emb\.weight"):
        ck.load_merged_state_dicts(pm, changed, opt, bad_opt)
    # a failed load changes nothing
    for k, v in pm.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, before[k]), k
    assert torch.isfinite(pm(make_batch(0)))


def test_a_deduped_state_dict_needs_load_deduped(dp_module):
    pm, opt = dp_module
    sd, _ = ck.deduped_state_dict(pm, opt)
    with pytest.raises(ck.CheckpointError, match="load_deduped_state_dict"):
        pm.load_state_dict(sd)
