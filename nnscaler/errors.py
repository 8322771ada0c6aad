"""Exceptions raised by nnscaler.

Every exception refines a builtin (``ValueError``, ``LookupError``, ...) so that code
which already catches the builtin keeps working; the message states the rule, the value
seen and how to fix it.
"""

from __future__ import annotations


class NNScalerError(Exception):
    """Base class of every error that nnscaler raises on purpose."""


class UnknownNameError(NNScalerError, LookupError):
    """A name (op, policy, schedule, adapter) that no plugin registered was asked for."""

    def __str__(self) -> str:  # LookupError/KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateRegistrationError(NNScalerError, ValueError):
    """Two plugins registered the same name in one registry."""


class PluginError(NNScalerError, RuntimeError):
    """A plugin failed while loading or while running one of its hooks."""
