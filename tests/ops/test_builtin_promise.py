"""Every built-in annotation keeps its promise on random calls.

For each op registered by the built-in plugin, hypothesis draws calls with the op's
``input_gen_fn``; the op runs on whole inputs and on the pieces of every transform of its
space, and the recombined pieces must equal the whole result (``verify_op``). Shape
inference must equal the real output shapes (checked inside ``verify_op``).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnscaler.ops.verify import verify_op
from nnscaler.plugins import NNScalerPluginManager

_PM = NNScalerPluginManager(autoload=False)
BUILTIN_OPS = [
    _PM.ops.get(n) for n in _PM.ops.by_registrant("nnscaler.ops.builtin")
]


def test_every_builtin_op_can_generate_inputs():
    missing = [op.name for op in BUILTIN_OPS if op.input_gen_fn is None]
    assert not missing, f"built-in ops without input_gen_fn: {missing}"


@pytest.mark.parametrize("opdef", BUILTIN_OPS, ids=lambda op: op.name)
@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(rng=st.randoms(use_true_random=False))
def test_annotation_promise(opdef, rng):
    if opdef.input_gen_fn is None:
        pytest.skip("no input generator")
    args, kwargs = opdef.input_gen_fn(rng)
    verify_op(opdef, args, kwargs)
