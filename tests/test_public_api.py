"""The public surface, frozen: ``nnscaler.__all__`` and the signatures of ``parallelize``
and ``build_optimizer`` (parameter names, kinds and defaults) change only on purpose, by
changing this test in the same commit (torchtitan freezes its config surface likewise)."""

from __future__ import annotations

import inspect

import nnscaler

P = inspect.Parameter

ALL = [
    "AnnotationError",
    "BroadcastGenFilesStrategy",
    "CheckpointError",
    "CodegenError",
    "CollectiveError",
    "ComputeConfig",
    "ComputeConfigError",
    "CustomOpCheckError",
    "DataDependentError",
    "DuplicateRegistrationError",
    "GenFilesError",
    "GraphError",
    "IRGraph",
    "InterpreterError",
    "LayoutError",
    "NNScalerError",
    "OptimizerStateError",
    "ParallelModule",
    "ParallelModuleError",
    "ParallelizeError",
    "PartGroupError",
    "PipelineError",
    "PlanError",
    "PluginError",
    "PolicyError",
    "PromiseBrokenError",
    "RegistrationError",
    "ReuseMismatchError",
    "ReuseType",
    "ScheduleError",
    "StateDictMismatchError",
    "TraceError",
    "TransformRule",
    "UnknownNameError",
    "VerifyError",
    "VerifyReport",
    "__version__",
    "broadcast_weights",
    "build_optimizer",
    "deduped_state_dict",
    "get_plugin_manager",
    "hookimpl",
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


def test_parallelize_signature_is_frozen() -> None:
    assert _params(nnscaler.parallelize) == PARALLELIZE


def test_build_optimizer_signature_is_frozen() -> None:
    assert _params(nnscaler.build_optimizer) == BUILD_OPTIMIZER
