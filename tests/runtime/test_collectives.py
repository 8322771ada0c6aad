"""Each collective, forward and backward, on 2 and 4 gloo processes, against plain tensor
ops in one process (integer-valued float64, so every comparison is exact)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

SHAPE = (4, 8)
ORDERS = {2: (1, 0), 4: (2, 0, 3, 1)}  # layout order of the group: not the rank order


def _data(k: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-9, 10, SHAPE, generator=g).double() for _ in range(k)]


def _chunk(t: torch.Tensor, dim: int, m: int, k: int) -> torch.Tensor:
    return t.chunk(k, dim)[m]


def _pad(t: torch.Tensor, dim: int, m: int, k: int) -> torch.Tensor:
    parts = [torch.zeros_like(t) for _ in range(k)]
    parts[m] = t
    return torch.cat(parts, dim)


def _grad(y: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    (dx,) = torch.autograd.grad(y, x, g)
    return dx


def _check_all(rank: int, world_size: int) -> list[str]:
    from nnscaler import runtime as rt

    ranks = ORDERS[world_size]
    k = len(ranks)
    m = ranks.index(rank)
    xs, gs = _data(k, 1), _data(k, 2)
    total_x, total_g = sum(xs), sum(gs)
    checked = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            raise AssertionError(f"{name} on rank {rank} (member {m}):\n{got}\n!=\n{want}")
        checked.append(name)

    def leaf() -> torch.Tensor:
        return xs[m].clone().requires_grad_(True)

    # outputs of a collective depend on the output shape: build per-member upstream grads
    def upstream(shape: torch.Size, seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(-9, 10, shape, generator=gen).double() for _ in range(k)]

    for grad in ("replicated", "exact"):
        x = leaf()
        y = rt.all_reduce(x, ranks, grad=grad)
        check("all_reduce fwd", y, total_x)
        want = gs[m] if grad == "replicated" else total_g
        check(f"all_reduce bwd {grad}", _grad(y, x, gs[m]), want)

        x = leaf()
        y = rt.all_gather(x, ranks, 1, grad=grad)
        check("all_gather fwd", y, torch.cat(xs, 1))
        up = upstream(y.shape, 3)
        src = up[m] if grad == "replicated" else sum(up)
        check(f"all_gather bwd {grad}", _grad(y, x, up[m]), _chunk(src, 1, m, k))

        x = leaf()
        y = rt.chunk(x, ranks, 1, grad=grad)
        check("chunk fwd", y, _chunk(xs[m], 1, m, k))
        up = upstream(y.shape, 4)
        want = torch.cat(up, 1) if grad == "replicated" else _pad(up[m], 1, m, k)
        check(f"chunk bwd {grad}", _grad(y, x, up[m]), want)

        root = ranks[1]
        x = leaf()
        y = rt.broadcast(x, ranks, root, grad=grad)
        check("broadcast fwd", y, xs[1])
        if grad == "replicated":
            want = gs[m]
        else:
            want = total_g if rank == root else torch.zeros_like(total_g)
        check(f"broadcast bwd {grad}", _grad(y, x, gs[m]), want)

    x = leaf()
    y = rt.identity_allreduce(x, ranks)
    check("identity_allreduce fwd", y, xs[m])
    check("identity_allreduce bwd", _grad(y, x, gs[m]), total_g)

    x = leaf()
    y = rt.reduce_scatter(x, ranks, 0)
    check("reduce_scatter fwd", y, _chunk(total_x, 0, m, k))
    up = upstream(y.shape, 5)
    check("reduce_scatter bwd", _grad(y, x, up[m]), torch.cat(up, 0))

    x = leaf()
    y = rt.all_to_all(x, ranks, 0, 1)
    check("all_to_all fwd", y, torch.cat([_chunk(xm, 1, m, k) for xm in xs], 0))
    up = upstream(y.shape, 6)
    check("all_to_all bwd", _grad(y, x, up[m]), torch.cat([_chunk(u, 0, m, k) for u in up], 1))

    src, dst = ranks[0], ranks[-1]
    if rank == src:
        x = leaf()
        y = rt.send_recv(x, src, dst)
        check("send_recv fwd (source)", y, torch.empty(0, dtype=torch.float64))
        check("send_recv bwd", _grad(y, x, torch.empty(0, dtype=torch.float64)), gs[-1])
    elif rank == dst:
        y = rt.send_recv(None, src, dst, shape=SHAPE, dtype=torch.float64)
        check("send_recv fwd", y, xs[0])
        torch.autograd.backward(y, gs[-1])
    return checked


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_match_single_process_reference(world_size):
    results = run_distributed(_check_all, world_size)
    assert all(len(r) >= 20 for r in results)


def _errors(rank: int, world_size: int) -> list[str]:
    from nnscaler import runtime as rt

    messages = []
    x = torch.zeros(3, 8)
    for call in (
        lambda: rt.all_reduce(x, [0, 1], grad="sum"),
        lambda: rt.chunk(x, [0, 1], 0),
        lambda: rt.all_reduce(x, [7, 8]),
    ):
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the message is the point
            messages.append(f"{type(e).__name__}: {e}")
    return messages


def test_collective_errors_state_rule_value_and_fix():
    messages = run_distributed(_errors, 2)[0]
    assert "grad must be one of ['replicated', 'exact'], got 'sum'" in messages[0]
    assert "cannot cut dim 0 of size 3 into 2 equal chunks" in messages[1]
    assert "rank 0 is not a member of the group [7, 8]" in messages[2]
