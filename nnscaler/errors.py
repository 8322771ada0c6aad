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


class RegistrationError(NNScalerError, TypeError, ValueError):
    """A plugin (or user code) registered a value its registry cannot use: a policy that
    is not a callable ``(graph, compute_config)``, an adapter that is not a ``Primitive``,
    an op whose annotation does not fit its function, ... The message names the entry,
    the plugin that registered it, the rule and the fix. It refines both ``TypeError``
    (a value of the wrong kind) and ``ValueError`` (the right kind, a wrong value)."""


class CheckpointError(NNScalerError, ValueError):
    """A checkpoint that cannot be saved, merged or loaded as asked."""


class StateDictMismatchError(CheckpointError):
    """A state dict that belongs to another model, plan or rank (the message names the
    first mismatching key and both shapes)."""


class OptimizerStateError(CheckpointError):
    """Optimizer state that cannot be merged or split (e.g. state that is not elementwise,
    as LBFGS or Adafactor keep)."""
