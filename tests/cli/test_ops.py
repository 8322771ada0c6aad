"""chunk_linear_cross_entropy: the unchunked loss and gradients, no whole logits, and an
annotation whose token splits keep their promise."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from nnscaler.cli.ops import OP_NAME, ChunkedLossError, chunk_linear_cross_entropy
from nnscaler.ops.verify import verify_op
from nnscaler.plugins import get_plugin_manager


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), v=st.integers(2, 7), d=st.integers(1, 5),
       chunk=st.integers(1, 10), reduction=st.sampled_from(["mean", "sum", "none"]),
       ignore=st.booleans(), seed=st.integers(0, 2**16))
def test_equals_the_unchunked_loss_and_gradients(n, v, d, chunk, reduction, ignore, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, v, (2, n), generator=g)
    if ignore:
        t[0, 0] = -100
    out = chunk_linear_cross_entropy(h, w, t, reduction=reduction, chunk_size=chunk)
    ref = F.cross_entropy((h @ w.t()).reshape(-1, v), t.reshape(-1), reduction=reduction)
    ref = ref.reshape(t.shape) if reduction == "none" else ref
    torch.testing.assert_close(out, ref)
    up = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (h, w), up)
    want = torch.autograd.grad(ref, (h, w), up)
    torch.testing.assert_close(got, want)


class _Shapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor):
                self.numels.append(x.numel())
        return out


def test_the_whole_logits_never_exist():
    tokens, vocab, d = 64, 50, 4
    h = torch.randn(tokens, d, requires_grad=True)
    w = torch.randn(vocab, d, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,))
    with _Shapes() as seen:
        chunk_linear_cross_entropy(h, w, t, chunk_size=8).backward()
    assert max(seen.numels) <= 8 * vocab < tokens * vocab


def test_annotation_keeps_its_promise_on_random_calls():
    opdef = get_plugin_manager().ops.get(OP_NAME)
    rng = random.Random(0)
    split = 0
    for _ in range(20):
        args, kwargs = opdef.input_gen_fn(rng)
        split += len(verify_op(opdef, args, kwargs))
    assert split > 0   # the token splits were checked


def test_bad_arguments():
    h, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ChunkedLossError, match="target must have hidden's shape"):
        chunk_linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ChunkedLossError, match=r"weight must be \[vocabulary, 4\]"):
        chunk_linear_cross_entropy(h, w.t(), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ChunkedLossError, match="reduction"):
        chunk_linear_cross_entropy(h, w, torch.zeros(3, dtype=torch.long), reduction="avg")


@pytest.mark.parametrize("parts,reduction", [(2, "mean"), (3, "sum"), (4, "none")])
def test_vocabulary_split_gives_the_unchunked_loss_and_gradients(parts, reduction):
    from nnscaler.cli.ops import vocab_parallel_chunk_linear_cross_entropy
    from nnscaler.ops.partgroup import run_parts

    g = torch.Generator().manual_seed(parts)
    vocab = 12
    h = torch.randn(3, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, 4, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, vocab, (3, 5), generator=g)
    t[1, 2] = -100
    rows = vocab // parts
    outs = run_parts([
        lambda group, p=p: vocab_parallel_chunk_linear_cross_entropy(
            h, w[p * rows:(p + 1) * rows], t, reduction, chunk_size=4,
            vocab_start=p * rows, vocab_size=vocab, group=group)
        for p in range(parts)])
    ref = F.cross_entropy((h @ w.t()).reshape(-1, vocab), t.reshape(-1), reduction=reduction)
    ref = ref.reshape(t.shape) if reduction == "none" else ref
    for out in outs:                       # every part holds the whole loss
        torch.testing.assert_close(out, ref)
    up = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    # the output is replicated: its gradient enters through one part (the others' share
    # is zero); the parts' shares of hidden's gradient add up in the leaf
    got = torch.autograd.grad(outs[0], (h, w), up)
    want = torch.autograd.grad(ref, (h, w), up)
    torch.testing.assert_close(got, want)
