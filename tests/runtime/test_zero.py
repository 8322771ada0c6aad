"""ZeRO stages 1 and 2: sharded Adam state (and, stage 2, sharded gradients) give the same
training as plain data parallelism."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from test_reducer import batch, loss_fn, make_mlp

from nnscaler.runtime.reducer import Reducer
from nnscaler.runtime.zero import padded_numel, zero_groups

NSTEPS = 3
LR = 1e-2


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )


def _train(rank: int, world: int, zero: bool, ngroups: int, async_op: bool, cap_mb: float,
           stage: int | None = None) -> dict:
    model = make_mlp()
    peak_grad = 0
    reducer = Reducer(
        model.parameters(),
        [3, 1, 0, 2] if world == 4 and async_op else list(range(world)),  # any order
        bucket_cap_mb=cap_mb,
        async_op=async_op,
        zero=zero,
        zero_ngroups=ngroups,
        zero_stage=stage,
    )
    opt = torch.optim.Adam(reducer.parameters_for_optimizer(), lr=LR)
    for step in range(NSTEPS):
        opt.zero_grad()
        reducer.zero_grad()
        with reducer.no_sync():
            loss_fn(model, *batch(rank, 2 * step)).backward()
        loss_fn(model, *batch(rank, 2 * step + 1)).backward()
        # full-size gradients still held after backward (stage 2: those of buckets not
        # launched yet; the rest were reduce-scattered from the hooks and freed)
        peak_grad = max(peak_grad, sum(p.grad.numel() for p in model.parameters()
                                       if p.grad is not None and stage == 2))
        reducer.sync_grads()
        opt.step()
        reducer.gather_params()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state_bytes": state_bytes(opt),
        "grad_buffer_numel": sum(b.grad_buffer.numel() for b in reducer.buckets),
        "held_grads": peak_grad,
        "shard_grad_numel": sum(s.grad.numel() for s in reducer.parameters_for_optimizer()
                                if zero and s.grad is not None),
    }


def reference_params(world: int) -> list[torch.Tensor]:
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(NSTEPS):
        opt.zero_grad()
        xs, ys = zip(*(batch(r, m) for r in range(world) for m in (2 * step, 2 * step + 1)))
        loss_fn(model, torch.cat(xs), torch.cat(ys)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize(
    ("world", "ngroups", "async_op", "cap_mb"),
    [
        (4, 1, False, 100.0),
        (4, 2, False, 0.001),
        (4, 2, True, 0.001),
        (4, 4, False, 100.0),
        (2, 1, True, 1e-6),
    ],
)
def test_zero_matches_plain_data_parallel(world: int, ngroups: int, async_op: bool, cap_mb: float):
    ref = reference_params(world)
    plain = run_distributed(_train, world, False, 1, async_op, cap_mb)
    sharded = run_distributed(_train, world, True, ngroups, async_op, cap_mb)
    for res in plain + sharded:
        for p, r in zip(res["params"], ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("world", "ngroups", "cap_mb"),
    [(4, 1, 100.0), (4, 2, 0.001), (2, 1, 1e-6), (4, 4, 0.001)],
)
def test_stage2_matches_plain_data_parallel(world: int, ngroups: int, cap_mb: float):
    ref = reference_params(world)
    sharded = run_distributed(_train, world, True, ngroups, False, cap_mb, 2)
    nparams = sum(r.numel() for r in ref)
    for res in sharded:
        for p, r in zip(res["params"], ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
        assert res["grad_buffer_numel"] == 0  # no full gradient buffer is kept
        shards = world // ngroups
        assert res["shard_grad_numel"] <= nparams // shards + 8 * shards
        if cap_mb < 0.01:  # many small buckets: most were reduced during backward
            assert res["held_grads"] < nparams // 2, (res["held_grads"], nparams)


def test_stage_and_zero_must_agree():
    with pytest.raises(ValueError, match="zero_stage must be 0 without zero"):
        Reducer(make_mlp().parameters(), [0], zero=False, zero_stage=2)
    with pytest.raises(ValueError, match="zero=True, zero_stage=2"):
        Reducer(make_mlp().parameters(), [0], zero=True, zero_stage=4)


def test_stage2_single_rank_keeps_no_full_gradient():
    model = make_mlp()
    reducer = Reducer(model.parameters(), [0], zero=True, zero_stage=2, bucket_cap_mb=1e-6)
    (ref,) = [make_mlp()]
    reducer.zero_grad()
    for m in range(2):
        with reducer.no_sync():  # stage 2 reduces anyway: it holds no full gradient
            loss_fn(model, *batch(0, m)).backward()
        assert all(p.grad is None for p in model.parameters())
        loss_fn(ref, *batch(0, m)).backward()
    reducer.sync_grads()
    got = torch.cat([s.grad for s in reducer.parameters_for_optimizer()])
    want = torch.cat([p.grad.reshape(-1) for p in reversed(list(ref.parameters()))])
    torch.testing.assert_close(got[: want.numel()], want, rtol=1e-6, atol=1e-7)


def test_zero_halves_optimizer_state_on_two_ranks():
    plain = run_distributed(_train, 2, False, 1, False, 100.0)
    sharded = run_distributed(_train, 2, True, 1, False, 100.0)
    for p, s in zip(plain, sharded):
        assert s["state_bytes"] <= 0.55 * p["state_bytes"], (s["state_bytes"], p["state_bytes"])


def test_zero_groups_layout():
    g = zero_groups([0, 1, 2, 3], 2, 3)
    assert g.zero_ranks == (2, 3) and g.cross_ranks == (1, 3) and g.shard_index == 1
    g = zero_groups([4, 5, 6, 7], 4, 6)
    assert g.zero_ranks == (6,) and g.cross_ranks == (4, 5, 6, 7) and g.shard_index == 0
    assert padded_numel(10, 4) == 12 and padded_numel(12, 4) == 12
    with pytest.raises(ValueError, match="must divide"):
        zero_groups([0, 1, 2], 2, 0)


def test_zero_single_rank_shard_is_whole_buffer():
    model = make_mlp()
    reducer = Reducer(model.parameters(), [0], zero=True)
    (shard,) = reducer.parameters_for_optimizer()
    assert shard.dtype == torch.float32
    assert shard.numel() == sum(p.numel() for p in model.parameters())
    reducer.zero_grad()
    loss_fn(model, *batch(0, 0)).backward()
    reducer.sync_grads()
    assert shard.grad is not None
    with torch.no_grad():
        shard.add_(1.0)
    reducer.gather_params()
    ref = make_mlp()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r + 1.0)


def test_refresh_shards_copies_changed_parameters_into_the_shards():
    model = make_mlp()
    reducer = Reducer(model.parameters(), [0], zero=True)
    (shard,) = reducer.parameters_for_optimizer()
    before = shard.detach().clone()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)  # e.g. weights loaded in place
    assert torch.equal(shard.detach(), before)  # the shard is a copy: stale until refreshed
    reducer.refresh_shards()
    torch.testing.assert_close(shard.detach(), 2.0 * before, rtol=0, atol=0)
    Reducer(make_mlp().parameters(), [0]).refresh_shards()  # without zero: nothing to do
