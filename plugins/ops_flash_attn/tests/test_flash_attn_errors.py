"""Bad calls fail with a message that names the function, the arguments and the rule,
both when called and when the tracer binds the call to the op's annotation."""

from __future__ import annotations

import pytest
import torch
from nnscaler_ops_flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
)

from nnscaler.plugins import NNScalerPluginManager

_PM = NNScalerPluginManager(autoload=True)


def _raises_both(op: str, fn, args, kwargs, exc, match: str) -> None:
    """The call and the op's annotation (what the tracer binds) raise the same error."""
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    with pytest.raises(exc, match=match):
        _PM.ops.get(op).bind(args, kwargs)


DENSE_CASES = {
    "heads_not_divisible": (
        (torch.randn(2, 3, 6, 8), torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)),
        {},
        ValueError,
        r"q has 6 heads and k/v has 4; the number of query heads must be divisible",
    ),
    "more_kv_heads_than_q": (
        (torch.randn(2, 3, 2, 8), torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)),
        {},
        ValueError,
        r"q has 2 heads and k/v has 4",
    ),
    "head_dims_differ": (
        (torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 16), torch.randn(2, 3, 4, 16)),
        {},
        ValueError,
        r"head dims differ: q has 8, k has 16, v has 16",
    ),
    "v_head_dim_differs": (
        (torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 4)),
        {},
        ValueError,
        r"head dims differ: q has 8, k has 8, v has 4",
    ),
    "wrong_rank": (
        (torch.randn(2, 3, 32), torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)),
        {},
        ValueError,
        r"q must have 4 dims \(batch, seqlen, nheads, headdim\), got shape \(2, 3, 32\)",
    ),
    "batch_mismatch": (
        (torch.randn(2, 3, 4, 8), torch.randn(3, 3, 4, 8), torch.randn(3, 3, 4, 8)),
        {},
        ValueError,
        r"q and k/v must have the same batch size, got q \(2, 3, 4, 8\) and k \(3, 3, 4, 8\)",
    ),
    "k_v_mismatch": (
        (torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8), torch.randn(2, 5, 4, 8)),
        {},
        ValueError,
        r"k and v must agree",
    ),
    "dtype_mismatch": (
        (torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8).double(), torch.randn(2, 3, 4, 8)),
        {},
        TypeError,
        r"q, k and v must have one dtype",
    ),
    "alibi_shape": (
        (torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8)),
        {"alibi_slopes": torch.rand(2)},
        ValueError,
        r"alibi_slopes must have shape \(nheads,\) = \(4,\) or \(batch, nheads\) = \(2, 4\), got \(2,\)",
    ),
    "window_size": (
        (torch.randn(2, 3, 4, 8),) * 3,
        {"window_size": 4},
        ValueError,
        r"window_size must be a pair of ints",
    ),
    "dropout": (
        (torch.randn(2, 3, 4, 8),) * 3,
        {"dropout_p": 1.0},
        ValueError,
        r"dropout_p must be a float in \[0, 1\)",
    ),
    "softcap": (
        (torch.randn(2, 3, 4, 8),) * 3,
        {"softcap": -1.0},
        ValueError,
        r"softcap must be a float >= 0",
    ),
    "not_a_tensor": (
        ([[1.0]], torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)),
        {},
        TypeError,
        r"q must be a torch.Tensor",
    ),
}


@pytest.mark.parametrize("case", sorted(DENSE_CASES))
def test_dense_errors(case: str):
    args, kwargs, exc, match = DENSE_CASES[case]
    _raises_both(
        "flash_attn.flash_attn_func",
        flash_attn_func,
        args,
        kwargs,
        exc,
        "flash_attn_func: " + match,
    )


PACKED_CASES = {
    "qkv_dim_2": (
        flash_attn_qkvpacked_func,
        (torch.randn(2, 3, 2, 4, 8),),
        r"dim 2 of qkv must have size 3",
    ),
    "kv_heads_not_divisible": (
        flash_attn_kvpacked_func,
        (torch.randn(2, 3, 6, 8), torch.randn(2, 3, 2, 4, 8)),
        r"q has 6 heads and k/v has 4",
    ),
}


@pytest.mark.parametrize("case", sorted(PACKED_CASES))
def test_packed_errors(case: str):
    fn, args, match = PACKED_CASES[case]
    name = fn.__name__
    _raises_both(f"flash_attn.{name}", fn, args, {}, ValueError, f"{name}: " + match)


def _cu(*offsets: int) -> torch.Tensor:
    return torch.tensor(offsets, dtype=torch.int32)


def _varlen_args(q_shape=(5, 2, 8), kv_shape=(5, 2, 8), cu_seqlens_q=None) -> tuple:
    """A varlen call on one sequence of 5 tokens, with the given shapes and ``cu_seqlens_q``."""
    cu_q = _cu(0, 5) if cu_seqlens_q is None else cu_seqlens_q
    k, v = torch.randn(*kv_shape), torch.randn(*kv_shape)
    return (torch.randn(*q_shape), k, v, cu_q, _cu(0, 5), 5, 5)


VARLEN_CASES = {
    "heads_not_divisible": (
        _varlen_args(q_shape=(5, 3, 8)),
        ValueError,
        r"q has 3 heads and k/v has 2",
    ),
    "head_dims_differ": (
        _varlen_args(kv_shape=(5, 2, 4)),
        ValueError,
        r"head dims differ: q has 8, k has 4",
    ),
    "dense_layout": (
        _varlen_args(q_shape=(1, 5, 2, 8)),
        ValueError,
        r"q must have 3 dims \(total_q, nheads, headdim\)",
    ),
    "sequence_counts_differ": (
        _varlen_args(cu_seqlens_q=_cu(0, 2, 5)),
        ValueError,
        r"cu_seqlens_q describes 2 sequences and cu_seqlens_k 1",
    ),
    "float_offsets": (
        _varlen_args(cu_seqlens_q=torch.tensor([0.0, 5.0])),
        TypeError,
        r"cu_seqlens_q must hold integers",
    ),
}


@pytest.mark.parametrize("case", sorted(VARLEN_CASES))
def test_varlen_errors(case: str):
    args, exc, match = VARLEN_CASES[case]
    _raises_both(
        "flash_attn.flash_attn_varlen_func",
        flash_attn_varlen_func,
        args,
        {},
        exc,
        "flash_attn_varlen_func: " + match,
    )


def test_varlen_offsets_are_checked_when_run():
    q = torch.randn(5, 2, 8)
    with pytest.raises(
        ValueError, match=r"cu_seqlens_q must be non-decreasing offsets within \[0, 5\]"
    ):
        flash_attn_varlen_func(q, q, q, _cu(0, 3, 2), _cu(0, 2, 5), 5, 5)
    with pytest.raises(
        ValueError, match=r"cu_seqlens_k must be non-decreasing offsets within \[0, 5\]"
    ):
        flash_attn_varlen_func(q, q, q, _cu(0, 5), _cu(0, 6), 5, 6)
    with pytest.raises(ValueError, match=r"a sequence of length 4 but max_seqlen_q=3"):
        flash_attn_varlen_func(q, q, q, _cu(0, 1, 5), _cu(0, 2, 5), 3, 3)
