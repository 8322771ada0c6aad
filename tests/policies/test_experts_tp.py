"""Tensor parallel inside the experts (`ffn_transform`): every expert split by its
intermediate units, ``gate_up_proj`` included, in memory. Parity with one process (losses,
first-step gradients, weights after two SGD steps with momentum, rtol 1e-5) on tiny
Hugging Face Mixtral and Qwen2-MoE with their load-balancing loss: tp 2 on 2 processes,
and tp 2 inside data parallel 2 on 4 (slow). Each rank holds 1/tp of every expert weight;
``merge_state_dicts`` of the ranks' state dicts (and of their optimizer states) gives the
one-process state dict, expert weights in the model's ``[E, 2F, H]``; a merged state dict,
the ranks' own files (``load_resharded``) and a Hub-format folder written from the module
load back into the plan; with ZeRO 1 and 3 inside data parallel (4 processes, slow)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from dist_utils import run_distributed
from moe_models import batches, build

SGD = {"lr": 1e-2, "momentum": 0.9}
TOL = dict(rtol=1e-5, atol=1e-6)


def ffn_tp(graph, config):
    """Every MoE layer split by its experts' intermediate units over the scale unit, every
    other op replicated on it."""
    from nnscaler.extend import ffn_transform, is_moe
    from nnscaler.graph import IRGraph

    g = IRGraph.from_graph(graph)
    n = config.plan_ngpus
    for op in list(g.nodes()):
        if is_moe(op):
            t = ffn_transform(op, n, "ffn_tp")
            parts = g.partition(op, idx=t.idx, dim=t.dim, num=n)
        else:
            parts = g.replicate(op, n)
        for device, part in enumerate(parts):
            g.assign(part, device)
    return g


def _reference(kind: str, data: list) -> dict:
    ref = build(kind)
    opt = torch.optim.SGD(ref.parameters(), **SGD)
    losses, grads = [], None
    for step in data:
        for batch in step:
            loss = ref(batch)
            loss.backward()
            losses.append(float(loss))
        if grads is None:
            grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "state": ref.state_dict(),
            "momentum": {n: opt.state[p]["momentum_buffer"] for n, p in ref.named_parameters()
                         if p in opt.state}}


def safetensors_keys(folder: str) -> list[str]:
    from safetensors import safe_open

    keys = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                keys += [k for k in f.keys() if not k.endswith("gate_up_proj")
                         or f.get_slice(k).get_shape()[1] == 2 * 32]  # [E, 2F, H]
    return keys


def _worker(rank: int, world: int, kind: str, tp: int, root: str) -> dict:
    import torch.distributed as dist

    from nnscaler import (
        ComputeConfig,
        load_merged_state_dicts,
        load_pretrained,
        load_resharded,
        merge_state_dicts,
        parallelize,
        save_pretrained,
    )

    warnings.simplefilter("ignore")
    units = world // tp
    data = batches(2, units)
    ref = _reference(kind, data)
    cfg = ComputeConfig(plan_ngpus=tp, runtime_ngpus=world, use_end2end=True)
    pm = parallelize(build(kind), {"batch": data[0][0]}, ffn_tp, cfg, gen_savedir=root)
    opt = torch.optim.SGD(pm.parameters_for_optimizer(), **SGD)
    unit, losses, expert = rank // tp, [], {"mine": 0, "full": 0}
    for i, step in enumerate(data):
        losses += [float(x) for x in pm.train_step([step[unit]])]
        pm.sync_grad()
        for attr, meta in pm.fullmap.items():
            want = ref["grads"].get(meta.orig_name)
            if i == 0 and meta.kind == "parameter" and want is not None:
                torch.testing.assert_close(getattr(pm, attr).grad, meta.take(want), **TOL,
                                           msg=lambda m, n=meta.orig_name: f"grad {n}: {m}")
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(torch.tensor(losses),
                               torch.tensor(ref["losses"][unit::units]), **TOL)
    for attr, meta in pm.fullmap.items():
        if meta.kind != "parameter":
            continue
        mine = getattr(pm, attr).detach()
        full = ref["state"][meta.orig_name]
        torch.testing.assert_close(mine, meta.take(full), **TOL,
                                   msg=lambda m, n=meta.orig_name: f"weight {n}: {m}")
        if ".experts." in meta.orig_name:
            expert["mine"] += mine.numel() * mine.element_size()
            expert["full"] += full.numel() * full.element_size()
    every: list = [None] * world
    dist.all_gather_object(every, (pm.state_dict(), opt.state_dict()))
    merged, merged_opt = merge_state_dicts([s for s, _ in every], [o for _, o in every])
    assert merged.keys() == ref["state"].keys()
    for name, value in ref["state"].items():
        torch.testing.assert_close(merged[name], value, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    by_id = dict(enumerate(n for n, p in build(kind).named_parameters()))
    momentum = {by_id[i]: s["momentum_buffer"] for i, s in merged_opt["state"].items()}
    for name, value in ref["momentum"].items():
        torch.testing.assert_close(momentum[name], value, **TOL)
    # a merged state dict loads back into the plan: every piece, gate_up_proj's included
    saved = {attr: p.detach().clone() for attr, p in pm.named_parameters()}
    saved_opt = {i: v["momentum_buffer"].clone() for i, v in opt.state_dict()["state"].items()}

    def reload(load, optimizer: bool = True) -> None:
        with torch.no_grad():
            for p in pm.parameters():
                p.zero_()
        for v in opt.state.values():
            v["momentum_buffer"].zero_()
        load()
        for attr, p in pm.named_parameters():
            assert torch.equal(p, saved[attr]), attr
        for i, v in opt.state_dict()["state"].items():
            assert torch.equal(v["momentum_buffer"], saved_opt[i]) or not optimizer, i

    reload(lambda: load_merged_state_dicts(pm, merged, opt, merged_opt))
    # and so do the ranks' own files (load_resharded) and a Hub-format folder written from
    # the live module (save_pretrained / load_pretrained): boxes of the model's [E, 2F, H]
    reload(lambda: load_resharded(pm, [s for s, _ in every], opt, [o for _, o in every]))
    save_pretrained(pm, f"{root}/hub")
    assert sorted(safetensors_keys(f"{root}/hub")) == sorted(ref["state"])
    reload(lambda: load_pretrained(pm, f"{root}/hub"), optimizer=False)
    shapes = {meta.orig_name: meta.sub_shape for meta in pm.fullmap.values()
              if meta.orig_name.endswith("experts.gate_up_proj")}
    return {"expert": expert, "gate_up": shapes}


def _cases(rank: int, world: int, kinds: tuple[str, ...], tp: int, root: str) -> list[dict]:
    """Every model in one launch (the processes and imports are the slow part)."""
    return [_worker(rank, world, kind, tp, f"{root}/{kind}") for kind in kinds]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=[pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("NNSCALER_SLOW_TESTS") != "1", reason="slow: set NNSCALER_SLOW_TESTS=1")])])
def test_tensor_parallel_inside_the_experts_parity(tmp_path, world):
    pytest.importorskip("transformers")
    tp, kinds = 2, ("mixtral", "qwen2_moe")
    results = run_distributed(_cases, world, kinds, tp, str(tmp_path), timeout=600)
    for res in (r for rank in results for r in rank):
        # every expert weight, gate_up_proj too, at 1/tp per rank
        assert res["expert"]["mine"] * tp == res["expert"]["full"] > 0
        # [E, 2, F/tp, H]: this rank's gate rows and up rows (4 experts, ffn 32, hidden 32)
        assert set(res["gate_up"].values()) == {(4, 2, 32 // tp, 32)}


def _zero_worker(rank: int, world: int, stages: tuple[int, ...], root: str) -> list[int]:
    """tp 2 inside the experts inside data parallel 2 with ZeRO: each expert piece reduced
    (and sharded) over the two ranks that hold it; losses, weights and the merged state
    dict against one process."""
    import torch.distributed as dist
    from parallel.common import check_pieces

    from nnscaler import ComputeConfig, build_optimizer, merge_state_dicts, parallelize

    warnings.simplefilter("ignore")
    data = batches(2, 2)
    ref = _reference("mixtral", data)
    checked = []
    for stage in stages:
        cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=world, use_end2end=True,
                            zero_stage=stage)
        pm = parallelize(build("mixtral"), {"batch": data[0][0]}, ffn_tp, cfg,
                         gen_savedir=f"{root}/{stage}")
        opt = build_optimizer(pm, torch.optim.SGD, **SGD)
        unit, losses = rank // 2, []
        for step in data:
            opt.zero_grad()
            losses += [float(x) for x in pm.train_step([step[unit]])]
            opt.sync_shard_grad()
            opt.step()
        torch.testing.assert_close(torch.tensor(losses),
                                   torch.tensor(ref["losses"][unit::2]), **TOL)
        checked.append(check_pieces(pm, ref["state"], rtol=1e-5, atol=1e-6))
        every: list = [None] * world
        dist.all_gather_object(every, pm.state_dict())
        merged, _ = merge_state_dicts(every)
        for name, value in ref["state"].items():
            torch.testing.assert_close(merged[name], value, **TOL)
    return checked


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("NNSCALER_SLOW_TESTS") != "1",
                    reason="slow: set NNSCALER_SLOW_TESTS=1")
def test_tensor_parallel_inside_the_experts_with_zero(tmp_path):
    pytest.importorskip("transformers")
    results = run_distributed(_zero_worker, 4, (1, 3), str(tmp_path), timeout=600)
    assert all(r == results[0] and min(r) > 0 for r in results)
