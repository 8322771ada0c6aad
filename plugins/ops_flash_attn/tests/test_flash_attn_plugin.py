"""The plugin is found through its entry point and registers its ops; models call wrappers
that a running tracer records as those ops."""

from __future__ import annotations

import importlib.metadata
import inspect

import nnscaler_ops_flash_attn as fa
import pytest
import torch
from nnscaler_ops_flash_attn import kernels
from nnscaler_ops_flash_attn.annotations import OPS

from nnscaler.ops.registry import op_call_interceptor
from nnscaler.plugins import (
    DISABLE_AUTOLOAD_ENV,
    NNScalerPluginManager,
    get_plugin_manager,
    reset_plugin_manager,
)

PLUGIN = "ops_flash_attn"
DIST = "nnscaler-ops-flash-attn"
OP_NAMES = [
    "flash_attn.flash_attn_func",
    "flash_attn.flash_attn_varlen_func",
    "flash_attn.flash_attn_qkvpacked_func",
    "flash_attn.flash_attn_kvpacked_func",
    "flash_attn.flash_attn_segmented_func",
]

#: flash-attn's own parameter lists (flash_attn/flash_attn_interface.py, 2.6+)
_OPTIONS = [
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size",
    "softcap",
    "alibi_slopes",
    "deterministic",
    "return_attn_probs",
]
SIGNATURES = {
    "flash_attn_func": ["q", "k", "v", *_OPTIONS],
    "flash_attn_varlen_func": [
        "q",
        "k",
        "v",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
        *_OPTIONS,
        "block_table",
    ],
    "flash_attn_qkvpacked_func": ["qkv", *_OPTIONS],
    "flash_attn_kvpacked_func": ["q", "kv", *_OPTIONS],
}
#: this plugin's own function: flash_attn_func's options, less ALiBi and the statistics
OWN_SIGNATURES = {
    "flash_attn_segmented_func": [
        "q",
        "k",
        "v",
        "segment_ids",
        "dropout_p",
        "softmax_scale",
        "causal",
        "window_size",
        "softcap",
        "deterministic",
    ],
}


@pytest.fixture
def autoload(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="nnscaler")
    ours = [ep for ep in eps if ep.name == PLUGIN]
    assert len(ours) == 1, f"entry points in group 'nnscaler': {eps}"
    assert ours[0].value == "nnscaler_ops_flash_attn.plugin"
    assert ours[0].dist is not None and ours[0].dist.metadata["Name"] == DIST


def test_manager_lists_plugin_and_ops(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    pm = NNScalerPluginManager()
    info = {p.name: p for p in pm.plugins()}[PLUGIN]
    assert info.distribution == DIST
    assert info.version == importlib.metadata.version(DIST) == fa.__version__
    assert info.module == "nnscaler_ops_flash_attn.plugin"
    assert not info.builtin
    assert pm.contributions(PLUGIN)["ops"] == OP_NAMES
    for name in OP_NAMES:
        assert pm.ops.get(name).registrant == PLUGIN
    report = pm.report()
    assert f"{PLUGIN}  ({DIST} {fa.__version__}" in report
    assert "flash_attn.flash_attn_func" in report


def test_autoload_false_leaves_it_out():
    pm = NNScalerPluginManager(autoload=False)
    assert PLUGIN not in {p.name for p in pm.plugins()}
    for name in OP_NAMES:
        assert name not in pm.ops
    assert pm.ops.lookup(kernels.flash_attn_func) is None


def test_env_var_disables_autoload(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    pm = NNScalerPluginManager()
    assert "flash_attn.flash_attn_func" not in pm.ops


def test_ops_are_looked_up_by_the_raw_callable():
    pm = NNScalerPluginManager(autoload=True)
    for spec in OPS:
        opdef = pm.ops.lookup(spec.fn)
        assert opdef is not None and opdef.name == spec.name
        assert opdef.fn is spec.fn  # generated code calls the raw implementation
        assert pm.ops.lookup(getattr(fa, spec.fn.__name__)) is opdef
        assert opdef.input_gen_fn is spec.input_gen_fn
        # the op binds calls with flash-attn's signature
        want = {**SIGNATURES, **OWN_SIGNATURES}[spec.fn.__name__]
        assert list(opdef.signature.parameters) == want


@pytest.mark.parametrize("public", sorted(SIGNATURES))
def test_public_functions_have_flash_attn_signatures(public: str):
    fn = getattr(fa, public)
    assert list(inspect.signature(fn).parameters) == SIGNATURES[public]
    assert fn.__name__ == public
    assert fn.__wrapped_op__ == f"flash_attn.{public}"
    assert fn.__wrapped__ is getattr(kernels, public)
    defaults = {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.default is not inspect.Parameter.empty
    }
    assert defaults["dropout_p"] == 0.0 and defaults["softmax_scale"] is None
    assert defaults["causal"] is False and defaults["window_size"] == (-1, -1)
    assert defaults["softcap"] == 0.0 and defaults["return_attn_probs"] is False


def test_wrapper_calls_through_without_a_tracer():
    q = torch.randn(2, 3, 4, 8)
    out = fa.flash_attn_func(q, q, q, causal=True)
    assert torch.equal(out, kernels.flash_attn_func(q, q, q, causal=True))


def test_wrapper_is_recorded_by_a_tracer(autoload):
    seen = []

    def interceptor(opdef, args, kwargs):
        seen.append((opdef, args, kwargs))
        return opdef.call(*_convention(opdef, args, kwargs))

    def _convention(opdef, args, kwargs):
        call = opdef.bind(args, kwargs)
        return call.inputs, call.kwargs

    q = torch.randn(2, 3, 4, 8)
    k = torch.randn(2, 5, 2, 8)
    token = op_call_interceptor.set(interceptor)
    try:
        out = fa.flash_attn_func(q, k, k, causal=True)
    finally:
        op_call_interceptor.reset(token)
    assert len(seen) == 1
    opdef, args, kwargs = seen[0]
    assert opdef is get_plugin_manager().ops.get("flash_attn.flash_attn_func")
    assert opdef.fn is kernels.flash_attn_func
    assert kwargs == {"causal": True}
    call = opdef.bind(args, kwargs)
    assert str(call.anno) == "b s^ (h r^) d^, b t^ h d^, b t^ h d^ -> b s^ (h r^) d^"
    assert torch.equal(out, kernels.flash_attn_func(q, k, k, causal=True))


def test_flash_attn_available_is_a_bool():
    assert isinstance(fa.flash_attn_available(), bool)
