"""ProcessPartGroup on 2 and 4 gloo processes gives what ThreadPartGroup gives in one
process: all_reduce sum/max, all_gather and uneven all_to_all values, and exact-adjoint gradients
(integer-valued float64, so every comparison is exact)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from nnscaler.ops.partgroup import PartGroup, run_parts

SHAPE = (3, 5)
# the ranks of the parts, in part order: not the rank order; on 4 ranks also a group of
# two parts (ranks 3 and 1) next to the group of all four
GROUPS = {2: [(1, 0)], 4: [(2, 0, 3, 1), (3, 1)]}


def _data(k: int, seed: int, shape: tuple[int, ...] = SHAPE) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-9, 10, shape, generator=g).double() for _ in range(k)]


def _forward(group: PartGroup, k: int) -> list[tuple[str, torch.Tensor, torch.Tensor,
                                                     torch.Tensor | None]]:
    """What part ``group.index`` computes: ``(name, input leaf, result, upstream gradient
    of the result)``, the same on a ThreadPartGroup and a ProcessPartGroup."""
    p = group.index
    xs = _data(k, 1)
    found = []

    x = xs[p].clone().requires_grad_(True)
    found.append(("sum", x, group.all_reduce(x, "sum"), _data(k, 2)[p]))
    x = xs[p].clone().requires_grad_(True)
    found.append(("max", x, group.all_reduce(x, "max"), None))
    x = xs[p].clone().requires_grad_(True)
    found.append(("gather", x, group.all_gather(x), _data(k, 3, (k, *SHAPE))[p]))
    s = torch.tensor(float(p * 3 - 4), dtype=torch.float64, requires_grad=True)
    up = torch.arange(1.0, k + 1, dtype=torch.float64) * (p + 1)
    found.append(("gather 0-d", s, group.all_gather(s), up))  # the parts' values, a vector
    x = xs[p].clone().requires_grad_(True)  # a ring shift: to the next part, from the last
    found.append(("shift", x, group.send_recv(x, (p + 1) % k, (p - 1) % k), _data(k, 4)[p]))
    x = xs[p].clone().requires_grad_(True)  # a permutation: swap pairs of parts
    found.append(("swap", x, group.send_recv(x, p ^ 1, p ^ 1), _data(k, 5)[p]))
    send, recv = _splits(p, k), [_splits(q, k)[p] for q in range(k)]
    x = _data(k, 6, (sum(send), 2))[p].requires_grad_(True)
    found.append(("all_to_all", x, group.all_to_all(x, send, recv),
                  _data(k, 7, (sum(recv), 2))[p]))
    return found


def _splits(p: int, k: int) -> list[int]:
    """The rows part ``p`` sends each part: uneven, some none (as an expert with no token)."""
    return [(p + 2 * q) % 3 for q in range(k)]


def _program(group: PartGroup, k: int) -> dict[str, torch.Tensor]:
    """One process's part: its results, and its input's gradients from backward passes
    that every part runs (the collectives' adjoints talk to the other parts)."""
    out: dict[str, torch.Tensor] = {"index": torch.tensor(group.index),
                                    "size": torch.tensor(group.size)}
    for name, x, y, up in _forward(group, k):
        out[name] = y.detach()
        out[f"{name} requires grad"] = torch.tensor(y.requires_grad)
        if up is not None:
            (out[f"{name} grad"],) = torch.autograd.grad(y, x, up)
    return out


def _reference(k: int) -> list[dict[str, torch.Tensor]]:
    """The same in one process: the parts as threads (run_parts), then one backward over
    every part's results."""
    parts = run_parts([lambda g, k=k: (g.index, g.size, _forward(g, k)) for _ in range(k)])
    outs = [{"index": torch.tensor(i), "size": torch.tensor(n)} for i, n, _ in parts]
    for e, (name, _, _, up) in enumerate(parts[0][2]):
        for out, (_, _, found) in zip(outs, parts, strict=True):
            out[name] = found[e][2].detach()
            out[f"{name} requires grad"] = torch.tensor(found[e][2].requires_grad)
        if up is not None:
            total = sum((found[e][3] * found[e][2]).sum() for _, _, found in parts)
            grads = torch.autograd.grad(total, [found[e][1] for _, _, found in parts])
            for out, g in zip(outs, grads, strict=True):
                out[f"{name} grad"] = g
    return outs


def _run(rank: int, world_size: int) -> list[dict[str, torch.Tensor] | None]:
    from nnscaler.runtime import ensure_groups
    from nnscaler.runtime.partgroup import ProcessPartGroup

    ensure_groups(GROUPS[world_size])  # collective: every rank, in the same order
    found: list[dict[str, torch.Tensor] | None] = []
    for ranks in GROUPS[world_size]:
        if rank not in ranks:
            found.append(None)
            continue
        group = ProcessPartGroup(ranks)
        assert group.index == ranks.index(rank) and group.size == len(ranks)
        assert f"ranks={list(ranks)}" in repr(group)
        found.append(_program(group, len(ranks)))
    return found


@pytest.mark.parametrize("world_size", [2, 4])
def test_process_part_group_matches_thread_part_group(world_size):
    results = run_distributed(_run, world_size)
    for g, ranks in enumerate(GROUPS[world_size]):
        want = _reference(len(ranks))
        for rank, per_group in enumerate(results):
            got = per_group[g]
            if rank not in ranks:
                assert got is None
                continue
            expected = want[ranks.index(rank)]
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                assert torch.equal(got[name], value), (
                    f"{name} of rank {rank} in group {ranks}:\n{got[name]}\n!=\n{value}")
    # the reference itself is what the convention says
    k = len(GROUPS[world_size][0])
    ref = _reference(k)
    xs, gs, ups = _data(k, 1), _data(k, 2), _data(k, 3, (k, *SHAPE))
    for p, r in enumerate(ref):
        assert torch.equal(r["sum"], sum(xs)) and torch.equal(r["sum grad"], sum(gs))
        assert torch.equal(r["max"], torch.stack(xs).amax(0))
        assert not r["max requires grad"] and r["sum requires grad"]
        assert torch.equal(r["gather"], torch.stack(xs))
        assert torch.equal(r["gather grad"], sum(u[p] for u in ups))
        # slot p of every part's vector, weighted (p + 1) * (q + 1) by part q
        want = float((p + 1) * sum(q + 1 for q in range(k)))
        assert torch.equal(r["gather 0-d grad"], torch.tensor(want, dtype=torch.float64))
        assert torch.equal(r["shift"], xs[(p - 1) % k])  # the gradient comes back from p + 1
        assert torch.equal(r["shift grad"], _data(k, 4)[(p + 1) % k])
        assert torch.equal(r["swap"], xs[p ^ 1]) and torch.equal(r["swap grad"], _data(k, 5)[p ^ 1])
        # part p receives, from each part q in order, the block q sent to p
        blocks = [torch.split(_data(k, 6, (sum(_splits(q, k)), 2))[q], _splits(q, k))[p]
                  for q in range(k)]
        assert torch.equal(r["all_to_all"], torch.cat(blocks))


def _single_and_errors(rank: int, world_size: int) -> list[str]:
    from nnscaler.ops.partgroup import PartGroupError
    from nnscaler.runtime.partgroup import ProcessPartGroup

    messages = []
    for ranks in ([1 - rank], [0, 0, 1], []):
        try:
            ProcessPartGroup(ranks)
            messages.append("accepted")
        except ValueError as e:
            messages.append(str(e))
    alone = ProcessPartGroup([rank])  # a group of one part: no communication
    x = torch.tensor([1.0, -2.0], requires_grad=True)
    assert alone.size == 1 and alone.index == 0
    assert torch.equal(alone.all_gather(x).detach(), x.detach().unsqueeze(0))
    assert not alone.all_reduce(x, "max").requires_grad
    (alone.all_reduce(x) * 3).sum().backward()
    assert torch.equal(x.grad, torch.tensor([3.0, 3.0]))
    # rank given explicitly; a bad reduce op is refused before any communication
    assert ProcessPartGroup([1, 0], rank=0).index == 1
    try:
        ProcessPartGroup([0, 1]).all_reduce(x, "mean")
    except PartGroupError as e:
        messages.append(str(e))
    assert alone.all_to_all(x, [2], [2]) is x
    for send, recv in (([1, 0], [1, 1]), ([2], [2])):
        try:
            ProcessPartGroup([0, 1]).all_to_all(x, send, recv)
        except PartGroupError as e:
            messages.append(str(e))
    return messages


def test_process_part_group_rejects_ranks_without_this_rank():
    for rank, messages in enumerate(run_distributed(_single_and_errors, 2)):
        other = 1 - rank
        assert messages[0] == (f"ProcessPartGroup: the ranks [{other}] must be distinct and "
                               f"include this process's rank {rank}")
        assert "[0, 0, 1] must be distinct" in messages[1]
        assert f"the ranks [] must be distinct and include this process's rank {rank}" in messages[2]
        assert "op must be one of ('sum', 'max'), got 'mean'" in messages[3]
        assert "the send sizes [1, 0] add up to 1 rows but x has 2" in messages[4]
        assert "one send and one receive size per part (2 parts); got 1" in messages[5]
