"""Reducer: gradients summed over data-parallel replicas and micro-batches (gloo, CPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from dist_utils import run_distributed

from nnscaler.runtime.reducer import Reducer

NMICRO_SAMPLES = 3


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 15),
        torch.nn.Tanh(),
        torch.nn.Linear(15, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )


def batch(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + micro)
    return torch.randn(NMICRO_SAMPLES, 8, generator=g), torch.randn(NMICRO_SAMPLES, 3, generator=g)


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum()


def reference_grads(world: int, nmicro: int) -> list[torch.Tensor]:
    model = make_mlp()
    xs, ys = zip(*(batch(r, m) for r in range(world) for m in range(nmicro)))
    loss_fn(model, torch.cat(xs), torch.cat(ys)).backward()
    return [p.grad.clone() for p in model.parameters()]


def _train_grads(
    rank: int, world: int, cap_mb: float, async_op: bool, nmicro: int, set_to_none: bool
) -> dict:
    model = make_mlp()
    reducer = Reducer(model.parameters(), range(world), bucket_cap_mb=cap_mb, async_op=async_op)
    pre_calls: list[int] = []
    post_calls: list[int] = []

    def pre(buf: torch.Tensor) -> None:
        pre_calls.append(buf.numel())
        buf.div_(4.0)

    def post(buf: torch.Tensor) -> None:
        post_calls.append(buf.numel())
        buf.mul_(4.0)

    reducer.register_pre_hook(pre)
    reducer.register_post_hook(post)
    for _ in range(2):  # two iterations: zero_grad must reset everything
        if set_to_none:
            for p in model.parameters():
                p.grad = None
        else:
            reducer.zero_grad()
        pre_calls.clear()
        post_calls.clear()
        for m in range(nmicro):
            ctx = reducer.no_sync() if m < nmicro - 1 else contextlib.nullcontext()
            with ctx:
                loss_fn(model, *batch(rank, m)).backward()
        launched = [b.launched for b in reducer.buckets]
        reducer.sync_grads()
    return {
        "grads": [p.grad.clone() for p in model.parameters()],
        "nbuckets": len(reducer.buckets),
        "launched_in_backward": launched,
        "pre": pre_calls,
        "post": post_calls,
        "bucket_numels": [b.grad_buffer.numel() for b in reducer.buckets],
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("cap_mb", [1e-6, 0.001, 100.0])
def test_grads_sum_over_replicas_and_micro_batches(world: int, async_op: bool, cap_mb: float):
    nmicro = 2
    results = run_distributed(_train_grads, world, cap_mb, async_op, nmicro, False)
    ref = reference_grads(world, nmicro)
    for res in results:
        for g, r in zip(res["grads"], ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
        # hooks called once per bucket, with that bucket's buffer
        assert res["pre"] == res["bucket_numels"]
        assert res["post"] == res["bucket_numels"]
        # async: every bucket was launched by the gradient hooks, during backward
        assert res["launched_in_backward"] == [async_op] * res["nbuckets"]
    nparams = 6
    expected = {1e-6: nparams, 100.0: 1}
    if cap_mb in expected:
        assert results[0]["nbuckets"] == expected[cap_mb]
    else:
        assert 1 < results[0]["nbuckets"] < nparams


@pytest.mark.parametrize("async_op", [False, True])
def test_grads_set_to_none_are_adopted(async_op: bool):
    """optimizer.zero_grad(set_to_none=True) instead of reducer.zero_grad() still works."""
    results = run_distributed(_train_grads, 2, 0.001, async_op, 2, True)
    ref = reference_grads(2, 2)
    for res in results:
        for g, r in zip(res["grads"], ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_single_rank_no_distributed():
    model = make_mlp()
    reducer = Reducer(model.parameters(), [0], bucket_cap_mb=1e-6)
    reducer.zero_grad()
    loss_fn(model, *batch(0, 0)).backward()
    reducer.sync_grads()
    for g, r in zip([p.grad for p in model.parameters()], reference_grads(1, 1)):
        torch.testing.assert_close(g, r)


def test_bucket_layout_grads_are_views_in_reverse_order():
    model = make_mlp()
    params = list(model.parameters())
    reducer = Reducer(params + params[:1], [0], bucket_cap_mb=(15 * 16 + 16) * 4 / 2**20)
    assert len(reducer.params) == len(params)  # duplicates skipped
    order = [p for b in reducer.buckets for p in b.params]
    assert order == params[::-1]
    for b in reducer.buckets:
        assert sum(p.numel() * 4 for p in b.params) <= (15 * 16 + 16) * 4 or len(b.params) == 1
        for p, off in zip(b.params, b.offsets):
            assert p.grad.data_ptr() == b.grad_buffer[off:].data_ptr()
    reducer.zero_grad()
    loss_fn(model, *batch(0, 0)).backward()
    b0 = reducer.buckets[0]
    assert b0.params[0].grad.data_ptr() == b0.grad_buffer.data_ptr()  # accumulated in place


def test_async_accumulation_outside_no_sync_is_an_error():
    model = make_mlp()
    reducer = Reducer(model.parameters(), [0], async_op=True)
    reducer.zero_grad()
    loss_fn(model, *batch(0, 0)).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        loss_fn(model, *batch(0, 1)).backward()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ranks": [0, 0, 1], "zero": True}, "distinct"),
        ({"ranks": []}, "at least one rank"),
        ({"ranks": [0, 0]}, "distinct"),
        ({"ranks": [0], "bucket_cap_mb": 0}, "bucket_cap_mb must be > 0"),
        ({"ranks": [0, 1, 2], "zero": True, "zero_ngroups": 2}, "must divide"),
    ],
)
def test_invalid_arguments(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):  # no process group needed to reject these
        Reducer(make_mlp().parameters(), **kwargs)
