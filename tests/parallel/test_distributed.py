"""parallelize and build_optimizer on several gloo processes: rank 0 generates and shares
its failures, the world-size check, every broadcast strategy (other nodes simulated with
GROUP_RANK and a gen_savedir per node), broadcast_weights, and the optimizer utilities."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from nnscaler import gendir
from nnscaler.parallel import paths, staging

from .common import ADAM, make_batch, make_model, reference_train, samples


def _quiet():
    warnings.simplefilter("ignore")


def _run(*args, **kwargs):
    from nnscaler import ComputeConfig, parallelize

    _quiet()
    cfg = kwargs.pop("cfg", None) or ComputeConfig(plan_ngpus=1, runtime_ngpus=2)
    return parallelize(make_model("mlp"), {"batch": make_batch("mlp", 0)}, kwargs.pop("policy", "dp"),
                       cfg, *args, **kwargs)


# -- failures on rank 0 reach every rank -----------------------------------------------------
def _failure_worker(rank, world, gen_savedir):
    from nnscaler import ComputeConfig
    from nnscaler.graph import PlanCheckError
    from nnscaler.parallel import ParallelizeError

    def unplaced(graph, cfg):
        return graph

    out = {}
    try:
        _run(gen_savedir=gen_savedir, policy=unplaced)
    except PlanCheckError as e:
        out["plan"] = str(e) + "".join(getattr(e, "__notes__", []))
    try:
        _run(gen_savedir=gen_savedir, cfg=ComputeConfig(plan_ngpus=1, runtime_ngpus=4))
    except ParallelizeError as e:
        out["world"] = str(e)
    # compiling for another cluster size needs no matching world
    _run(gen_savedir=gen_savedir, cfg=ComputeConfig(plan_ngpus=2, runtime_ngpus=4),
         policy="tp", load_module=False)
    return out


def test_rank0_failures_reach_every_rank(tmp_path):
    results = run_distributed(_failure_worker, 2, str(tmp_path))
    for rank, out in enumerate(results):
        assert "must be assigned to a device" in out["plan"] and "unplaced" in out["plan"]
        assert ("raised on rank 0" in out["plan"]) == (rank == 1)
        assert "runtime_ngpus (4) must equal the number of processes" in out["world"]
    from nnscaler.models.mlp import MLP

    out = paths.outdir_for(tmp_path, MLP, None)
    assert gendir.read_config(out)["match"]["compute_config"]["runtime_ngpus"] == 4
    assert staging.leftover_dirs(out) == []


# -- broadcast strategies -------------------------------------------------------------------
def _node_dir(root: str, rank: int, separate_nodes: bool) -> str:
    return os.path.join(root, f"node{rank}" if separate_nodes else "shared")


def _broadcast_worker(rank, world, root, strategy, separate_nodes):
    from nnscaler import broadcast_weights
    from nnscaler.models.mlp import MLP

    if separate_nodes:
        os.environ["GROUP_RANK"] = str(rank)  # every rank its own node, with its own disk
    else:
        os.environ.pop("GROUP_RANK", None)
    gen_savedir = _node_dir(root, rank, separate_nodes)
    load = strategy != "none"
    init = strategy == "all" or rank == 0
    pm = _run(gen_savedir=gen_savedir, broadcast_strategy=strategy, load_module=load,
              init_module_params=init)
    out = paths.outdir_for(gen_savedir, MLP, None)
    names = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if pm is not None:
        if strategy in ("no_weights", "code"):
            broadcast_weights(pm)  # collective: every rank calls it
        batch = make_batch("mlp", 3)
        torch.testing.assert_close(pm(batch), make_model("mlp")(batch))
    # reused files are never broadcast: remove this node's copy and ask again
    if separate_nodes and rank == 1:
        staging.remove_dir(out)
    _run(gen_savedir=gen_savedir, broadcast_strategy=strategy, load_module=False)
    return names, out.exists()


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("all", ["config.json", "fullmodel.pt", "gencode0.py", "gencode1.py", "graph.pkl"]),
        ("no_weights", ["config.json", "gencode0.py", "gencode1.py", "graph.pkl"]),
        ("code", ["gencode0.py", "gencode1.py"]),
        ("none", []),
    ],
)
def test_broadcast_to_other_nodes(tmp_path, strategy, expected):
    (node0, _), (node1, exists_after) = run_distributed(
        _broadcast_worker, 2, str(tmp_path), strategy, True)
    assert node0 == ["config.json", "fullmodel.pt", "gencode0.py", "gencode1.py", "graph.pkl"]
    assert node1 == expected
    assert not exists_after  # rank 0 reused its files: nothing new to send
    assert not list(Path(tmp_path).rglob(".*.tmp*"))


def _missing_files_worker(rank, world, root):
    from nnscaler.parallel import ParallelizeError

    os.environ["GROUP_RANK"] = str(rank)
    try:
        _run(gen_savedir=_node_dir(root, rank, True))  # 'none': node 1 gets nothing
    except ParallelizeError as e:
        return str(e)
    return None


def test_files_missing_on_another_node_fail_every_rank(tmp_path):
    for message in run_distributed(_missing_files_worker, 2, str(tmp_path)):
        assert message is not None and "rank(s) [1] cannot load their generated code" in message
        assert "broadcast_strategy='all'" in message


@pytest.mark.parametrize("strategy", ["all", "no_weights", "code"])
def test_broadcast_on_one_node_is_a_no_op(tmp_path, strategy):
    results = run_distributed(_broadcast_worker, 2, str(tmp_path), strategy, False)
    assert results[0] == results[1]


def _weights_worker(rank, world, gen_savedir):
    from nnscaler import ComputeConfig, broadcast_weights, build_optimizer
    from nnscaler.parallel import BroadcastError

    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=4, use_zero=True)
    pm = _run(gen_savedir=gen_savedir, cfg=cfg, policy="tp", init_module_params=rank < 2)
    errors = []
    for stride in (3, 8, 0):
        try:
            broadcast_weights(pm, stride)
        except BroadcastError as e:
            errors.append(str(e))
    broadcast_weights(pm)  # stride = plan_ngpus: ranks 2, 3 from ranks 0, 1
    # a step after the broadcast starts from the broadcast weights (ZeRO shards included)
    data = samples("mlp", 1, 2, 1)
    _, ref_state = reference_train(make_model("mlp"), data)
    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    pm(data[0][rank // 2][0]).backward()
    opt.step()
    from .common import check_pieces

    return check_pieces(pm, ref_state), errors


def test_broadcast_weights(tmp_path):
    for checked, errors in run_distributed(_weights_worker, 4, str(tmp_path)):
        assert checked > 0
        assert len(errors) == 3 and all("positive multiple of plan_ngpus (2)" in e
                                        for e in errors)


# -- optimizer utilities ---------------------------------------------------------------------
def _reference_norm_and_step(data, max_norm):
    model = make_model("gpt")
    opt = torch.optim.Adam(model.parameters(), **ADAM)
    for unit in data[0]:
        for batch in unit:
            model(batch).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return float(norm), {n: p.detach().clone() for n, p in model.named_parameters()}


def _optimizer_worker(rank, world, gen_savedir, use_zero):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    from .common import check_pieces

    _quiet()
    plan = 2
    units = world // plan
    data = samples("gpt", 1, units, 1)
    full_norm, _ = _reference_norm_and_step(data, float("inf"))
    clipped_norm, ref_state = _reference_norm_and_step(data, full_norm / 2)
    cfg = ComputeConfig(plan_ngpus=plan, runtime_ngpus=world, use_zero=use_zero)
    pm = parallelize(make_model("gpt"), {"batch": data[0][0][0]}, "tp", cfg,
                     gen_savedir=gen_savedir, instance_name=f"z{int(use_zero)}")
    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    calls = {"pre": 0, "post": 0}

    def pre(reducer, grad):
        calls["pre"] += 1
        grad.div_(units)

    def post(reducer, grad):
        calls["post"] += 1
        grad.mul_(units)

    opt.register_reducer_pre_hook(pre)
    opt.register_reducer_post_hook(post)
    pm(data[0][rank // plan][0]).backward()
    norm = opt.clip_gnorm()  # syncs first; no clipping
    opt.scale_grads(2.0)
    twice = opt.clip_gnorm()  # already synced: not summed again
    opt.scale_grads(0.5)
    clip = opt.clip_gnorm(full_norm / 2)
    after = opt.clip_gnorm()
    opt.step()
    opt.zero_grad()
    return {"norm": float(norm), "twice": float(twice), "clip": float(clip),
            "after": float(after), "full": full_norm, "calls": calls,
            "checked": check_pieces(pm, ref_state)}


@pytest.mark.parametrize("use_zero", [False, True], ids=["plain", "zero"])
def test_clip_gnorm_counts_every_element_once(tmp_path, use_zero):
    for r in run_distributed(_optimizer_worker, 4, str(tmp_path), use_zero):
        assert r["norm"] == pytest.approx(r["full"], rel=1e-5)
        assert r["twice"] == pytest.approx(2 * r["full"], rel=1e-5)
        assert r["clip"] == pytest.approx(r["full"], rel=1e-5)
        assert r["after"] == pytest.approx(r["full"] / 2, rel=1e-4)
        assert r["calls"]["pre"] > 0 and r["calls"]["pre"] == r["calls"]["post"]
        assert r["checked"] > 0
