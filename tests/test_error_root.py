"""One error root, and a public surface that changes only on purpose.

- Every exception class defined in the package derives from ``nnscaler.NNScalerError``
  and from the builtin it refines (``ValueError``, ``RuntimeError``, ...), so
  ``except nnscaler.NNScalerError`` catches everything nnscaler raises on purpose and
  ``except ValueError`` keeps working.
- One home: every error (and warning) class of the kernel is defined in
  ``nnscaler.errors`` (docs/internals/design.md, "Errors"); a room imports the ones it
  raises from there, so its old import path keeps working.
- The user-facing errors stay importable from ``nnscaler`` (existing code catches
  ``nnscaler.TraceError``), though ``nnscaler.__all__`` lists the workflow names only
  (tests/test_public_api.py).
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


def _warning_classes() -> dict[str, type[Warning]]:
    found = {}
    for name in _modules():
        for value in vars(importlib.import_module(name)).values():
            if (inspect.isclass(value) and issubclass(value, Warning)
                    and value.__module__.startswith("nnscaler")):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


def test_the_package_defines_exceptions() -> None:  # the walk below sees them
    found = _exception_classes()
    assert "nnscaler.errors.GraphError" in found and len(found) > 30
    assert "nnscaler.errors.OpaqueOpWarning" in _warning_classes()


def test_every_error_class_lives_in_nnscaler_errors() -> None:
    found = {**_exception_classes(), **_warning_classes()}
    elsewhere = sorted(name for name, cls in found.items()
                       if cls.__module__ != "nnscaler.errors" and not cls.__name__.startswith("_"))
    assert not elsewhere, (f"error classes live in nnscaler/errors.py, under the banner of the "
                           f"room that raises them; the room imports them from there. Move: "
                           f"{elsewhere}")


def test_the_old_import_paths_of_errors_still_work() -> None:
    import nnscaler.errors as errors
    from nnscaler.parallel.api import ParallelizeError
    from nnscaler.runtime.module import ParallelModuleError
    from nnscaler.trace.errors import DataDependentError, TraceError

    assert TraceError is errors.TraceError and DataDependentError is errors.DataDependentError
    assert ParallelizeError is errors.ParallelizeError
    assert ParallelModuleError is errors.ParallelModuleError


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
    "VerifyError",
]


@pytest.mark.parametrize("name", EXPORTED_ERRORS)
def test_user_facing_errors_stay_importable_from_nnscaler(name: str) -> None:
    import nnscaler.errors as errors

    assert getattr(nnscaler, name) is getattr(errors, name)
    assert issubclass(getattr(nnscaler, name), NNScalerError)
    assert name == "NNScalerError" or name not in nnscaler.__all__
