"""The Trainer: ``Trainer(train_args=TrainerArgs(...)).run()`` parallelizes the model,
builds the optimizer, trains, validates, logs and checkpoints.

One *step* is one optimizer update: every scale unit (``plan_ngpus`` devices running one
copy of the plan) takes ``grad_accumulation_steps`` micro-batches of
``micro_batch_size`` samples from its share of the data (the sampler gets
``num_replicas`` = the number of units, ``rank`` = this unit), runs
``ParallelModule.train_step`` on them, and the gradients, summed over micro-batches and
units by the reducers, are scaled according to ``optimizer.grad_reduction``. Nothing
the Trainer does draws random numbers, so the training equals a hand-written loop over
the same batches; a resumed run equals the uninterrupted one bitwise (same world size
and plan): the checkpoint holds the model, the optimizer, the LR scheduler, the loss
scaler, every RNG and the data position. See ``docs/trainer.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from nnscaler.cli import checkpointing as ckpt
from nnscaler.cli.precision import DTYPES, DynamicLossScaler, grads_overflow, mixed_precision
from nnscaler.cli.trainer_args import (
    HOOK_NAMES,
    AggregatedOutputs,
    ConfigError,
    HookConfig,
    HookMapConfig,
    TrainerArgs,
    resolve_object,
)
from nnscaler.errors import NNScalerError

__all__ = ["TrainHook", "Trainer", "TrainerError"]

logger = logging.getLogger(__name__)


class _RankZeroFilter(logging.Filter):
    """Informational records of the Trainer come from rank 0 only (warnings from all)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


logger.addFilter(_RankZeroFilter())


class TrainerError(NNScalerError, RuntimeError):
    """The Trainer cannot go on (a setting that does not fit the job, a failed save)."""


class TrainHook:
    """Base class of hook objects: override the methods you need (names and arguments
    as in :class:`~nnscaler.cli.trainer_args.HookMapConfig`); each gets the Trainer
    first. An optimizer or LR scheduler that is a ``TrainHook`` is called too."""


def _call_hooks(hooks: Sequence[Any], name: str, *args: Any) -> None:
    for h in hooks:
        fn = getattr(h, name, None)
        if fn is not None:
            fn(*args)


class _MapHook:
    """Adapts a :class:`HookMapConfig` (functions by hook name) to the hook protocol."""

    def __init__(self, config: HookMapConfig) -> None:
        for name in HOOK_NAMES:
            ref = getattr(config, name)
            if ref is not None:
                setattr(self, name, resolve_object(ref, f"hook.{name}"))


class _SkipSampler(torch.utils.data.Sampler):
    """A sampler that skips its first ``skip`` indices once (resuming mid-epoch)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        it = iter(self.sampler)
        for _ in range(skip):
            next(it, None)
        yield from it

    def __len__(self) -> int:
        return len(self.sampler)


def _first(out: Any) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _as_float(x: Any) -> float:
    return float(x.item()) if torch.is_tensor(x) else float(x)


class Trainer:
    """Trains ``train_args.model`` as ``train_args`` says; see the module docstring.

    ``argv``: command-line arguments of ``nnscaler-train`` (``-f config.yaml`` and
    dotted overrides), used when ``train_args`` is None. ``train_args``: a
    :class:`TrainerArgs` or a mapping of its fields.
    """

    def __init__(self, argv: list[str] | None = None, *,
                 train_args: TrainerArgs | dict[str, Any] | None = None) -> None:
        if train_args is None:
            from nnscaler.cli.train import parse_args

            train_args = parse_args(argv or [])
        elif argv is not None:
            raise TrainerError("give either argv or train_args, not both")
        if not isinstance(train_args, TrainerArgs):
            train_args = TrainerArgs.from_dict(train_args)
        self.train_args = train_args
        self.rank = 0
        self.world_size = 1
        self.model: Any = None
        self.optimizer: Any = None
        self.lr_scheduler: Any = None
        self.loss_scaler: DynamicLossScaler | None = None
        self.train_dataset: Any = None
        self.val_dataset: Any = None
        self.train_loader: Any = None
        self.val_loader: Any = None
        self.train_sampler: _SkipSampler | None = None
        self.hooks: list[Any] = []
        self.loggers: list[Any] = []
        self.dummy_input: Any = None
        # the training position: epochs done, optimizer steps done, steps of this epoch
        self.epoch = 0
        self.global_step = 0
        self.step_in_epoch = 0
        self.epoch_end_done = False
        self.best_loss = math.inf
        self.last_train_loss = math.nan
        self.train_status: dict[str, Any] = {}
        self._pending_rng: dict[str, Any] | None = None
        self._setup_done = False

    # ===================================================================================
    # set-up
    # ===================================================================================
    @property
    def args(self) -> TrainerArgs:
        return self.train_args

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def run(self) -> None:
        """Compile (``run_mode='compile'``) or set up and train (``'run'``)."""
        if self.args.run_mode == "compile":
            self.compile()
            return
        self.setup()
        try:
            self.train()
        finally:
            self._finalize()

    def compile(self) -> None:
        """Generate the code of every rank, without a process group (``run_mode='compile'``,
        reuse ``'moo'`` unless ``gen_reuse`` says otherwise); ``run`` later reuses it."""
        args = self.args
        self._seed()
        self._build_datasets(loaders=False)
        self._make_dummy_input()
        self._parallelize(load_module=False)
        logger.info("Compiled %s for %d ranks into %s", self._model_class().__qualname__,
                    args.compute_config.runtime_ngpus, args.gen_savedir)

    def setup(self) -> None:
        """Everything before the first step: process group, data, model, optimizer,
        scheduler, loggers, hooks, and the checkpoint to resume from."""
        args = self.args
        self._init_process_group()
        self._peers = self._all_gather((socket.gethostname(), os.getpid()))
        if args.init_env_fn is not None:
            resolve_object(args.init_env_fn, "init_env_fn")(self)
        self._seed()
        self._build_datasets(loaders=True)
        self._make_dummy_input()
        cls = self._parallelize(load_module=True)
        self.model = cls(init_params=not self._meta_parameters())
        if args.model.pretrained is not None:
            from nnscaler.checkpoint import load_pretrained

            load_pretrained(self.model, args.model.pretrained)
        self._seed()  # ranks leave parallelize with different RNG states; even them out
        self._build_optimizer()
        self._build_loggers()
        self._build_hooks()
        self._resume()
        self._setup_done = True
        _call_hooks(self.hooks, "after_setup", self)

    def _init_process_group(self) -> None:
        args = self.args
        if not self.distributed:
            torchrun = all(os.environ.get(v) for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                       "MASTER_PORT"))
            if torchrun or args.compute_config.runtime_ngpus > 1:
                from nnscaler.runtime.device import init_distributed

                init_distributed(timeout=args.collective_timeout)
        if self.distributed:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.world_size != args.compute_config.runtime_ngpus:
            raise ConfigError(
                f"compute_config.runtime_ngpus is {args.compute_config.runtime_ngpus} but "
                f"the job has {self.world_size} processes. Fix: launch "
                f"`torchrun --nproc_per_node={args.compute_config.runtime_ngpus} ...`, or set "
                f"runtime_ngpus to the number of processes (e.g. from $WORLD_SIZE).",
                "compute_config.runtime_ngpus",
            )
        from nnscaler.runtime.device import current_device

        self.device = current_device()

    def _seed(self) -> None:
        seed = self.args.seed
        if seed is None:
            return
        import random

        random.seed(seed)
        torch.manual_seed(seed)
        with contextlib.suppress(ImportError):
            import numpy as np

            np.random.seed(seed)

    # -- data ---------------------------------------------------------------------------
    @property
    def unit_rank(self) -> int:
        """This rank's scale unit (its data-parallel rank)."""
        return self.rank // self.args.compute_config.plan_ngpus

    def _build_datasets(self, *, loaders: bool) -> None:
        args = self.args
        dataset_cls = resolve_object(args.dataset.type, "dataset.type")
        self.train_dataset = dataset_cls(**args.dataset.train_args)
        if args.dataset.val_args:
            self.val_dataset = dataset_cls(**args.dataset.val_args)
        if not loaders:
            return
        sampler_cls = resolve_object(args.dataset_sampler.type, "dataset_sampler.type")
        loader_cls = resolve_object(args.dataloader.type, "dataloader.type")
        units = args.compute_config.scale_units
        sampler = sampler_cls(self.train_dataset, num_replicas=units, rank=self.unit_rank,
                              **args.dataset_sampler.train_args)
        self.train_sampler = _SkipSampler(sampler)
        self.train_loader = loader_cls(self.train_dataset, batch_size=args.micro_batch_size,
                                       sampler=self.train_sampler, **args.dataloader.train_args)
        if self.val_dataset is not None:
            val_sampler_args = {"shuffle": False, **args.dataset_sampler.val_args}
            val_sampler = sampler_cls(self.val_dataset, num_replicas=units,
                                      rank=self.unit_rank, **val_sampler_args)
            val_loader_args = args.dataloader.val_args or args.dataloader.train_args
            self.val_loader = loader_cls(self.val_dataset, batch_size=args.micro_batch_size,
                                         sampler=val_sampler, **val_loader_args)

    def _cast_input(self, batch: Any) -> Any:
        """Move a batch to this rank's device, floating tensors in the module's dtype."""
        dtype = DTYPES[self.args.resolved_precision]
        device = getattr(self, "device", torch.device("cpu"))

        def move(x: Any) -> Any:
            if not torch.is_tensor(x):
                return x
            if x.is_floating_point() and x.dtype != dtype:
                x = x.to(dtype)
            return x.to(device, non_blocking=True) if x.device != device else x

        return pytree.tree_map(move, batch)

    def _make_dummy_input(self) -> None:
        """A first batch for tracing, built without touching any RNG (so training draws
        the same numbers whether or not the code is generated in this run)."""
        from torch.utils.data import default_collate

        states = ckpt.get_rng_states()
        try:
            collate = default_collate
            loader_args = self.args.dataloader.train_args
            if "collate_fn" in loader_args:
                collate = resolve_object(loader_args["collate_fn"], "dataloader.train_args."
                                                                    "collate_fn")
            samples = [self.train_dataset[i % len(self.train_dataset)]
                       for i in range(self.args.micro_batch_size)]
            self.dummy_input = self._cast_input(collate(samples))
        finally:
            ckpt.set_rng_states(states)

    # -- model --------------------------------------------------------------------------
    def _model_class(self) -> type:
        cls = resolve_object(self.args.model.type, "model.type")
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise ConfigError(
                f"model.type must be a torch.nn.Module subclass (or its import path), got "
                f"{cls!r}. Fix: name the model class; its constructor gets model.args.",
                "model.type",
            )
        return cls

    def _module_fn(self) -> Callable[[], torch.nn.Module]:
        args = self.args
        cls = self._model_class()

        def build() -> torch.nn.Module:
            if self._meta_parameters():
                from nnscaler.checkpoint import meta_parameters

                with meta_parameters():
                    return cls(**args.model.args)
            model = cls(**args.model.args)
            if args.tracing_from_weights is not None:
                from nnscaler.checkpoint import load

                model.load_state_dict(load(args.tracing_from_weights))
            return model

        return build

    def _meta_parameters(self) -> bool:
        """Pretrained weights with a meta trace: the model is built without its weights."""
        args = self.args
        return (args.model.pretrained is not None
                and args.compute_config.trace_strategy == "meta")

    def _parallelize(self, *, load_module: bool) -> Any:
        from nnscaler.parallel import parallelize

        args = self.args
        reuse = args.gen_reuse
        if reuse == "auto":
            reuse = "moo" if args.run_mode == "compile" else "match"
        strategy = args.broadcast_strategy if self.distributed else "none"
        dtype = DTYPES[args.resolved_precision]
        forward_arg = self._forward_arg_name()
        return parallelize(
            self._model_class(),
            {forward_arg: self.dummy_input},
            args.pas_policy,
            args.compute_config,
            gen_savedir=args.gen_savedir,
            reuse=reuse,
            instance_name=args.instance_name,
            load_module=load_module,
            module_dtype=None if dtype == torch.float32 else dtype,
            module_fn=self._module_fn(),
            broadcast_strategy=strategy,
        )

    def _forward_arg_name(self) -> str:
        import inspect

        cls = self._model_class()
        params = [p for p in inspect.signature(cls.forward).parameters.values()
                  if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not params:
            raise ConfigError(
                f"{cls.__qualname__}.forward takes no batch argument; the Trainer calls "
                f"forward(batch) and expects the loss first. Fix: add the batch argument.",
                "model.type",
            )
        return params[0].name

    # -- optimizer ----------------------------------------------------------------------
    def _build_optimizer(self) -> None:
        from nnscaler.parallel import build_optimizer

        args = self.args
        opt_type = resolve_object(args.optimizer.type, "optimizer.type")
        if args.resolved_precision != "fp32":
            if not (isinstance(opt_type, type) and issubclass(opt_type, torch.optim.Optimizer)):
                raise ConfigError(
                    f"precision={args.precision!r} keeps fp32 master weights by wrapping the "
                    f"optimizer class, but optimizer.type is {opt_type!r}, not a "
                    f"torch.optim.Optimizer subclass. Fix: name the optimizer class.",
                    "optimizer.type",
                )
            opt_type = mixed_precision(opt_type)
        if args.resolved_precision == "fp16":
            self.loss_scaler = DynamicLossScaler()
        self.optimizer = build_optimizer(self.model, opt_type, **args.optimizer.args)
        if args.lr_scheduler is not None:
            sched_type = resolve_object(args.lr_scheduler.type, "lr_scheduler.type")
            self.lr_scheduler = sched_type(self.optimizer, **args.lr_scheduler.args)

    def _build_loggers(self) -> None:
        if self.rank != 0:
            return
        from nnscaler.plugins import get_plugin_manager

        for i, cfg in enumerate(self.args.log):
            ref = cfg.type
            if isinstance(ref, str) and "." not in ref:
                cls = get_plugin_manager().loggers.get(ref)
            else:
                cls = resolve_object(ref, f"log.{i}.type")
            log = cls(**cfg.args)
            log.setup(self.args.to_dict())
            self.loggers.append(log)

    def _build_hooks(self) -> None:
        hooks: list[Any] = []
        for obj in (self.optimizer, self.lr_scheduler):
            if isinstance(obj, TrainHook):
                hooks.append(obj)
        cfg = self.args.hook
        if isinstance(cfg, HookConfig):
            hooks.append(resolve_object(cfg.type, "hook.type")(**cfg.args))
        elif isinstance(cfg, HookMapConfig):
            hooks.append(_MapHook(cfg))
        self.hooks = hooks

    # ===================================================================================
    # training
    # ===================================================================================
    @property
    def steps_per_epoch(self) -> int:
        return len(self.train_loader) // self.args.update_freq

    @property
    def total_train_steps(self) -> int | None:
        limits = []
        if self.args.max_train_steps is not None:
            limits.append(self.args.max_train_steps)
        if self.args.max_epochs is not None:
            limits.append(self.args.max_epochs * self.steps_per_epoch)
        return min(limits) if limits else None

    def _done(self) -> bool:
        total = self.total_train_steps
        return total is not None and self.global_step >= total

    def train(self) -> None:
        """The training loop (after :meth:`setup`)."""
        try:
            self._train()
        except BaseException:
            self._wake_local_peers()
            raise

    def _wake_local_peers(self) -> None:
        """Continue stopped ranks on this host (SIGCONT) as this rank fails: torchrun
        then ends the job at once; a stopped process would ignore its SIGTERM and hold
        the job for torchrun's 30 s grace period. A running rank is not affected."""
        me = socket.gethostname()
        for rank, (host, pid) in enumerate(getattr(self, "_peers", [])):
            if rank != self.rank and host == me:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)

    def _train(self) -> None:
        args = self.args
        if self.steps_per_epoch == 0:
            raise TrainerError(
                f"an epoch has no step: each unit gets {len(self.train_loader)} micro-batches "
                f"of {args.micro_batch_size} samples, and a step takes {args.update_freq}. "
                f"Fix: a larger dataset, or smaller micro_batch_size / "
                f"grad_accumulation_steps / global_batch_size."
            )
        if args.max_train_steps is None and args.max_epochs is None:
            raise ConfigError("set max_train_steps or max_epochs: the Trainer would never stop.",
                              "max_train_steps")
        logger.info("Training...")
        _call_hooks(self.hooks, "on_train_start", self)
        self.model.train()
        self._open_progress()
        try:
            while not self._done():
                if self.epoch_end_done:  # resumed from a checkpoint taken at an epoch end
                    self.epoch += 1
                    self.step_in_epoch = 0
                    self.epoch_end_done = False
                    if self.args.max_epochs is not None and self.epoch >= self.args.max_epochs:
                        break
                self._train_epoch()
        finally:
            self._close_progress()
        _call_hooks(self.hooks, "on_train_end", self)
        if self._done():
            logger.info("Reached max train steps(%s): Training is done.", self.global_step)
        if not args.checkpoint.no_save and self._last_saved_step != self.global_step:
            self.save_checkpoint(self._validate_for_checkpoint())

    _last_saved_step = -1

    def _train_epoch(self) -> None:
        args = self.args
        if self.train_sampler is None:
            raise TrainerError("train() runs after setup(); call run() or setup() first")
        self.train_sampler.set_epoch(self.epoch)
        self.train_sampler.skip = (self.step_in_epoch * args.update_freq
                                   * args.micro_batch_size)
        if self.step_in_epoch == 0:
            _call_hooks(self.hooks, "on_epoch_start", self, self.epoch)
        it = iter(self.train_loader)
        if self._pending_rng is not None:
            # the uninterrupted run created this iterator (drawing its base seed) before
            # the checkpoint's RNG states were taken: restore them only now
            ckpt.set_rng_states(self._pending_rng)
            self._pending_rng = None
        while self.step_in_epoch < self.steps_per_epoch and not self._done():
            batches = [next(it) for _ in range(args.update_freq)]
            self._train_step(batches)
            self.step_in_epoch += 1
            self.global_step += 1
            self._after_step()
        if self.step_in_epoch >= self.steps_per_epoch:
            self._end_epoch()

    def _end_epoch(self) -> None:
        args = self.args
        _call_hooks(self.hooks, "on_epoch_end", self, self.epoch)
        if self.lr_scheduler is not None and args.lr_scheduler.interval == "epoch":
            self.lr_scheduler.step()
        val_loss = None
        if (self.val_loader is not None and args.val_every_n_epochs is not None
                and (self.epoch + 1) % args.val_every_n_epochs == 0):
            val_loss = self.validate()
        self.epoch_end_done = True
        every = args.checkpoint.every_n_epochs
        if not args.checkpoint.no_save and every is not None and (self.epoch + 1) % every == 0:
            self.save_checkpoint(val_loss if val_loss is not None
                                 else self._validate_for_checkpoint())
        if not self._done():
            self.epoch += 1
            self.step_in_epoch = 0
            self.epoch_end_done = False

    def _grad_factor(self, outputs: list[Any], agg: AggregatedOutputs) -> float:
        reduction = self.args.optimizer.grad_reduction
        if reduction == "sum":
            return 1.0
        if reduction == "mean":
            return 1.0 / (self.args.update_freq * self.args.scaling_factor)
        if not agg.num_tokens:
            raise TrainerError(
                "optimizer.grad_reduction='per-token-mean' divides the gradients by the "
                "number of tokens, but this step counted none: forward must return "
                "(loss_sum, num_tokens, ...) or optimizer.aggregate_outputs_fn must give "
                "num_tokens."
            )
        return 1.0 / float(agg.num_tokens)

    def _aggregate(self, outputs: list[Any]) -> AggregatedOutputs:
        """This step's loss sum, batch and token counts over all units (a collective)."""
        fn = self.args.optimizer.aggregate_outputs_fn
        group = dist.group.WORLD if self.distributed else None
        if fn is not None:
            return resolve_object(fn, "optimizer.aggregate_outputs_fn")(outputs, group)
        losses = torch.stack([_first(o).detach().reshape(()).to(torch.float64)
                              for o in outputs])
        values = [losses.sum().cpu(), torch.tensor(float(len(outputs)), dtype=torch.float64)]
        has_tokens = all(isinstance(o, (tuple, list)) and len(o) > 1 for o in outputs)
        if has_tokens:
            values.append(sum(torch.as_tensor(o[1]).detach().to(torch.float64).sum().cpu()
                              for o in outputs))
        packed = torch.stack(values)
        if self.distributed:
            packed = self._all_reduce_units(packed)
        return AggregatedOutputs(
            loss_sum=float(packed[0]), num_batches=int(packed[1]),
            num_tokens=int(packed[2]) if has_tokens else None,
        )

    def _all_reduce_units(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the scale units (every rank of a unit holds the same value)."""
        backend_device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = t.to(backend_device)
        dist.all_reduce(t)
        return (t / self.args.compute_config.plan_ngpus).cpu()

    def _train_step(self, batches: list[Any]) -> None:
        args = self.args
        _call_hooks(self.hooks, "on_train_step_start", self, batches)
        _call_hooks(self.hooks, "on_step_start", self, self.epoch, self.step_in_epoch)
        batches = [self._cast_input(b) for b in batches]
        reduction = args.optimizer.grad_reduction
        loss_factor = 1.0
        if reduction == "mean":
            loss_factor = 1.0 / (args.update_freq * args.scaling_factor)
        if self.loss_scaler is not None:
            loss_factor *= self.loss_scaler.scale
        scale_fn = None if loss_factor == 1.0 else (lambda loss: loss * loss_factor)
        _call_hooks(self.hooks, "before_zero_grad", self)
        # train_step zeroes the gradients first
        outputs = self.model.train_step(batches, scale_fn=scale_fn)
        _call_hooks(self.hooks, "after_zero_grad", self)
        agg = self._aggregate(outputs)
        loss = agg.loss_sum / agg.num_batches if args.optimizer.loss_reduction == "mean" \
            else agg.loss_sum
        self.last_train_loss = loss
        self._last_tokens = agg.num_tokens
        _call_hooks(self.hooks, "after_aggregate_train_step_outputs", self, agg, loss)
        _call_hooks(self.hooks, "before_sync_grad", self)
        self.optimizer.sync_shard_grad()
        _call_hooks(self.hooks, "after_sync_grad", self)
        unscale = 1.0
        if reduction == "per-token-mean":
            unscale = self._grad_factor(outputs, agg)
        if self.loss_scaler is not None:
            unscale /= self.loss_scaler.scale
            if self._overflow():
                self.loss_scaler.update(True)
                self.optimizer.zero_grad()
                logger.info("step %d: gradient overflow in fp16, step skipped; loss scale "
                            "now %g", self.global_step + 1, self.loss_scaler.scale)
                self.last_gnorm = math.nan
                _call_hooks(self.hooks, "on_train_step_end", self, outputs)
                return
            self.loss_scaler.update(False)
        if unscale != 1.0:
            self.optimizer.scale_grads(unscale)
        self.last_gnorm = math.nan
        if args.optimizer.clip_gnorm:
            _call_hooks(self.hooks, "before_gnorm_clip", self)
            gnorm = self.optimizer.clip_gnorm(args.optimizer.clip_gnorm)
            self.last_gnorm = gnorm
            _call_hooks(self.hooks, "after_gnorm_clip", self, gnorm)
        _call_hooks(self.hooks, "before_optimizer_step", self)
        self.optimizer.step()
        _call_hooks(self.hooks, "after_optimizer_step", self)
        if self.lr_scheduler is not None and args.lr_scheduler.interval == "step":
            self.lr_scheduler.step()
        _call_hooks(self.hooks, "on_train_step_end", self, outputs)

    def _overflow(self) -> bool:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        flag = grads_overflow(params)
        if self.distributed:
            backend_device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            flag = flag.to(backend_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _after_step(self) -> None:
        args = self.args
        self._update_progress()
        val_loss = None
        every_val = args.val_every_n_train_steps
        if self.val_loader is not None and every_val and self.global_step % every_val == 0:
            val_loss = self.validate()
        every = args.checkpoint.every_n_train_steps
        if not args.checkpoint.no_save and every and self.global_step % every == 0:
            self.save_checkpoint(val_loss if val_loss is not None
                                 else self._validate_for_checkpoint())

    # -- validation ---------------------------------------------------------------------
    def _validate_for_checkpoint(self) -> float:
        if self.val_loader is None:
            return self.last_train_loss
        return self.validate()

    def validate(self) -> float:
        """The mean validation loss over all units (RNG states untouched)."""
        args = self.args
        states = ckpt.get_rng_states()
        _call_hooks(self.hooks, "on_val_start", self)
        self.model.eval()
        total, count = 0.0, 0
        try:
            it = iter(self.val_loader)
            group: list[Any] = []
            steps = 0
            for batch in it:
                group.append(self._cast_input(batch))
                if len(group) < args.update_freq:
                    continue
                _call_hooks(self.hooks, "on_val_step_start", self, group)
                outputs = self.model.infer_step(group)
                _call_hooks(self.hooks, "on_val_step_end", self, outputs)
                agg = self._aggregate(outputs)
                total += agg.loss_sum
                count += agg.num_batches
                group = []
                steps += 1
                if args.max_val_steps is not None and steps >= args.max_val_steps:
                    break
        finally:
            self.model.train()
            ckpt.set_rng_states(states)
        loss = total / count if count else math.nan
        logger.info("Validation loss after %d steps: %.4f", self.global_step, loss)
        metrics = {"loss": loss}
        _call_hooks(self.hooks, "before_log_val_metrics", self, metrics)
        self._log(metrics, tag="val")
        _call_hooks(self.hooks, "on_val_end", self, loss)
        return loss

    # -- progress and logs --------------------------------------------------------------
    _bar: Any = None

    def _open_progress(self) -> None:
        self._t0 = time.perf_counter()
        self._t_last = self._t0
        self._step_last = self.global_step
        if self.rank != 0 or not self.args.enable_progress_bar:
            return
        from tqdm import tqdm

        self._bar = tqdm(total=self.total_train_steps, initial=self.global_step,
                         desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

    def _close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0].get("lr", math.nan))

    def _update_progress(self) -> None:
        args = self.args
        if self._bar is not None:
            self._bar.update(1)
        if self.global_step % args.log_every_n_steps and not self._done():
            return
        now = time.perf_counter()
        steps = self.global_step - self._step_last
        elapsed = max(now - self._t_last, 1e-9)
        self._t_last, self._step_last = now, self.global_step
        metrics = {"loss": self.last_train_loss, "lr": self._lr(),
                   "samples_per_sec": steps * args.effective_global_batch_size / elapsed}
        tokens = getattr(self, "_last_tokens", None)
        if tokens:
            metrics["tokens_per_sec"] = steps * tokens / elapsed
        gnorm = getattr(self, "last_gnorm", math.nan)
        if torch.is_tensor(gnorm) or not math.isnan(gnorm):
            metrics["gnorm"] = _as_float(gnorm)
        if self.loss_scaler is not None:
            metrics["loss_scale"] = self.loss_scaler.scale
        _call_hooks(self.hooks, "before_log_train_metrics", self, metrics)
        if self._bar is not None:
            speed = (f"{metrics['tokens_per_sec']:.0f} tok/s" if "tokens_per_sec" in metrics
                     else f"{metrics['samples_per_sec']:.1f} samples/s")
            self._bar.set_postfix_str(
                f"loss={metrics['loss']:.4f}, lr={metrics['lr']:.3g}, {speed}", refresh=False)
        elif self.rank == 0:
            total = self.total_train_steps
            extra = "".join(f", {k}={v:.4g}" for k, v in metrics.items() if k != "loss")
            logger.info("Epoch %d: %03d/%s train_loss=%.4f%s", self.epoch, self.global_step,
                        f"{total:03d}" if total is not None else "?", metrics["loss"], extra)
        self._log(metrics, tag="train")

    def _log(self, metrics: dict[str, float], *, tag: str) -> None:
        for log in self.loggers:
            log.log_metrics(metrics, self.global_step, tag=tag)

    def _finalize(self) -> None:
        _call_hooks(self.hooks, "on_finalize", self)
        for log in self.loggers:
            log.finalize()

    # ===================================================================================
    # checkpoints
    # ===================================================================================
    def _plan_fingerprint(self) -> str:
        """A digest of this rank's generated code: equal digests, equal plan."""
        path = Path(type(self.model).generated_dir()) / f"gencode{self.rank}.py"
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    def _status(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.global_step,
            "step_in_epoch": self.step_in_epoch,
            "epoch_end_done": self.epoch_end_done,
            "best_loss": self.best_loss,
            "train_loss": self.last_train_loss,
            "global_batch_size": self.args.effective_global_batch_size,
        }

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _agree(self, ok: bool) -> bool:
        """True when ``ok`` on every rank (a collective)."""
        if not self.distributed:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0])
        if dist.get_backend() == "nccl":
            flag = flag.to(self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return float(flag.item()) == 0.0

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def save_checkpoint(self, loss: float) -> Path:
        """Write the checkpoint of the current position (collective); returns its folder."""
        args = self.args
        cfg = args.checkpoint
        save_dir = Path(cfg.save_dir)
        name = ckpt.checkpoint_name(self.epoch, self.global_step)
        logger.info("Saving checkpoint after %d steps with loss=%.4f.", self.global_step, loss)
        better = loss < self.best_loss
        if better and cfg.save_best:
            logger.info("Best loss updated: %.4f -> %.4f", self.best_loss, loss)
            self.best_loss = loss
        tmp = ckpt.partial_dir(save_dir, name)
        if self.rank == 0:
            save_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)
        self._barrier()
        error: BaseException | None = None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            self._write_state(tmp)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            error = e
        if not self._agree(error is None):
            raise TrainerError(
                f"saving checkpoint {name} failed on at least one rank"
                + (f" (here: {type(error).__name__}: {error})" if error else "")
                + f"; {tmp} is left incomplete and will never be resumed from. Fix the cause "
                f"(disk space, permissions of {save_dir}) and resume from 'last'."
            ) from error
        final = save_dir / name
        plans = self._gather(self._plan_fingerprint())
        error = None
        if self.rank == 0:
            try:
                self._publish(save_dir, name, plans, better)
            except Exception as e:  # noqa: BLE001 - every rank must learn of it
                error = e
        if not self._agree(error is None):
            raise TrainerError(
                f"publishing checkpoint {name} in {save_dir} failed on rank 0"
                + (f" ({type(error).__name__}: {error})" if error else "")
                + ". Fix the cause (disk space, permissions) and resume from 'last'."
            ) from error
        self._barrier()
        self._last_saved_step = self.global_step
        return final

    def _publish(self, save_dir: Path, name: str, plans: Any, better: bool) -> None:
        """Rank 0: rename the finished folder into place, point last/best, rotate."""
        cfg = self.args.checkpoint
        meta = {
            "format": 1,
            "save_type": cfg.save_type,
            "world_size": self.world_size,
            "plan_ngpus": self.args.compute_config.plan_ngpus,
            "plans": plans,
            "train_status": self._status(),
        }
        final = ckpt.publish(save_dir, name, meta)
        logger.info("Saving checkpoint to %s", final)
        if cfg.save_last:
            logger.info("Saving checkpoint as the last checkpoint.")
            ckpt.point(save_dir, "last", final, symlink=cfg.symlink_best_and_last)
        if better and cfg.save_best:
            logger.info("Saving checkpoint as the best checkpoint.")
            ckpt.point(save_dir, "best", final, symlink=cfg.symlink_best_and_last)
        for removed in ckpt.rotate(save_dir, cfg.keep_last_n_checkpoints):
            logger.info("Removed old checkpoint %s", removed)

    def _state(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        _call_hooks(self.hooks, "on_save_checkpoint", self, extra)
        return {
            "lr_scheduler": (self.lr_scheduler.state_dict()
                             if self.lr_scheduler is not None else None),
            "loss_scaler": (self.loss_scaler.state_dict()
                            if self.loss_scaler is not None else None),
            "train_status": self._status(),
            "rng_states": ckpt.get_rng_states(),
            "user": extra,
        }

    def _write_state(self, folder: Path) -> None:
        from nnscaler import checkpoint as ck

        save_type = self.args.checkpoint.save_type
        state = self._state()
        if save_type == "sharded":
            state["model"] = self.model.state_dict()
            state["optimizer"] = self.optimizer.state_dict()
            ck.save(state, ckpt.rank_file(folder, self.rank))
        elif save_type == "deduped":
            state["model"], state["optimizer"] = ck.deduped_state_dict(self.model,
                                                                       self.optimizer)
            ck.save(state, ckpt.rank_file(folder, self.rank))
        else:
            model_sd = _to_cpu(self.model.state_dict())
            opt_sd = _to_cpu(self.optimizer.state_dict())
            gathered = self._gather((model_sd, opt_sd, state["rng_states"]))
            if gathered is not None:  # rank 0
                merged, merged_opt = ck.merge_state_dicts([g[0] for g in gathered],
                                                          [g[1] for g in gathered])
                state["model"], state["optimizer"] = merged, merged_opt
                state["rng_states"] = [g[2] for g in gathered]
                ck.save(state, folder / ckpt.MERGED_FILE)

    def _resume(self) -> None:
        args = self.args
        cfg = args.checkpoint
        resume_from = cfg.resume_from
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if resume_from is None and restarts > 0:
            # a restarted attempt of a self-healing run: carry on from the last checkpoint
            resume_from = "last"
            logger.info("Restart %d of this job: resuming from the last checkpoint.", restarts)
        folder = ckpt.resolve_resume(resume_from, cfg.save_dir)
        if folder is None:
            if resume_from is not None:
                logger.info("No %r checkpoint in %s yet: starting from scratch.", resume_from,
                            cfg.save_dir)
            return
        self.load_checkpoint(folder)

    def load_checkpoint(self, folder: str | os.PathLike[str]) -> None:
        """Restore everything from a checkpoint folder (collective). The same world size
        and plan restore each rank's own file; otherwise the checkpoint is merged and cut
        into this plan's pieces."""
        from nnscaler import checkpoint as ck

        folder = Path(folder)
        meta = ckpt.read_meta(folder)
        logger.info("Resuming from checkpoint %s", folder)
        mine = self._plan_fingerprint()
        same = (meta["save_type"] != "merged" and meta["world_size"] == self.world_size
                and meta["plans"][self.rank] == mine)
        same = self._agree(same)
        if same:
            state = ck.load(ckpt.rank_file(folder, self.rank), map_location="cpu")
            if meta["save_type"] == "sharded":
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
            else:
                ck.load_deduped_state_dict(self.model, state["model"], self.optimizer,
                                           state["optimizer"])
            rng = state["rng_states"]
        else:
            if meta["save_type"] == "merged":
                state = ck.load(folder / ckpt.MERGED_FILE, map_location="cpu")
                merged, merged_opt = state["model"], state["optimizer"]
                rngs = state["rng_states"]
            else:
                states = [ck.load(ckpt.rank_file(folder, r), map_location="cpu")
                          for r in range(meta["world_size"])]
                merged, merged_opt = ck.merge_state_dicts([s["model"] for s in states],
                                                          [s["optimizer"] for s in states])
                rngs = [s["rng_states"] for s in states]
                state = states[0]
            ck.load_merged_state_dicts(self.model, merged, self.optimizer, merged_opt)
            rng = rngs[self.rank] if meta["world_size"] == self.world_size else None
            if rng is None:
                logger.warning("The checkpoint was saved by %d ranks, this job has %d: random "
                               "number generators start from the seed.", meta["world_size"],
                               self.world_size)
        status = state["train_status"]
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        if (status["step_in_epoch"] and not status["epoch_end_done"]
                and status["global_batch_size"] != self.args.effective_global_batch_size):
            raise TrainerError(
                f"the checkpoint {folder} stopped in the middle of an epoch with a global "
                f"batch size of {status['global_batch_size']} samples; this run takes "
                f"{self.args.effective_global_batch_size} per step, so the data position "
                f"cannot be carried over. Fix: keep global_batch_size (micro_batch_size x "
                f"grad_accumulation_steps x scale units) equal, or resume from an epoch end."
            )
        self.epoch = int(status["epoch"])
        self.global_step = int(status["step"])
        self.step_in_epoch = int(status["step_in_epoch"])
        self.epoch_end_done = bool(status["epoch_end_done"])
        self.best_loss = float(status["best_loss"])
        self.last_train_loss = float(status["train_loss"])
        self._last_saved_step = self.global_step
        self._pending_rng = rng
        if rng is not None and self.epoch_end_done:
            # the next iterator is made after this point in the uninterrupted run too
            ckpt.set_rng_states(rng)
            self._pending_rng = None
        _call_hooks(self.hooks, "on_load_checkpoint", self, state.get("user", {}))
        self._barrier()


def _to_cpu(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.cpu() if torch.is_tensor(x) else x, tree)
