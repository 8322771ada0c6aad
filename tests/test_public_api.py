"""The public surface, frozen: ``nnscaler.__all__`` and the signatures of ``parallelize``
and ``build_optimizer`` (parameter names, kinds and defaults) change only on purpose, by
changing this test in the same commit (torchtitan freezes its config surface likewise)."""

from __future__ import annotations

import inspect

import nnscaler

P = inspect.Parameter

#: the workflow names only; errors are in ``nnscaler.errors`` (and stay importable from
#: ``nnscaler``), plugin machinery in ``nnscaler.extend``
ALL = [
    "BroadcastGenFilesStrategy",
    "ComputeConfig",
    "IRGraph",
    "NNScalerError",
    "ParallelModule",
    "ReuseType",
    "TransformRule",
    "VerifyReport",
    "__version__",
    "broadcast_weights",
    "build_optimizer",
    "deduped_state_dict",
    "load_deduped_state_dict",
    "load_merged_state_dicts",
    "load_pretrained",
    "load_resharded",
    "merge_state_dicts",
    "meta_parameters",
    "parallelize",
    "register_op",
    "save_pretrained",
    "verify",
    # nnScaler 0.8's names (docs/migrating.md)
    "anchor",
    "uninit",
    "constant_folding",
    "fold_constant",
    "init",
    "load_merged_state_dict",
    "load_sharded_state_dict",
    "no_constant_folding",
    "sync_grad_when",
]

#: names that left ``__all__`` but keep importing from ``nnscaler`` (user code uses them)
FORMER = [
    "AnnotationError", "CheckpointError", "CodegenError", "CollectiveError",
    "ComputeConfigError", "CustomOpCheckError", "DataDependentError",
    "DuplicateRegistrationError", "GenFilesError", "GraphError", "InterpreterError",
    "LayoutError", "OptimizerStateError", "ParallelModuleError", "ParallelizeError",
    "PartGroupError", "PipelineError", "PlanError", "PluginError", "PolicyError",
    "PromiseBrokenError", "RegistrationError", "ReuseMismatchError", "ScheduleError",
    "StateDictMismatchError", "TraceError", "UnknownNameError", "VerifyError",
    "get_plugin_manager", "hookimpl",
]

PARALLELIZE = [
    ("module_or_module_class", P.POSITIONAL_OR_KEYWORD, P.empty),
    ("dummy_forward_args", P.POSITIONAL_OR_KEYWORD, P.empty),
    ("pas_policy", P.POSITIONAL_OR_KEYWORD, P.empty),
    ("compute_config", P.POSITIONAL_OR_KEYWORD, P.empty),
    ("gen_savedir", P.KEYWORD_ONLY, "./.nnscaler"),
    ("reuse", P.KEYWORD_ONLY, nnscaler.ReuseType.MATCH),
    ("instance_name", P.KEYWORD_ONLY, None),
    ("load_module", P.KEYWORD_ONLY, True),
    ("module_dtype", P.KEYWORD_ONLY, None),
    ("module_fn", P.KEYWORD_ONLY, None),
    ("init_module_params", P.KEYWORD_ONLY, True),
    ("broadcast_strategy", P.KEYWORD_ONLY, "none"),
]

BUILD_OPTIMIZER = [
    ("module", P.POSITIONAL_OR_KEYWORD, P.empty),
    ("optimizer_fn", P.POSITIONAL_OR_KEYWORD, P.empty),
    ("compute_config", P.POSITIONAL_OR_KEYWORD, None),
    ("kwargs", P.VAR_KEYWORD, P.empty),
]


def _params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_all_is_frozen() -> None:
    assert sorted(nnscaler.__all__) == sorted(ALL)
    assert len(set(nnscaler.__all__)) == len(nnscaler.__all__)
    for name in nnscaler.__all__:
        assert hasattr(nnscaler, name), name


def test_names_that_left_all_still_import_from_nnscaler() -> None:
    star: dict = {}
    exec("from nnscaler import *", star)  # what a star import gives: __all__ only
    for name in FORMER:
        assert hasattr(nnscaler, name), name
        assert name not in star, name


def test_parallelize_signature_is_frozen() -> None:
    assert _params(nnscaler.parallelize) == PARALLELIZE


def test_build_optimizer_signature_is_frozen() -> None:
    assert _params(nnscaler.build_optimizer) == BUILD_OPTIMIZER
