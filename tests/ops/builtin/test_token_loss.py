"""``token_parallel_cross_entropy``: a mean cross_entropy split over its tokens, the parts
run as threads, equals the whole loss, with its input gradient (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nnscaler.ops.builtin.token_loss import token_parallel_cross_entropy
from nnscaler.ops.partgroup import run_parts


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", ["plain", "ignored", "weights", "smoothing", "probabilities",
                                  "spatial"])
def test_token_split_matches_the_whole_mean(n, kind):
    g = torch.Generator().manual_seed(n)
    spatial = (3,) if kind == "spatial" else ()
    x = torch.randn(6, 5, *spatial, generator=g, dtype=torch.float64)
    target = torch.randint(0, 5, (6, *spatial), generator=g)
    kw = {}
    if kind == "ignored":
        target[:3] = -100  # one part's tokens all ignored: its count is 0
    if kind == "weights":
        kw["weight"] = torch.rand(5, generator=g, dtype=torch.float64) + 0.1
    if kind == "smoothing":
        kw["label_smoothing"] = 0.2
    if kind == "probabilities":
        target = torch.randn(6, 5, generator=g, dtype=torch.float64).softmax(1)
    leaf = x.clone().requires_grad_(True)
    want = F.cross_entropy(leaf, target, **kw)
    (want_grad,) = torch.autograd.grad(want, leaf)
    xs = [c.clone().requires_grad_(True) for c in x.chunk(n)]
    ts = target.chunk(n)
    outs = run_parts([lambda grp, p=p: token_parallel_cross_entropy(xs[p], ts[p], group=grp, **kw)
                      for p in range(n)])
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    shares = [1.0 / n] * n  # the runtime seeds each part's copy of the loss with a share
    grads = torch.autograd.grad(sum(o * s for o, s in zip(outs, shares, strict=True)), xs)
    torch.testing.assert_close(torch.cat(grads), want_grad, rtol=1e-12, atol=1e-12)


def test_the_token_split_is_offered_inside_token_split_only():
    from nnscaler.anno import parse
    from nnscaler.ops.builtin.token_loss import token_split
    from nnscaler.plugins import get_plugin_manager

    opdef = get_plugin_manager().ops.get("torch.nn.functional.cross_entropy")
    x, t = torch.randn(4, 3), torch.randint(0, 3, (4,))
    bound = parse(opdef.annotation(x, t)).bind([tuple(x.shape), tuple(t.shape), None], {})
    outside = [r.part_op for r in opdef.rules_for(bound)]
    with token_split():
        inside = [r.part_op for r in opdef.rules_for(bound)]
    assert "nnscaler.ops.builtin.token_loss.token_parallel_cross_entropy" not in outside
    assert inside == [*outside, "nnscaler.ops.builtin.token_loss.token_parallel_cross_entropy"]
