"""torch.nn.functional: softmax, norms, embedding, attention, convolutions, losses, pad."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nnscaler.anno import PromiseBrokenError, ValuePartial, check_promise
from nnscaler.ops.builtin import attention, conv, loss, nn, norm
from nnscaler.ops.registry import OpRegistry
from nnscaler.ops.verify import verify_op

T = torch.Tensor


@pytest.fixture(scope="module")
def registry() -> OpRegistry:
    r = OpRegistry()
    for family in (nn, norm, loss, conv, attention):
        family.register(r)
    return r


def anno(registry: OpRegistry, fn, *args, **kwargs) -> str:
    return str(registry.lookup(fn).annotation_for(args, kwargs))


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def splits(transforms) -> set[str]:
    return {t.ident for t in transforms}


def test_every_submodule_registers(registry):
    for fn in (F.layer_norm, F.cross_entropy, F.conv2d, F.scaled_dot_product_attention):
        assert registry.lookup(fn) is not None


def test_softmax(registry):
    x = randn(2, 3, 4)
    assert anno(registry, F.softmax, x, -1) == "a b c^ -> a b c^"
    # torch's legacy implicit dim: 0 for 0-, 1- and 3-d inputs, else 1
    with pytest.warns(UserWarning):
        assert anno(registry, F.softmax, x) == "a^ b c -> a^ b c"
        assert anno(registry, F.softmax, randn(2, 3)) == "a b^ -> a b^"
        verify_op(registry.lookup(F.softmax), (x,))
    assert anno(registry, F.log_softmax, x, dim=0, dtype=torch.float32) == "a^ b c -> a^ b c"
    assert registry.lookup(T.softmax) is registry.lookup(torch.softmax)
    assert registry.lookup(torch.softmax) is not registry.lookup(F.softmax)
    # torch.softmax(input, dim, dtype): a positional dtype is not F.softmax's _stacklevel
    op = registry.lookup(torch.softmax)
    call = op.bind((x, 1, torch.float32), {})
    assert call.run().dtype == torch.float32
    assert splits(verify_op(op, (x, 1, torch.float32))) == {"a", "c"}
    with pytest.raises(PromiseBrokenError):
        check_promise(lambda t: t.softmax(-1), "a b c -> a b c", (x,))


def test_layer_norm_and_rms_norm(registry):
    x, w, b = randn(2, 3, 4), randn(3, 4), randn(3, 4)
    assert anno(registry, F.layer_norm, x, (3, 4), w, b) == "a b^ c^, ?, b^ c^, b^ c^ -> a b^ c^"
    assert anno(registry, F.layer_norm, x, [4]) == "a b c^, ?, ?, ? -> a b c^"
    assert anno(registry, F.rms_norm, x, [4], randn(4)) == "a b c^, ?, c^ -> a b c^"
    assert splits(verify_op(registry.lookup(F.layer_norm), (x, [4], randn(4), randn(4)))) == {"a", "b"}


def test_batch_norm_training_uses_batch_statistics(registry):
    x, mean, var = randn(4, 6, 2), randn(6), randn(6).abs() + 0.5
    op = registry.lookup(F.batch_norm)
    assert anno(registry, F.batch_norm, x, mean, var, training=True) == "a^ b c^, b, b, ?, ? -> a^ b c^"
    assert anno(registry, F.batch_norm, x, mean, var, randn(6)) == "a b c, b, b, b, ? -> a b c"
    assert splits(verify_op(op, (x, mean, var), {"training": True})) == {"b"}
    assert splits(verify_op(op, (x, mean, var), {"weight": randn(6)})) == {"a", "b", "c"}
    # the running statistics are not changed across the runs of the check
    assert anno(registry, F.instance_norm, x) == "a b c^, ?, ?, ?, ? -> a b c^"
    assert anno(registry, F.group_norm, x, 2) == "a b^ c^, ?, ?, ? -> a b^ c^"


def test_embedding(registry):
    idx, w = torch.tensor([[0, 3], [2, 1]]), randn(5, 8)
    # a part of the vocabulary must mask the tokens it does not hold: V^, and a rule
    assert anno(registry, F.embedding, idx, w) == "a b, V^ E -> a b E"
    assert anno(registry, F.embedding, idx, w, max_norm=1.0) == "a b, V^ E^ -> a b E^"
    assert anno(registry, F.embedding, torch.tensor(2), w) == "1, V^ E -> E"
    op = registry.lookup(F.embedding)
    found = verify_op(op, (idx, w), {"padding_idx": 0})
    assert splits(found) == {"a", "b", "E", "V"}
    by_rows = [t for t in found if t.ident == "V"]
    assert {t.part_op for t in by_rows} == {nn.ROW_PARALLEL_EMBEDDING}
    assert {str(t.outputs[0]) for t in by_rows} == {str(ValuePartial())}
    # max_norm renormalizes the table in place: no split of the table at all
    assert splits(verify_op(op, (idx, w), {"max_norm": 1.0})) == {"a", "b"}


def test_sdpa_grouped_query_attention(registry):
    op = registry.lookup(F.scaled_dot_product_attention)
    q, k, v = randn(2, 6, 4, 8), randn(2, 2, 5, 8), randn(2, 2, 5, 4)
    mask = torch.rand(2, 6, 4, 5) > 0.3
    mask[..., 0] = True
    a = anno(registry, F.scaled_dot_product_attention, q, k, v, mask, enable_gqa=True)
    assert a == "b0 (h r) l e^, b0 h s^ e^, b0 h s^ f, b0 (h r) l s^ -> b0 (h r) l f"
    ts = verify_op(op, (q, k, v, mask), {"enable_gqa": True})
    assert {"b0", "h", "l", "f"} == splits(ts)
    # query heads 0..2 read key head 0: splitting the query heads alone breaks the promise
    with pytest.raises(PromiseBrokenError):
        check_promise(
            lambda *t: F.scaled_dot_product_attention(*t, enable_gqa=True),
            "b0 hq l e^, b0 h s^ e^, b0 h s^ f -> b0 hq l f", (q, k, v),
        )


def test_sdpa_causal_freezes_the_query_length(registry):
    q, k = randn(2, 4, 6, 8), randn(2, 4, 6, 8)
    assert anno(registry, F.scaled_dot_product_attention, q, k, k, is_causal=True) == (
        "b0 b1 l^ e^, b0 b1 s^ e^, b0 b1 s^ f, ? -> b0 b1 l^ f"
    )
    verify_op(registry.lookup(F.scaled_dot_product_attention), (q, k, k), {"is_causal": True})
    with pytest.raises(PromiseBrokenError):  # the causal mask is aligned to the whole matrix
        check_promise(
            lambda *t: F.scaled_dot_product_attention(*t, is_causal=True),
            "b0 b1 l e^, b0 b1 s^ e^, b0 b1 s^ f -> b0 b1 l f", (q, k, k),
        )


def test_conv2d(registry):
    op = registry.lookup(F.conv2d)
    x, w = randn(2, 3, 32, 32), randn(16, 3, 8, 8)
    # a ViT patch embedding: the windows tile the image, so the patch rows/cols split
    assert anno(registry, F.conv2d, x, w, randn(16), stride=8) == (
        "n c^ (t0 8) (t1 8), o c^ k0^ k1^, o -> n o t0 t1"
    )
    assert anno(registry, F.conv2d, x, randn(4, 3, 3, 3), None, 1, 1) == (
        "n c+ s0^ s1^, o c+ k0^ k1^, ? -> n o 32 32"
    )
    small = randn(2, 4, 6, 6)
    ts = verify_op(op, (small, randn(6, 2, 3, 3)), {"groups": 2, "padding": 1})
    assert splits(ts) == {"n", "groups"}
    assert all(t.kwarg_updates == {"groups": 1} for t in ts if t.ident == "groups")
    assert "c" in splits(verify_op(op, (small, randn(2, 4, 3, 3))))


def test_cross_entropy_reductions(registry):
    x, y = randn(4, 5), torch.tensor([1, -100, 3, 0])
    ce = registry.lookup(F.cross_entropy)
    assert anno(registry, F.cross_entropy, x, y, reduction="sum") == "a+ b^, a+, ? -> 1"
    assert anno(registry, F.cross_entropy, x, y) == "a^ b^, a^, ? -> 1"
    assert anno(registry, F.cross_entropy, x, y, reduce=False) == "a b^, a, ? -> a"
    assert anno(registry, F.cross_entropy, randn(4, 5, 6), x.softmax(-1).unsqueeze(-1).expand(4, 5, 6).contiguous(),
                weight=randn(5).abs(), reduction="none") == "a b^ c, a b^ c, b^ -> a c"
    ts = verify_op(ce, (x, y), {"reduction": "sum", "label_smoothing": 0.1, "weight": randn(5).abs()})
    assert splits(ts) == {"a"} and all(t.outputs == (ValuePartial(),) for t in ts)
    # 'mean' divides by the count of non-ignored targets in the part
    with pytest.raises(PromiseBrokenError):
        check_promise(F.cross_entropy, "a+ b^, a+ -> 1", (x, y))


def test_elementwise_losses(registry):
    x, t = randn(4, 6), randn(4, 6)
    assert anno(registry, F.mse_loss, x, t, reduction="sum") == "a+ b+, a+ b+ -> 1"
    assert anno(registry, F.mse_loss, x, t, weight=t.abs()) == "a^ b^, a^ b^, ?, ?, ?, a^ b^ -> 1"
    assert anno(registry, F.kl_div, x, t, reduction="batchmean") == "a^ b+, a^ b+ -> 1"
    assert anno(registry, F.binary_cross_entropy_with_logits, x, t.sigmoid(), pos_weight=randn(6)) == (
        "a^ b^, a^ b^, ?, ?, ?, ?, b^ -> 1"
    )
    ts = verify_op(registry.lookup(F.kl_div), (x.log_softmax(-1), t.softmax(-1)),
                   {"reduction": "batchmean"})
    assert splits(ts) == {"b"}


def test_pad_one_hot_glu_dropout(registry):
    x = randn(2, 3, 4)
    assert anno(registry, F.pad, x, (1, 2)) == "a b c^ -> a b 7"
    assert anno(registry, F.pad, x, (0, 0, 1, 0), mode="replicate") == "a b^ c -> a 4 c"
    assert anno(registry, F.one_hot, torch.tensor([0, 2]), 4) == "a -> a 4"
    assert anno(registry, F.one_hot, torch.tensor([0, 2])) == "a^ -> a^ 3"  # from the data
    assert anno(registry, F.glu, x, 1) == "a b^ c -> a 1 c"
    assert anno(registry, F.dropout, x, 0.1) == "a b c -> a b c"
    assert registry.lookup(torch.dropout).name == "torch.dropout"
    verify_op(registry.lookup(F.pad), (x, (1, 1, 1, 1)), {"mode": "reflect"})
