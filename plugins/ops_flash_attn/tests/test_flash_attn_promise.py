"""The annotations keep their promise: splitting batch or heads and recombining the parts
gives the whole result (``nnscaler.ops.verify.verify_op``), on random small calls."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nnscaler_ops_flash_attn.annotations import OPS

from nnscaler.anno import Split
from nnscaler.ops.verify import verify_op
from nnscaler.plugins import NNScalerPluginManager

_PM = NNScalerPluginManager(autoload=True)
OP_DEFS = [_PM.ops.get(spec.name) for spec in OPS]

_SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("opdef", OP_DEFS, ids=lambda op: op.name)
@_SETTINGS
@given(rng=st.randoms(use_true_random=False))
def test_annotation_promise(opdef, rng: random.Random):
    args, kwargs = opdef.input_gen_fn(rng)
    verify_op(opdef, args, kwargs)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float32)


def _split_idents(transforms) -> set[str]:
    return {t.ident for t in transforms}


def test_gqa_causal_rectangular_splits_batch_and_whole_groups():
    torch.manual_seed(0)
    opdef = _PM.ops.get("flash_attn.flash_attn_func")
    for seqlens in ((3, 7), (7, 3)):
        q = _randn(4, seqlens[0], 12, 4)
        k, v = _randn(4, seqlens[1], 4, 4), _randn(4, seqlens[1], 4, 4)
        done = verify_op(opdef, (q, k, v), {"causal": True})
        assert _split_idents(done) == {"b", "h"}
        nums = {t.num for t in done if t.ident == "h"}
        assert nums == {2, 4}  # 4 kv heads: 2 or 4 parts, each with whole groups of 3
        for t in done:  # the sequence and head dims never split
            assert all(
                not isinstance(layout, Split) or layout.dim in (0, 2) for layout in t.inputs[:3]
            )


def test_mqa_splits_query_heads_and_replicates_kv():
    opdef = _PM.ops.get("flash_attn.flash_attn_func")
    q, k, v = _randn(1, 4, 6, 8), _randn(1, 5, 1, 8), _randn(1, 5, 1, 8)
    done = verify_op(opdef, (q, k, v), {"causal": True, "window_size": (2, -1)})
    assert {t.num for t in done} == {2, 3, 6}
    assert all(str(t.inputs[1]) == "R" for t in done)


def test_alibi_slopes_split_with_heads():
    opdef = _PM.ops.get("flash_attn.flash_attn_func")
    q, k, v = _randn(2, 3, 4, 8), _randn(2, 6, 2, 8), _randn(2, 6, 2, 8)
    for slopes in (torch.rand(4), torch.rand(2, 4)):
        done = verify_op(opdef, (q, k, v), {"alibi_slopes": slopes, "causal": True})
        assert _split_idents(done) == {"b", "h"}


def test_varlen_splits_heads_only():
    opdef = _PM.ops.get("flash_attn.flash_attn_varlen_func")
    cu_q = torch.tensor([0, 2, 7, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    q, k, v = _randn(8, 8, 4), _randn(9, 2, 4), _randn(9, 2, 4)
    done = verify_op(
        opdef, (q, k, v, cu_q, cu_k, 5, 5), {"causal": True, "alibi_slopes": torch.rand(3, 8)}
    )
    assert _split_idents(done) == {"h"}
    assert {t.num for t in done} == {2}


def test_return_attn_probs_is_annotated_whole():
    opdef = _PM.ops.get("flash_attn.flash_attn_func")
    q = _randn(2, 3, 4, 8)
    call = opdef.bind((q, q, q), {"return_attn_probs": True})
    bound = call.anno.bind(call.shapes(), call.kwargs)
    assert bound.transform_space() == []
    assert len(call.anno.outputs) == 3
