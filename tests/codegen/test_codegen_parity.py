"""Generated programs compute what the single-device model computes.

Each test plans the project's MLP or GPT with the IRGraph API, generates every rank's
file into a temporary directory and runs them on forked gloo processes: losses, the
gradients of the pieces (summed over their holders, before and after ``sync_grad``) and
the parameters after Adam steps over ``parameters_for_optimizer()`` must equal the
single-process run (float32, rtol 1e-5). See ``codegen_helpers.check_parity``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from codegen_helpers import ATOL, RTOL, batches, generate, mlp_tp, run_parity
from dist_utils import run_distributed
from plan_helpers import case, data_parallel, fresh, megatron_mlp, replicate_rest

from nnscaler.codegen import load_generated_class


@pytest.mark.parametrize("ndevices,mode", [(2, "train_step"), (4, "forward")])
def test_mlp_batch_split(tmp_path, ndevices, mode):
    graph = data_parallel(fresh("mlp"), ndevices)
    run_parity(tmp_path, "mlp", graph, plan_ngpus=ndevices, runtime_ngpus=ndevices, mode=mode)


def test_mlp_tensor_parallel(tmp_path):
    run_parity(tmp_path, "mlp", mlp_tp(fresh("mlp"), 2), plan_ngpus=2, runtime_ngpus=2)


def test_gpt_batch_split(tmp_path):
    run_parity(tmp_path, "gpt", data_parallel(fresh("gpt"), 2), plan_ngpus=2, runtime_ngpus=2)


@pytest.mark.parametrize("name", ["gpt", "gpt_nobias"])
def test_gpt_megatron_tp(tmp_path, name):
    """Megatron's MLP split (with a bias, the row split adds it on part 0 only: the
    module holds it there, and no adapter splits its value)."""
    graph = megatron_mlp(fresh(name), 2)
    run_parity(tmp_path, name, graph, plan_ngpus=2, runtime_ngpus=2)


def test_gpt_tp_times_two_scale_units(tmp_path):
    """tp on 2 devices, data parallel over 2 scale units: 4 processes, each unit its
    own batch; gradients summed over units."""
    graph = megatron_mlp(fresh("gpt_nobias"), 2)
    results = run_parity(tmp_path, "gpt_nobias", graph, plan_ngpus=2, runtime_ngpus=4)
    holders = {m.holders for m in results[1]["fullmap"].values()}
    assert holders == {(1, 3), (0, 1, 2, 3)}  # tp pieces across units, replicated ones all


def test_ops_on_different_devices(tmp_path):
    """The first layer on device 0, the rest on device 1 (no schedule, one micro-batch):
    pieces move point to point; device 0 anchors the tensor it only sends, so that its
    backward (the gradient coming back) runs there too."""
    graph = fresh("mlp")
    for i, op in enumerate(graph.nodes()):
        graph.assign(op, 0 if i < 2 else 1)
    run_parity(tmp_path, "mlp", graph, plan_ngpus=2, runtime_ngpus=4)
    assert "anchors=(" in (tmp_path / "gen" / "gencode0.py").read_text()


@pytest.mark.parametrize("name,zero_ngroups", [("mlp", 1), ("gpt_nobias", 2)])
def test_zero_and_async_reducer(tmp_path, name, zero_ngroups):
    """ZeRO (optimizer state sharded over the holders of each piece, in one or two zero
    groups) with the async reducer and small buckets keeps parity, on tp x 2 units."""
    config = {"use_zero": True, "zero_ngroups": zero_ngroups, "use_async_reducer": True,
              "reducer_bucket_cap_mb": 0.0005}
    graph = mlp_tp(fresh("mlp"), 2) if name == "mlp" else megatron_mlp(fresh(name), 2)
    run_parity(tmp_path, name, graph, plan_ngpus=2, runtime_ngpus=4, compute_config=config)


def _micro_batches(rank, world, outdir, data):
    module = load_generated_class(outdir, rank)(init_params=True)
    mine = data[rank]  # plan_ngpus == 1: every rank is a scale unit
    outs = module.train_step(mine, is_dummy_batch=[False, True, False],
                             scale_fn=lambda loss: 2.0 * loss)
    module.sync_grad()
    return [o.item() for o in outs], {a: p.grad for a, p in module.named_parameters()}


@pytest.mark.parametrize("async_op", [False, True])
def test_train_step_micro_batches(tmp_path, async_op):
    """Gradients are summed over micro-batches (a dummy one adds nothing) and scale units;
    scale_fn scales the loss before backward; outputs come back per micro-batch."""
    graph = fresh("mlp")
    replicate_rest(graph, 1)
    outdir = generate(tmp_path, "mlp", graph, plan_ngpus=1, runtime_ngpus=2,
                      compute_config={"use_async_reducer": async_op})
    flat = batches("mlp", 6)
    data = [flat[0:3], flat[3:6]]
    results = run_distributed(_micro_batches, 2, str(outdir), data)
    module = copy.deepcopy(case("mlp").module)
    losses = [module(b) for b in flat]
    used = [x for i, x in enumerate(losses) if i % 3 != 1]
    (2.0 * torch.stack(used).sum()).backward()
    for rank, (outs, grads) in enumerate(results):
        want = [x.item() for x in losses[3 * rank: 3 * rank + 3]]
        torch.testing.assert_close(torch.tensor(outs), torch.tensor(want), rtol=RTOL, atol=ATOL)
        for name, p in module.named_parameters():
            torch.testing.assert_close(grads[name.replace(".", "_")], p.grad, rtol=RTOL,
                                       atol=ATOL)
