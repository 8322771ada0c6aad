"""``NnScalerStrategy``: train a LightningModule with nnscaler inside ``lightning.Trainer``.

::

    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, precision="32-true",
        strategy=NnScalerStrategy(compute_config=ComputeConfig(plan_ngpus=1, runtime_ngpus=2),
                                  pas_policy="dp"))
    trainer.fit(lightning_module, train_dataloaders=loader)

What the strategy does, in Lightning's order:

1. ``setup_environment``: the process group, as Lightning's ``ddp`` strategy sets it up
   (launching processes itself, or joining those ``torchrun`` started);
2. ``setup``: the LightningModule's ``model`` attribute (``module_attr``) is replaced by
   ``parallelize(model, dummy_input, pas_policy, compute_config)``; the dummy input is
   ``dummy_input`` or the LightningModule's ``example_input_array``. The optimizer that
   ``configure_optimizers`` returns is rebuilt with ``build_optimizer`` (same class and
   hyperparameters), so gradients are summed over their holders before each step. With
   ``average_gradients`` (default) they are then divided by the number of scale units,
   so a loss that is a mean over each rank's batch trains as under the ``ddp`` strategy;
3. data: each scale unit reads its own shard of the data (``distributed_sampler_kwargs``:
   ``runtime_ngpus / plan_ngpus`` replicas); the ranks of a unit read the same samples;
4. checkpoints: every rank writes its own file, ``<checkpoint path>/rank{r}.ckpt`` (the
   checkpoint path is a folder), holding Lightning's whole checkpoint with this rank's
   model and optimizer state. `merge_checkpoint` merges the folder into the
   original model's state dict with [`nnscaler.merge_state_dicts`][nnscaler.merge_state_dicts];
   resuming (``trainer.fit(..., ckpt_path=folder)``) reloads each rank's own file after the model
   is parallelized again.

Logging (``self.log(..., sync_dist=True)``), the progress bar and callbacks work as
with ``ddp``, and so do ZeRO's stages (``ComputeConfig(zero_stage=2)`` or ``3``; ``'auto'``
with ``pas_policy='autodist'``, which chooses it). Not supported: Lightning's gradient clipping (it would clip unsynced
gradients; call ``optimizer.clip_gnorm(max_norm)`` in ``on_before_optimizer_step``
instead), optimizers with several parameter groups, and pipeline plans (a pipelined
module runs a whole step in ``train_step``, which Lightning's loop does not call).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:  # pragma: no cover - exercised in a venv without lightning
    raise ImportError(
        "nnscaler.integration.lightning needs PyTorch Lightning (the 'lightning' package, "
        "2.x), which is not installed: pip install \"nnscaler[lightning]\" (or pip install "
        f"lightning). ({e})"
    ) from e

from nnscaler.errors import LightningIntegrationError
from nnscaler.parallel import ComputeConfig, build_optimizer, parallelize

__all__ = ["LightningIntegrationError", "NnScalerStrategy", "merge_checkpoint",
           "rank_checkpoint_path"]


def rank_checkpoint_path(path: str | os.PathLike[str], rank: int) -> Path:
    """The file of rank ``rank`` inside the checkpoint folder ``path``."""
    return Path(path) / f"rank{rank}.ckpt"


def merge_checkpoint(path: str | os.PathLike[str], prefix: str = "model."
                     ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Merge the checkpoint folder that `NnScalerStrategy` wrote into the state
    dict of the original (not parallelized) model, and its optimizer state.

    ``prefix``: the module path of the parallelized model inside the LightningModule
    (``'model.'``); keys under it are returned without it, ready for
    ``model.load_state_dict``. Pass ``prefix=''`` to keep the LightningModule's keys.
    """
    from nnscaler import merge_state_dicts

    files = sorted(Path(path).glob("rank*.ckpt"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise LightningIntegrationError(
            f"{path} holds no rank*.ckpt files: pass the folder NnScalerStrategy wrote (the "
            f"checkpoint path Lightning reports, e.g. ModelCheckpoint.best_model_path)"
        )
    # Lightning's checkpoints carry its own objects (loops, callbacks): a trusted file
    ckpts = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    states = [c["state_dict"] for c in ckpts]
    opts = [c["optimizer_states"][0] for c in ckpts] if all(
        c.get("optimizer_states") for c in ckpts) else None
    merged, opt = merge_state_dicts(states, opts)
    if prefix:
        merged = {k[len(prefix):]: v for k, v in merged.items() if k.startswith(prefix)}
    return merged, opt


def _as_forward_args(module: torch.nn.Module, example: Any) -> dict[str, Any]:
    """``example`` (a dict keyed by argument name, a tuple of positional arguments, or
    one argument) as the keyword arguments of ``module.forward``."""
    if isinstance(example, Mapping):
        return dict(example)
    names = [p for p in inspect.signature(module.forward).parameters]
    args = example if isinstance(example, tuple) else (example,)
    if len(args) > len(names):
        raise LightningIntegrationError(
            f"the example input has {len(args)} positional values but "
            f"{type(module).__name__}.forward takes {names}; pass dummy_input as a dict "
            f"keyed by argument name"
        )
    return dict(zip(names, args))


class NnScalerStrategy(DDPStrategy):
    """A Lightning strategy that runs the LightningModule's ``model`` as an nnscaler
    [`ParallelModule`][nnscaler.ParallelModule] (see the module docstring).

    Args:
        compute_config: the [`ComputeConfig`][nnscaler.ComputeConfig]; ``runtime_ngpus`` must be
            the number of processes (``devices * num_nodes``). ``use_end2end`` must be
            False: the LightningModule calls the model and computes the loss.
        pas_policy: a registered policy name (``'dp'``, ``'tp'``, ``'megatron'``, ...) or a
            callable ``(graph, compute_config) -> graph``.
        pas_config: options of the policy, merged into ``compute_config.pas_config``.
        module_attr: the attribute of the LightningModule that holds the model.
        dummy_input: the model's forward arguments for tracing (default: the
            LightningModule's ``example_input_array``).
        gen_savedir: where the generated code goes (``parallelize``'s ``gen_savedir``).
        average_gradients: divide gradients by the number of scale units (``ddp``'s
            mean); False keeps nnscaler's sum.
        **kwargs: Lightning's ``DDPStrategy`` arguments (``process_group_backend``,
            ``timeout``, ``start_method``, ...).
    """

    strategy_name = "nnscaler"

    def __init__(self, compute_config: ComputeConfig, pas_policy: Any = "dp",
                 pas_config: Mapping[str, Any] | None = None, *, module_attr: str = "model",
                 dummy_input: Any = None, gen_savedir: str | os.PathLike[str] = "./.nnscaler",
                 average_gradients: bool = True, **kwargs: Any) -> None:
        if not isinstance(compute_config, ComputeConfig):
            raise TypeError(f"compute_config must be an nnscaler ComputeConfig, got "
                            f"{type(compute_config).__name__}")
        if compute_config.use_end2end:
            raise LightningIntegrationError(
                "NnScalerStrategy: compute_config.use_end2end is True, but under Lightning "
                "the LightningModule's training_step calls the model and computes the loss "
                "(pipeline plans, which need end2end, are not supported). Set "
                "use_end2end=False"
            )
        if pas_config:
            compute_config = dataclasses.replace(compute_config, pas_config={
                **compute_config.pas_config, **pas_config})
        super().__init__(**kwargs)
        self.compute_config = compute_config
        self.pas_policy = pas_policy
        self.module_attr = module_attr
        self.dummy_input = dummy_input
        self.gen_savedir = gen_savedir
        self.average_gradients = average_gradients
        self.parallel_module: Any = None

    # -- processes and data ---------------------------------------------------------------
    @property
    def units(self) -> int:
        """The number of scale units (data-parallel replicas)."""
        return self.compute_config.runtime_ngpus // self.compute_config.plan_ngpus

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.units,
                "rank": self.global_rank // self.compute_config.plan_ngpus}

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.world_size != self.compute_config.runtime_ngpus:
            raise LightningIntegrationError(
                f"NnScalerStrategy: compute_config.runtime_ngpus is "
                f"{self.compute_config.runtime_ngpus} but the Trainer runs {self.world_size} "
                f"processes (devices * num_nodes); make them equal"
            )

    # -- the model and the optimizer ------------------------------------------------------
    def _parallelize(self) -> None:
        lm = self.lightning_module
        if lm is None:
            raise LightningIntegrationError("NnScalerStrategy: no LightningModule is connected")
        model = getattr(lm, self.module_attr, None)
        if not isinstance(model, torch.nn.Module):
            raise LightningIntegrationError(
                f"NnScalerStrategy parallelizes the model the LightningModule holds in "
                f"self.{self.module_attr}, but {type(lm).__name__}.{self.module_attr} is "
                f"{type(model).__name__}. Keep the model in that attribute (and call it from "
                f"training_step), or pass module_attr='<attribute>'"
            )
        from nnscaler.runtime import ParallelModule

        if isinstance(model, ParallelModule):  # a second fit() on the same module
            self.parallel_module = model
            return
        example = self._dummy_input(lm)
        if example is None:
            raise LightningIntegrationError(
                f"NnScalerStrategy traces {type(model).__name__} on a dummy input: set "
                f"{type(lm).__name__}.example_input_array (the model's forward arguments), "
                f"nnScaler's dummy_forward_args / dummy_forward_args_fn, or pass "
                f"NnScalerStrategy(dummy_input=...)"
            )
        args = _as_forward_args(model, example)
        args = {k: (v.to(self.root_device) if isinstance(v, torch.Tensor) else v)
                for k, v in args.items()}
        pm = parallelize(model, args, self.pas_policy, self.compute_config,
                         gen_savedir=self.gen_savedir)
        setattr(lm, self.module_attr, pm)
        self.parallel_module = pm

    def _dummy_input(self, lm: Any) -> Any:
        """The dummy input, first found of: the strategy's ``dummy_input``; nnScaler's
        ``dummy_forward_args`` (a dict) or ``dummy_forward_args_fn(batch)`` (applied to the
        first batch of the training data, RNG states untouched) on the LightningModule;
        its ``example_input_array``."""
        if self.dummy_input is not None:
            return self.dummy_input
        if getattr(lm, "dummy_forward_args", None) is not None:
            if not isinstance(lm.dummy_forward_args, Mapping):
                raise LightningIntegrationError(
                    f"{type(lm).__name__}.dummy_forward_args must be a dict of the model's "
                    f"forward arguments by name, got {type(lm.dummy_forward_args).__name__}")
            return dict(lm.dummy_forward_args)
        fn = getattr(lm, "dummy_forward_args_fn", None)
        if fn is not None:
            if not callable(fn):
                raise LightningIntegrationError(
                    f"{type(lm).__name__}.dummy_forward_args_fn must be a function "
                    f"batch -> forward arguments, got {type(fn).__name__}")
            return fn(_first_training_batch(lm))
        return getattr(lm, "example_input_array", None)

    def setup(self, trainer: pl.Trainer) -> None:
        if self.accelerator is None:  # Lightning's Trainer sets it before calling setup
            raise LightningIntegrationError(
                "NnScalerStrategy.setup was called before Lightning gave the strategy an "
                "accelerator; pass the strategy to lightning.Trainer(strategy=...) rather than "
                "calling setup yourself")
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self._parallelize()
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # no DDP wrapper: the parallel module reduces its own gradients

    def configure_ddp(self) -> None:
        pass

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        rebuilt = []
        for opt in self.optimizers:
            if len(opt.param_groups) != 1:
                raise LightningIntegrationError(
                    f"NnScalerStrategy rebuilds the optimizer of configure_optimizers with "
                    f"nnscaler.build_optimizer, which takes one parameter group; "
                    f"{type(opt).__name__} has {len(opt.param_groups)}. Return an optimizer "
                    f"over self.parameters() with one set of hyperparameters"
                )
            # the group's hyperparameters that the optimizer's constructor takes
            accepted = inspect.signature(type(opt)).parameters
            group = {k: v for k, v in opt.param_groups[0].items()
                     if k in accepted and k != "params"}
            new = build_optimizer(self.lightning_module, type(opt), **group)
            _closure_first(new)
            if self.average_gradients and self.units > 1:
                factor = 1.0 / self.units
                new.register_step_pre_hook(lambda o, a, k, f=factor: o.scale_grads(f))
            for config in self.lr_scheduler_configs:
                if config.scheduler.optimizer is opt:
                    for g_new, g_old in zip(new.param_groups, opt.param_groups):
                        for key in ("lr", "initial_lr"):
                            if key in g_old:
                                g_new[key] = g_old[key]
                    config.scheduler.optimizer = new
            rebuilt.append(new)
        self.optimizers = rebuilt

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        pass

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        pass

    # -- checkpoints: one file per rank ---------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # each rank's pieces load into the parallelized model

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Each rank's pieces; with ZeRO stage 3 its shards, nothing gathered
        (`nnscaler.checkpoint.rank_state_dict`)."""
        from nnscaler.checkpoint import rank_state_dict

        return rank_state_dict(self.lightning_module)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str],
                        storage_options: Any = None) -> None:
        from nnscaler.checkpoint import save

        path = Path(filepath)
        if self.is_global_zero:
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
        self.barrier("nnscaler_checkpoint_dir")
        save(checkpoint, rank_checkpoint_path(path, self.global_rank))
        self.barrier("nnscaler_checkpoint_saved")

    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str],
                        weights_only: bool | None = None) -> dict[str, Any]:
        path = rank_checkpoint_path(checkpoint_path, self.global_rank)
        if not path.is_file():
            raise LightningIntegrationError(
                f"NnScalerStrategy: {checkpoint_path} has no {path.name}: a checkpoint of "
                f"this strategy is a folder with one file per rank, written by the same "
                f"plan on the same number of processes. To resume on another plan, merge it "
                f"(nnscaler.integration.lightning.merge_checkpoint) and load that"
            )
        return torch.load(path, map_location="cpu", weights_only=bool(weights_only))

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        self.barrier("nnscaler_checkpoint_remove")
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        pass  # built with its compute config, never by name


def _closure_first(optimizer: torch.optim.Optimizer) -> None:
    """Lightning calls ``optimizer.step(closure)``, whose closure runs the forward and the
    backward; nnscaler's optimizer sums gradients in a step pre-hook, which runs before
    the step's body. So the closure runs first, then the step (and its hooks)."""
    step = optimizer.step

    def step_after_closure(closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step()
        return loss

    optimizer.step = step_after_closure  # type: ignore[method-assign]


def _first_training_batch(lm: Any) -> Any:
    """The first batch of the data ``fit`` was given, read with every RNG state put back
    (so training draws the same numbers as without the strategy)."""
    import random

    source = getattr(getattr(getattr(lm, "trainer", None), "fit_loop", None), "_data_source",
                     None)
    if source is None or not source.is_defined():
        raise LightningIntegrationError(
            f"{type(lm).__name__}.dummy_forward_args_fn needs a batch of the training data, "
            f"but fit() was given none yet. Fix: pass train_dataloaders to fit(), or set "
            f"dummy_forward_args (a dict) instead")
    states = (random.getstate(), torch.get_rng_state())
    try:
        return next(iter(source.dataloader()))
    finally:
        random.setstate(states[0])
        torch.set_rng_state(states[1])
