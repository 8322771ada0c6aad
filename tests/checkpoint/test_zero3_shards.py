"""ZeRO stage-3 checkpoints hold shards: each rank writes its fp32 shard of every
gathering unit (nothing is gathered while saving, nor while loading into stage 3, nor
while exporting a live module), the files are ~1/N of stage 0's, and every reader takes
them: per-rank ``load_state_dict``, ``merge_state_dicts`` (bitwise what the gathered
state dict and stage 0 merge to), ``load_resharded`` into stages 0 to 3, a pipeline and
another number of processes, and back, ``load_merged_state_dicts``, deduped checkpoints,
``zero_ngroups=2``, the Hub export, stage 1 and 2 files into stage 3; a bf16 model keeps
its fp32 master shards."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

import nnscaler
from nnscaler import ComputeConfig, build_optimizer, parallelize
from nnscaler import checkpoint as ck
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.runtime import zero3, zero3_state

CONFIG = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=8)
ADAM = {"lr": 1e-3, "eps": 1e-4}


def _gpt(world: int, stage: int, gen: str, name: str, ngroups: int = 1,
         init: bool = True, policy: str = "dp") -> nnscaler.ParallelModule:
    torch.manual_seed(0)
    plan = 2 if policy == "pp" else 1
    cfg = ComputeConfig(plan, world, zero_stage=stage, zero_ngroups=ngroups, use_end2end=True,
                        pas_config={"pipeline_nmicros": 1} if policy == "pp" else {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parallelize(GPTWithLoss(CONFIG), {"batch": make_batch(CONFIG, 2)}, policy, cfg,
                           gen_savedir=gen, instance_name=name, init_module_params=init)


def _train(pm: nnscaler.ParallelModule, opt: torch.optim.Optimizer, rank: int,
           steps: int = 2) -> None:
    for step in range(steps):
        pm.train_step([make_batch(CONFIG, 2, seed=100 * step + rank)])
        opt.step()
        opt.zero_grad()


def _loss(pm: nnscaler.ParallelModule) -> torch.Tensor:
    with torch.no_grad():
        return pm(make_batch(CONFIG, 2, seed=7)).detach()


class _GatherSpy:
    """Counts the units gathered while it is on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = zero3.gather_unit

        def spy(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(zero3, "gather_unit", spy)


def _save(pm, opt, rank: int, out: str, tag: str) -> dict:
    """Save this rank's files under a spy on ``gather_unit``; what the test checks."""
    gathered_before = sum(b.gathered for r in pm.reducers for b in r.buckets)
    with pytest.MonkeyPatch.context() as mp:
        spy = _GatherSpy(mp)
        sd = ck.rank_state_dict(pm)
        ck.save(sd, os.path.join(out, f"{tag}-model{rank}.pt"))
        ck.save(opt.state_dict(), os.path.join(out, f"{tag}-opt{rank}.pt"))
    gathered_after = sum(b.gathered for r in pm.reducers for b in r.buckets)
    peak = [0]
    with pytest.MonkeyPatch.context() as mp:  # state_dict(): one unit gathered at a time
        real = zero3_state.gather_unit

        def gather(*args):
            real(*args)
            peak[0] = max(peak[0], sum(b.gathered for r in pm.reducers for b in r.buckets))

        mp.setattr(zero3_state, "gather_unit", gather)
        plain = pm.state_dict()
    return {"gathers": spy.count, "gathered": (gathered_before, gathered_after),
            "plain": plain, "peak": peak[0], "loss": _loss(pm), "keys": sorted(sd)}


def _files(out: str, tag: str, world: int) -> tuple[list[str], list[str]]:
    return ([os.path.join(out, f"{tag}-model{r}.pt") for r in range(world)],
            [os.path.join(out, f"{tag}-opt{r}.pt") for r in range(world)])


def _all_gather(pm, opt):
    pair = (ck.rank_state_dict(pm), opt.state_dict())
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, pair)
    return out


def _merged_everywhere(pm, opt):
    """Every rank's state merged (what the whole plan holds now)."""
    return ck.merge_state_dicts(*[list(x) for x in zip(*_all_gather(pm, opt))])


def _forget(pm, opt) -> None:
    """Zero the tensors the optimizer steps and drop its state: what a load must restore."""
    with torch.no_grad():
        for t in pm.parameters_for_optimizer():
            t.zero_()
    opt.state.clear()


def _refusal(pm, sd) -> str:
    """The error of loading ``sd`` into ``pm``, which must leave ``pm`` as it was."""
    before = [t.clone() for t in pm.parameters_for_optimizer()]
    try:
        pm.load_state_dict(sd)
    except nnscaler.CheckpointError as e:
        assert all(torch.equal(a, b) for a, b in zip(before, pm.parameters_for_optimizer()))
        return str(e)
    return "loaded"


def _run(rank: int, world: int, gen: str, out: str) -> dict:
    """One launch: train stage 3, stage 0 and stage 3 with two ZeRO groups the same way
    and save them; then load the stage-3 files into stages 0 to 3 (load_resharded), the
    stage-0 files into stage 3, each rank's own stage-3 file (load_state_dict), and
    stage-3 deduped files (load_deduped_state_dict)."""
    got: dict = {}
    for stage, ngroups in ((3, 1), (0, 1), (3, 2)):
        tag = f"s{stage}g{ngroups}"
        pm = _gpt(world, stage, gen, tag, ngroups)
        opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
        _train(pm, opt, rank)
        got[tag] = _save(pm, opt, rank, out, tag)
        if tag == "s3g1":
            sd, osd = nnscaler.deduped_state_dict(pm, opt)
            ck.save(sd, os.path.join(out, f"dedup-model{rank}.pt"))
            ck.save(osd, os.path.join(out, f"dedup-opt{rank}.pt"))
            with pytest.MonkeyPatch.context() as mp:  # the live module's Hub export
                spy = _GatherSpy(mp)
                nnscaler.save_pretrained(pm, os.path.join(out, "live_export"))
            got["gathers_exporting"] = spy.count
    torch.distributed.barrier()
    files, opt_files = _files(out, "s3g1", world)
    for stage in (0, 1, 2, 3):
        pm = _gpt(world, stage, gen, f"into{stage}", init=False)
        opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
        with pytest.MonkeyPatch.context() as mp:
            spy = _GatherSpy(mp)
            nnscaler.load_resharded(pm, files, opt, opt_files)
        got[f"gathers_loading_into{stage}"] = spy.count
        got[f"into{stage}"] = _merged_everywhere(pm, opt)
        if stage == 0:
            got["refused"] = _refusal(pm, ck.load(files[rank]))
        if stage in (1, 2):  # their files, for stage 3 to load below
            ck.save(ck.rank_state_dict(pm), os.path.join(out, f"z{stage}-model{rank}.pt"))
            ck.save(opt.state_dict(), os.path.join(out, f"z{stage}-opt{rank}.pt"))
    torch.distributed.barrier()
    for stage in (1, 2):  # pm, opt: stage 3
        _forget(pm, opt)
        stage_files, stage_opt_files = _files(out, f"z{stage}", world)
        nnscaler.load_resharded(pm, stage_files, opt, stage_opt_files)
        got[f"from{stage}"] = _merged_everywhere(pm, opt)
    _forget(pm, opt)
    with pytest.MonkeyPatch.context() as mp:  # stage 3 again, from the merged state dicts
        spy = _GatherSpy(mp)
        nnscaler.load_merged_state_dicts(pm, got["into3"][0], opt, got["into3"][1])
    got["gathers_loading_merged"] = spy.count
    got["merged_into3"] = _merged_everywhere(pm, opt)
    pp = _gpt(world, 0, gen, "into_pp", init=False, policy="pp")  # two pipeline stages
    pp_opt = build_optimizer(pp, torch.optim.Adam, **ADAM)
    nnscaler.load_resharded(pp, files, pp_opt, opt_files)
    got["into_pp"] = _merged_everywhere(pp, pp_opt)
    # pm, opt: stage 3 now; load other files into it
    nnscaler.load_resharded(pm, _files(out, "s0g1", world)[0])
    got["from0"] = _loss(pm)
    got["other_rank"] = _refusal(pm, ck.load(files[1 - rank]))
    pm.load_state_dict(ck.load(files[rank]))
    opt.load_state_dict(ck.load(opt_files[rank]))
    got["own"] = _merged_everywhere(pm, opt)
    dedup, dedup_opt = _files(out, "dedup", world)
    _forget(pm, opt)
    nnscaler.load_deduped_state_dict(pm, ck.load(dedup[rank]), opt, ck.load(dedup_opt[rank]))
    got["dedup"] = _merged_everywhere(pm, opt)
    return got


def _assert_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _assert_opt_equal(a: dict, b: dict) -> None:
    assert a["param_groups"][0]["param_names"] == b["param_groups"][0]["param_names"]
    assert set(a["state"]) == set(b["state"])
    for i in a["state"]:
        for k, v in a["state"][i].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][i][k])), (i, k)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero3ck")
    gen, out = str(root / "gen"), str(root / "out")
    os.makedirs(out)
    got = run_distributed(_run, 2, gen, out)
    files, opt_files = _files(out, "s3g1", 2)
    merged = ck.merge_state_dicts([ck.load(f) for f in files], [ck.load(f) for f in opt_files])
    return {"gen": gen, "out": out, "got": got, "merged": merged}


def test_saving_gathers_nothing_and_files_are_a_shard(saved):
    for r in saved["got"]:
        assert r["s3g1"]["gathers"] == 0
        assert r["s3g1"]["gathered"] == (0, 0)  # no unit holds values before or after
        assert r["s3g1"]["peak"] == 1  # state_dict() copies the units out one at a time
        assert not any(k.startswith("gpt_blocks") for k in r["s3g1"]["keys"])  # in shards
        assert r["s0g1"]["gathers"] == 0 and any(k.startswith("gpt_blocks")
                                                 for k in r["s0g1"]["keys"])
    sizes = {s: [os.path.getsize(f) for f in _files(saved["out"], f"s{s}g1", 2)[0]]
             for s in (0, 3)}
    for b0, b3 in zip(sizes[0], sizes[3]):
        assert b3 < 0.6 * b0, sizes  # ~1/2 of the parameters' bytes, plus metadata


def test_merge_is_bitwise_the_gathered_state_dict_and_stage0s(saved):
    merged, merged_opt = saved["merged"]
    gathered, _ = ck.merge_state_dicts([r["s3g1"]["plain"] for r in saved["got"]])
    _assert_equal(merged, gathered)
    files0, opt_files0 = _files(saved["out"], "s0g1", 2)
    merged0, merged_opt0 = ck.merge_state_dicts([ck.load(f) for f in files0],
                                                [ck.load(f) for f in opt_files0])
    # the same run under stage 0: two replicas' gradients meet in one addition either
    # way, and Adam is elementwise in fp32, so the state agrees bitwise
    _assert_equal(merged, merged0)
    _assert_opt_equal(merged_opt, merged_opt0)
    plain = GPTWithLoss(CONFIG)
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(make_batch(CONFIG, 2, seed=7)),
                                   saved["got"][0]["s3g1"]["loss"], rtol=1e-5, atol=1e-6)


def test_every_stage_loads_them_and_stage3_loads_the_others(saved):
    merged, merged_opt = saved["merged"]
    for r in saved["got"]:
        for key in ("into0", "into1", "into2", "into3", "merged_into3", "into_pp", "own",
                    "dedup", "from1", "from2"):
            _assert_equal(r[key][0], merged)
            _assert_opt_equal(r[key][1], merged_opt)
        assert torch.equal(r["from0"], saved["got"][0]["s0g1"]["loss"])
        assert r["gathers_loading_into3"] == 0  # each piece written into the shard
        assert r["gathers_loading_merged"] == 0


def test_a_file_of_another_stage_or_rank_is_refused(saved):
    for r in saved["got"]:
        assert "not stage 3" in r["refused"] and "load_resharded" in r["refused"]
        assert "ZeRO-3 shard" in r["other_rank"] and "load_resharded" in r["other_rank"]


def test_zero_ngroups_2_and_incomplete_files(saved, tmp_path):
    # two ZeRO groups of one rank: each rank holds every shard, replicated
    files, opt_files = _files(saved["out"], "s3g2", 2)
    sd = ck.load(files[1])
    assert sd["_extra_state"]["zero3"][0]["zero_ngroups"] == 2
    merged, _ = ck.merge_state_dicts([ck.load(f) for f in files],
                                     [ck.load(f) for f in opt_files])
    one, _ = ck.merge_state_dicts([ck.load(files[1])], [ck.load(opt_files[1])])
    _assert_equal(merged, one)  # either group's files alone are the whole
    _assert_equal(merged, saved["merged"][0])
    files3, _ = _files(saved["out"], "s3g1", 2)
    with pytest.raises(nnscaler.CheckpointError, match=r"ZeRO-3 shards \[1\] of 2"):
        ck.merge_state_dicts([ck.load(files3[0])])
    with pytest.raises(nnscaler.CheckpointError, match="ZeRO-3 shards"):
        ck.save_pretrained(files3[:1], tmp_path / "partial")
    assert not (tmp_path / "partial").exists()


def _four(rank: int, world: int, gen: str, out: str) -> dict:
    files, opt_files = _files(out, "s3g1", 2)
    pm = _gpt(world, 3, gen, "four", init=False)
    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    nnscaler.load_resharded(pm, files, opt, opt_files)
    pair = _all_gather(pm, opt)
    ck.save(pair[rank][0], os.path.join(out, f"four{rank}.pt"))
    return ck.merge_state_dicts(*[list(x) for x in zip(*pair)])


@pytest.mark.skipif(os.environ.get("NNSCALER_SLOW_TESTS") != "1",
                    reason="4 processes: NNSCALER_SLOW_TESTS=1")
def test_reshard_two_to_four_processes(saved):
    got = run_distributed(_four, 4, saved["gen"], saved["out"])
    merged, merged_opt = saved["merged"]
    _assert_equal(got[0][0], merged)
    _assert_opt_equal(got[0][1], merged_opt)
    files, _ = _files(saved["out"], "s3g1", 2)
    sizes2 = [os.path.getsize(f) for f in files]
    sizes4 = [os.path.getsize(os.path.join(saved["out"], f"four{r}.pt")) for r in range(4)]
    assert max(sizes4) < 0.75 * min(sizes2)


def test_hub_export_from_stage3_files_and_module(saved, tmp_path):
    """``save_pretrained`` from the stage-3 files writes the merged weights; from the live
    stage-3 module the same, gathering no unit (rank 0 receives the shards' slices)."""
    files, _ = _files(saved["out"], "s3g1", 2)
    merged = saved["merged"][0]
    ck.save_pretrained(files, tmp_path / "hub")
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(tmp_path / "hub").glob("*.safetensors")):
        out.update(load_file(f))
    for k, v in out.items():
        assert torch.equal(v, merged[k]), k
    live = load_file(Path(saved["out"]) / "live_export" / "model.safetensors")
    assert set(live) == set(out)
    for k, v in out.items():
        assert torch.equal(live[k], v), k
    assert [r["gathers_exporting"] for r in saved["got"]] == [0, 0]
    assert set(out) <= set(merged) and len(out) >= len(merged) - 1  # the tied head once


def test_bf16_keeps_the_fp32_master_shards(tmp_path):
    """One process, a bf16 model: the file holds the fp32 master shard (a resume steps
    from it exactly), the merged state is the bf16 parameters, as gathered."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(GPTWithLoss(CONFIG).to(torch.bfloat16),
                         {"batch": make_batch(CONFIG, 2)}, "dp",
                         ComputeConfig(1, 1, zero_stage=3, use_end2end=True),
                         gen_savedir=str(tmp_path), instance_name="bf16")
    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    _train(pm, opt, 0, steps=1)
    sd = ck.rank_state_dict(pm)
    masters = [t.clone() for t in pm.parameters_for_optimizer()]
    assert all(r["shard"].dtype == torch.float32 for r in sd["_extra_state"]["zero3"])
    merged, _ = ck.merge_state_dicts([sd])
    gathered, _ = ck.merge_state_dicts([pm.state_dict()])
    _assert_equal(merged, gathered)
    assert merged["gpt.wte.weight"].dtype == torch.bfloat16
    ck.save(sd, tmp_path / "bf16.pt")
    with torch.no_grad():
        for t in pm.parameters_for_optimizer():
            t.add_(1.0)
    pm.load_state_dict(ck.load(tmp_path / "bf16.pt"))
    for a, b in zip(masters, pm.parameters_for_optimizer()):
        assert torch.equal(a, b)  # the fp32 master, not the bf16 values rounded back


def _experts(rank: int, world: int, root: str) -> dict:
    """HF Mixtral, each expert's gate_up_proj split in memory (held as a reshaped view)
    over 2 ranks, the replicated weights sharded over both: stage-3 files of view pieces."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "policies"))
    from moe_models import batches, build
    from test_experts_tp import ffn_tp

    warnings.simplefilter("ignore")
    data = batches(1, 1)
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=world, use_end2end=True, zero_stage=3)
    pm = parallelize(build("mixtral"), {"batch": data[0][0]}, ffn_tp, cfg, gen_savedir=root)
    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    pm.train_step([data[0][0]])
    opt.step()
    every = _all_gather(pm, opt)
    plain: list = [None] * world
    torch.distributed.all_gather_object(plain, pm.state_dict())
    out = {"merged": ck.merge_state_dicts([s for s, _ in every])[0],
           "gathered": ck.merge_state_dicts(plain)[0]}
    with torch.no_grad():
        for t in pm.parameters_for_optimizer():
            t.zero_()
    nnscaler.load_resharded(pm, [s for s, _ in every], opt, [o for _, o in every])
    out["reloaded"] = _merged_everywhere(pm, opt)[0]
    nnscaler.save_pretrained(pm, os.path.join(root, "hub"))
    return out


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("NNSCALER_SLOW_TESTS") != "1",
                    reason="HF Mixtral on 2 processes: NNSCALER_SLOW_TESTS=1")
def test_pieces_held_reshaped(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    got = run_distributed(_experts, 2, str(tmp_path))[0]
    assert any(v.dim() == 3 and "gate_up" in k for k, v in got["merged"].items())
    _assert_equal(got["merged"], got["gathered"])
    _assert_equal(got["reloaded"], got["merged"])
    hub = {}
    for f in sorted((tmp_path / "hub").glob("*.safetensors")):
        hub.update(load_file(f))
    for k, v in hub.items():
        assert torch.equal(v, got["merged"][k]), k
