"""Each error the tracer raises: the rule, the value seen and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from nnscaler.ops.registry import op_call_interceptor
from nnscaler.trace import (
    DataDependentError,
    ForwardSignatureError,
    MetaTraceError,
    OpaqueOpWarning,
    TraceError,
    trace,
)


class PositionalOnly(nn.Module):
    def forward(self, x, /):
        return x * 2


class VarArgs(nn.Module):
    def forward(self, x, *rest):
        return x * 2


class TwoArgs(nn.Module):
    def forward(self, x, y, scale=1.0):
        return x * y * scale


class AnyKwargs(nn.Module):
    def forward(self, x, **kwargs):
        return x * len(kwargs)


@pytest.mark.parametrize(
    ("module", "args", "match"),
    [
        (PositionalOnly(), {"x": torch.ones(2)}, r"positional-only argument 'x'.*remove the '/'"),
        (VarArgs(), {"x": torch.ones(2)}, r"takes '\*rest'.*declare each argument by name"),
        (TwoArgs(), {"x": torch.ones(2)}, r"requires the argument\(s\) 'y'.*add a dummy value"),
        (TwoArgs(), {"x": torch.ones(2), "y": 1, "z": 2, "w": 3},
         r"has 'z', 'w', which TwoArgs.forward does not take; its arguments are "
         r"\['x', 'y', 'scale'\]"),
        (TwoArgs(), (torch.ones(2), torch.ones(2)), r"must be a dict keyed by the argument names"),
        (TwoArgs(), {0: torch.ones(2)}, r"got the keys \[0\], which are not strings"),
    ],
    ids=["positional-only", "varargs", "missing", "unknown", "not-a-dict", "not-str-keys"],
)
def test_dummy_args_that_do_not_fit_the_signature(module, args, match):
    with pytest.raises(ForwardSignatureError, match=match) as info:
        trace(module, args)
    assert isinstance(info.value, TypeError)


def test_var_keyword_forward_accepts_any_name():
    graph = trace(AnyKwargs(), {"x": torch.ones(2), "extra": 1})
    assert list(graph.inputs) == ["x", "extra"] and graph.ops[0].inputs[1] == 1


def test_bad_strategy_and_bad_module():
    with pytest.raises(ValueError, match=r"strategy must be one of \('real', 'meta'\), got 'cuda'"):
        trace(TwoArgs(), {"x": torch.ones(2), "y": torch.ones(2)}, strategy="cuda")
    with pytest.raises(TypeError, match="trace needs a torch.nn.Module, got function"):
        trace(lambda x: x, {"x": torch.ones(2)})


class ReadsItem(nn.Module):
    def forward(self, x):
        n = int(x.sum().item())
        return x * n


class BranchesOnData(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class MasksByData(nn.Module):
    def forward(self, x):
        return x[x > 0].sum()


@pytest.mark.parametrize(
    ("module", "what"),
    [(ReadsItem(), "torch.Tensor.item"), (BranchesOnData(), "torch.Tensor.__bool__")],
)
def test_meta_strategy_rejects_values_read_from_data(module, what):
    with pytest.raises(DataDependentError) as info:
        trace(module, {"x": torch.ones(3)}, strategy="meta")
    message = str(info.value)
    assert message.startswith(f"{what} reads a Python value from tensor data at {__file__}:")
    assert "control flow depend on data" in message and "trace_strategy='real'" in message
    trace(module, {"x": torch.ones(3)}, strategy="real")  # fine with real values


def test_meta_strategy_failure_names_the_op_and_the_fix():
    with pytest.raises(MetaTraceError, match=r"failed on the meta device at .*test_errors.py:\d+ "
                       r"\('return x\[x > 0\].sum\(\)'\).*strategy='real'"):
        trace(MasksByData(), {"x": torch.ones(3)}, strategy="meta")


def my_double(x: torch.Tensor) -> torch.Tensor:
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(my_double, (x,), x)
    return x * 2


class CallsMyDouble(nn.Module):
    def forward(self, x):
        return my_double(x) + 1


def test_a_users_wrong_annotation_is_an_error(fresh_plugins):
    import nnscaler

    wrong = nnscaler.register_op("a -> a a")(my_double)

    class Uses(nn.Module):
        def forward(self, x):
            return wrong(x)

    with pytest.raises(TraceError, match=r"annotation of op '.*my_double' does not fit its call "
                       r"at .*test_errors.py:\d+ \(input shapes \[3\]\).*gives output 0 the "
                       r"shape \[3, 3\] but the call returned \[3\].*Fix the annotation"):
        trace(Uses(), {"x": torch.ones(3)})


def test_a_plugins_wrong_annotation_falls_back_to_opaque(fresh_plugins):
    fresh_plugins.get_plugin_manager().ops.register(my_double, "a b -> a b", registrant="plugin-x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = trace(CallsMyDouble(), {"x": torch.ones(3)})
    (warning,) = [w for w in caught if issubclass(w.category, OpaqueOpWarning)]
    assert "(registered by 'plugin-x') does not fit its call" in str(warning.message)
    assert graph.ops[0].is_opaque


class Fails(nn.Module):
    def forward(self, x):
        return x @ torch.ones(5, 5)


def test_an_error_in_forward_propagates_and_leaves_no_hooks_behind():
    from torch.nn.modules import module as module_mod

    hooks = (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        trace(Fails(), {"x": torch.ones(2, 3)})
    assert (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks)) == hooks
    assert op_call_interceptor.get() is None
    assert Fails()(torch.ones(2, 5)).shape == (2, 5)  # no tracing mode left active
