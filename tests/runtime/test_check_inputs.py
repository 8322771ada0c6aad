"""``boundary.check_inputs``: a value passes exactly when it is what was traced (tensors:
same shape and dtype; Python values: equal, ``True`` is not ``1``), and a refusal names
the argument, the traced value and the seen one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nnscaler.runtime import boundary
from nnscaler.runtime.module import ParallelModuleError

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.bool]
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(traced=shapes, seen=shapes, traced_dtype=st.sampled_from(DTYPES),
       seen_dtype=st.sampled_from(DTYPES))
def test_tensors_pass_exactly_when_shape_and_dtype_match(traced, seen, traced_dtype, seen_dtype):
    value = torch.zeros(seen, dtype=seen_dtype)
    same = traced == seen and traced_dtype == seen_dtype
    try:
        boundary.check_inputs({"batch['x']": (value, traced, traced_dtype)})
    except ParallelModuleError as e:
        assert not same
        message = str(e)
        assert f"\"batch['x']\" is a tensor of shape {list(seen)} and dtype {seen_dtype}" in message
        assert f"parallelized with a tensor of shape {list(traced)} and dtype {traced_dtype}" \
            in message
        assert ("cast it with" in message) == (seen_dtype != traced_dtype)
    else:
        assert same


values = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.5, 2.0]),
                   st.sampled_from(["mean", "sum"]))


@settings(max_examples=80, deadline=None)
@given(traced=values, seen=values)
def test_python_values_pass_exactly_when_equal(traced, seen):
    same = (traced is None and seen is None) or (
        traced is not None and seen is not None
        and isinstance(traced, bool) == isinstance(seen, bool) and traced == seen)
    try:
        boundary.check_inputs({"scale": (seen, traced)})
    except ParallelModuleError as e:
        assert not same
        assert f"'scale' is {seen!r}" in str(e) and f"parallelized with {traced!r}" in str(e)
    else:
        assert same


def test_a_tensor_where_a_value_was_traced_is_refused():
    with pytest.raises(ParallelModuleError, match=r"'mask' is a tensor of shape \[2\].*None"):
        boundary.check_inputs({"mask": (torch.ones(2), None)})
    with pytest.raises(ParallelModuleError, match=r"'x' is None \(NoneType\), but .* a tensor"):
        boundary.check_inputs({"x": (None, (2,), torch.float32)})
