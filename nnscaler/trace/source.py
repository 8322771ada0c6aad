"""Where in the model's code a call came from: the innermost frame outside torch and the
nnscaler machinery (code under ``nnscaler/models`` counts as model code)."""

from __future__ import annotations

import linecache
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# the package folder, from this file (importing the facade here would run it from below)
_NNSCALER_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
_MODELS_DIR = os.path.join(_NNSCALER_DIR, "models") + os.sep
_machinery: dict[str, bool] = {}


def _is_machinery(filename: str) -> bool:
    hit = _machinery.get(filename)
    if hit is None:
        hit = filename.startswith(_TORCH_DIR) or (
            filename.startswith(_NNSCALER_DIR) and not filename.startswith(_MODELS_DIR)
        )
        _machinery[filename] = hit
    return hit


def model_frame(callee: Callable[..., Any] | None = None) -> tuple[str, int]:
    """``(filename, line)`` of the innermost model frame on the stack (``('', 0)`` if none).

    ``callee`` is the function being recorded: when it is a Python function of the model
    that dispatches through ``__torch_function__``, its own frame is skipped so that the
    line is where the model *called* it.
    """
    skip = getattr(callee, "__code__", None)
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not _is_machinery(code.co_filename) and code is not skip:
            return code.co_filename, frame.f_lineno
        frame = frame.f_back
    return "", 0


def code_line(filename: str, line: int) -> str:
    """The stripped text of ``filename:line`` ('' when unavailable)."""
    return linecache.getline(filename, line).strip() if filename else ""
