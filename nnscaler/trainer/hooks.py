"""The Trainer's hooks: objects whose methods, named like the fields of
`HookMapConfig`, are called with the Trainer first."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nnscaler.trainer.args import HOOK_NAMES, HookConfig, HookMapConfig, TrainerArgs
from nnscaler.trainer.fields import resolve_object

__all__ = ["TrainHook", "build_hooks", "call_hooks"]


class TrainHook:
    """Base class of hook objects: override the methods you need (names and arguments
    as in `HookMapConfig`); each gets the Trainer
    first. An optimizer or LR scheduler that is a ``TrainHook`` is called too."""


def call_hooks(hooks: Sequence[Any], name: str, *args: Any) -> None:
    """Call method ``name`` of every hook that has one, in order."""
    for h in hooks:
        fn = getattr(h, name, None)
        if fn is not None:
            fn(*args)


class _MapHook:
    """Adapts a `HookMapConfig` (functions by hook name) to the hook protocol."""

    def __init__(self, config: HookMapConfig) -> None:
        for name in HOOK_NAMES:
            ref = getattr(config, name)
            if ref is not None:
                setattr(self, name, resolve_object(ref, f"hook.{name}"))


def build_hooks(args: TrainerArgs, optimizer: Any, lr_scheduler: Any) -> list[Any]:
    """The hooks of a run: the optimizer and LR scheduler when they are ``TrainHook``s,
    then the configured ones (``args.hook``)."""
    hooks: list[Any] = [obj for obj in (optimizer, lr_scheduler) if isinstance(obj, TrainHook)]
    cfg = args.hook
    if isinstance(cfg, HookConfig):
        hook_cls = resolve_object(cfg.type, "hook.type")
        hooks.append(hook_cls(**args.create_kwarg(cfg.args, "hook.args")))
    elif isinstance(cfg, HookMapConfig):
        hooks.append(_MapHook(cfg))
    return hooks
