"""``model.parallel_modules``: the Trainer parallelizes chosen submodule types instead of
the whole model (nnScaler's form; `ModuleParallelizeConfig`).

The model is built as written (``model.type(**model.args)``, seeded like the whole-model
path). For each configured type, the first instance (or ``type(**args)``) is traced with
``forward_args_gen_fn(trainer_args)`` under the Trainer's compute config changed by the
entry's ``compute_config`` (never end-to-end), and every instance of that exact type is
replaced by a parallel module holding that instance's own weights
([`load_merged_state_dict`][nnscaler.load_merged_state_dict]), so the model computes what it
computed before. The parameters outside the parallel modules are replicated and reduced
over the scale units by ``build_optimizer``.

A step runs the whole model's ``forward(batch)`` (loss first) and ``backward`` on each
micro-batch; the reducers sum once, at the optimizer step (`sync_grad_when` keeps the
async reducer quiet until the last micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from nnscaler.trainer.collective import is_distributed
from nnscaler.trainer.errors import ConfigError
from nnscaler.trainer.fields import resolve_object

if TYPE_CHECKING:
    from nnscaler.trainer.options import ModuleParallelizeConfig
    from nnscaler.trainer.trainer import Trainer

__all__ = ["build_with_parallel_submodules", "infer_step", "train_step"]


def _instances(model: torch.nn.Module, cls: type) -> list[tuple[torch.nn.Module, str]]:
    """``(parent, attribute)`` of every submodule of exact type ``cls``, outermost first
    (an instance nested inside another goes with its outer one)."""
    names: list[str] = []
    for name, module in model.named_modules():
        if type(module) is cls and name and not any(name.startswith(f"{n}.") for n in names):
            names.append(name)
    out = []
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        out.append((model.get_submodule(parent_name), attr))
    return out


def _parallelize_type(trainer: Trainer, cfg: ModuleParallelizeConfig, key: str,
                      model: torch.nn.Module | None, load_module: bool) -> Any:
    """The parallel module class of ``cfg.type`` (None without ``load_module``)."""
    from nnscaler.parallel import parallelize

    args = trainer.args
    cls = resolve_object(cfg.type, f"{key}.type")
    found = _instances(model, cls) if model is not None else []
    if cfg.args is not None:
        traced = cls(**args.create_kwarg(cfg.args, f"{key}.args"))
    elif found:
        traced = getattr(*found[0])
    else:
        raise ConfigError(
            f"{key}.type: the model holds no {cls.__qualname__} to parallelize. Fix: name a "
            f"submodule type the model builds, or give {key}.args to build one.", f"{key}.type")
    dummy = resolve_object(cfg.forward_args_gen_fn, f"{key}.forward_args_gen_fn")(args)
    if not isinstance(dummy, dict):
        raise ConfigError(f"{key}.forward_args_gen_fn must return a dict of forward "
                          f"arguments, got {type(dummy).__name__}.", f"{key}.forward_args_gen_fn")
    compute_config = args.compute_config
    compute_config = (cfg.compute_config.resolve(compute_config) if cfg.compute_config
                      is not None else _not_end2end(compute_config))
    reuse = cfg.gen_reuse or args.gen_reuse
    if reuse == "auto":
        reuse = "moo" if args.run_mode == "compile" else "match"
    strategy = (cfg.broadcast_strategy or args.broadcast_strategy) if is_distributed() \
        else "none"
    pm = parallelize(traced, dummy, cfg.pas_policy or args.pas_policy, compute_config,
                     gen_savedir=cfg.gen_savedir or args.gen_savedir, reuse=reuse,
                     instance_name=cfg.instance_name or args.instance_name,
                     load_module=load_module, module_dtype=trainer.precision.module_dtype,
                     broadcast_strategy=strategy)
    return type(pm) if load_module else None


def _not_end2end(compute_config: Any) -> Any:
    import dataclasses

    return dataclasses.replace(compute_config, use_end2end=False)


def build_with_parallel_submodules(trainer: Trainer, *, load_module: bool,
                                   model_fn: Callable[[], torch.nn.Module]) -> Any:
    """The model with its configured submodules parallelized (``load_module``), or only
    their code generated (compile mode: returns None)."""
    from nnscaler.checkpoint import load_merged_state_dict

    entries = trainer.args.model.parallel_modules
    model = model_fn()
    for i, cfg in enumerate(entries):
        key = f"model.parallel_modules.{i}"
        pm_cls = _parallelize_type(trainer, cfg, key, model, load_module)
        if pm_cls is None:
            continue
        for parent, attr in _instances(model, resolve_object(cfg.type, f"{key}.type")):
            original = getattr(parent, attr)
            pm = pm_cls(init_params=False)
            load_merged_state_dict(pm, original.state_dict())
            pm.train(original.training)
            setattr(parent, attr, pm)
    if not load_module:
        return None
    dtype = trainer.precision.module_dtype  # the parts outside, like the parallel modules
    return model.to(trainer.device) if dtype is None else model.to(trainer.device, dtype)


def _first(out: Any) -> torch.Tensor:
    loss = out[0] if isinstance(out, (tuple, list)) else out
    if not (torch.is_tensor(loss) and loss.dim() == 0):
        raise ConfigError(
            f"the model's forward must return the loss (a scalar tensor) first, got "
            f"{type(loss).__name__}; the Trainer calls forward(batch) and backward on it.",
            "model.type")
    return loss


def train_step(model: torch.nn.Module, batches: list[Any],
               scale_fn: Callable[[torch.Tensor], torch.Tensor] | None) -> list[Any]:
    """Forward and backward of the whole model on each micro-batch (gradients summed)."""
    from nnscaler.runtime.reducer import sync_grad_when

    outputs = []
    for i, batch in enumerate(batches):
        with sync_grad_when(i == len(batches) - 1):
            out = model(batch)
            loss = _first(out)
            (scale_fn(loss) if scale_fn is not None else loss).backward()
        outputs.append(pytree.tree_map(lambda x: x.detach() if torch.is_tensor(x) else x, out))
    return outputs


def infer_step(model: torch.nn.Module, batches: list[Any]) -> list[Any]:
    """Forward of the whole model on each micro-batch, without gradients."""
    with torch.no_grad():
        return [model(batch) for batch in batches]
