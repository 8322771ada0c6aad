"""The check of ``dummy_forward_args`` against a module's ``forward`` signature, shared by
the tracer and [`parallelize`][nnscaler.parallelize] (which checks before it traces).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from nnscaler.trace.errors import ForwardSignatureError


def check_forward_args(module: torch.nn.Module, dummy_forward_args: Any) -> dict[str, Any]:
    """Check ``dummy_forward_args`` against ``module.forward``'s signature."""
    where = f"{type(module).__qualname__}.forward"
    if not isinstance(dummy_forward_args, Mapping):
        raise ForwardSignatureError(
            f"dummy_forward_args must be a dict keyed by the argument names of {where}, got "
            f"{type(dummy_forward_args).__name__}; e.g. {{'x': torch.randn(2, 16)}}"
        )
    args = dict(dummy_forward_args)
    bad_keys = [k for k in args if not isinstance(k, str)]
    if bad_keys:
        raise ForwardSignatureError(
            f"dummy_forward_args is keyed by the argument names of {where}; got the keys "
            f"{bad_keys!r}, which are not strings"
        )
    params = inspect.signature(module.forward).parameters
    for p in params.values():
        if p.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ForwardSignatureError(
                f"{where} has the positional-only argument {p.name!r}; nnscaler calls forward "
                f"with arguments by name (dummy_forward_args is keyed by name), so every "
                f"argument must be nameable: remove the '/' from the signature"
            )
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            raise ForwardSignatureError(
                f"{where} takes '*{p.name}'; nnscaler calls forward with arguments by name "
                f"(dummy_forward_args is keyed by name): declare each argument by name instead"
            )
    named = [
        p.name for p in params.values()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in args if k not in named]
    if unknown and not takes_any:
        raise ForwardSignatureError(
            f"dummy_forward_args has {', '.join(map(repr, unknown))}, which {where} does not "
            f"take; its arguments are {named}. Rename or drop the key"
        )
    missing = [
        p.name for p in params.values()
        if p.name in named and p.default is inspect.Parameter.empty and p.name not in args
    ]
    if missing:
        raise ForwardSignatureError(
            f"{where} requires the argument(s) {', '.join(map(repr, missing))}, which "
            f"dummy_forward_args lacks; add a dummy value for each"
        )
    return args
