"""Building a run: the process group, the datasets and loaders, the first batch for
tracing, the parallelized model and the optimizer with its LR scheduler."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nnscaler.trainer import ckpt_layout as layout
from nnscaler.trainer.collective import is_distributed
from nnscaler.trainer.errors import ConfigError
from nnscaler.trainer.fields import resolve_object

if TYPE_CHECKING:
    from nnscaler.trainer.trainer import Trainer

__all__ = ["Builder", "SkipSampler"]


class SkipSampler(torch.utils.data.Sampler):
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


class Builder:
    """Builds what ``trainer`` trains with, as its ``train_args`` say, into its
    attributes (``model``, ``optimizer``, ``train_loader``, ...)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def init_process_group(self) -> None:
        """Join the job's process group (under torchrun, or more than one process), and
        check that the job has ``runtime_ngpus`` processes."""
        t, args = self.trainer, self.trainer.args
        if not is_distributed():
            torchrun = all(os.environ.get(v) for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                       "MASTER_PORT"))
            if torchrun or args.compute_config.runtime_ngpus > 1:
                from nnscaler.runtime.device import init_distributed

                init_distributed(timeout=args.collective_timeout)
        if is_distributed():
            t.rank, t.world_size = dist.get_rank(), dist.get_world_size()
        if t.world_size != args.compute_config.runtime_ngpus:
            raise ConfigError(
                f"compute_config.runtime_ngpus is {args.compute_config.runtime_ngpus} but "
                f"the job has {t.world_size} processes. Fix: launch "
                f"`torchrun --nproc_per_node={args.compute_config.runtime_ngpus} ...`, or set "
                f"runtime_ngpus to the number of processes (e.g. from $WORLD_SIZE).",
                "compute_config.runtime_ngpus",
            )
        from nnscaler.runtime.device import current_device

        t.device = current_device()

    def seed(self) -> None:
        """Seed every RNG with ``TrainerArgs.seed`` (nothing when it is None)."""
        seed = self.trainer.args.seed
        if seed is None:
            return
        import random

        random.seed(seed)
        torch.manual_seed(seed)
        with contextlib.suppress(ImportError):
            import numpy as np

            np.random.seed(seed)

    # -- data ---------------------------------------------------------------------------
    def build_datasets(self, *, loaders: bool) -> None:
        """The datasets and, with ``loaders``, their samplers (this unit's share) and
        data loaders."""
        t, args = self.trainer, self.trainer.args
        t.train_dataset = args.create_dataset("train")
        t.val_dataset = args.create_dataset("val")
        if loaders:
            self.build_loaders()

    def build_loaders(self) -> None:
        """The samplers (this unit's share of each dataset) and the data loaders."""
        t, args = self.trainer, self.trainer.args
        sampler_cls = resolve_object(args.dataset_sampler.type, "dataset_sampler.type")
        loader_cls = resolve_object(args.dataloader.type, "dataloader.type")
        units = args.compute_config.scale_units
        kw = args.create_kwarg
        sampler = sampler_cls(t.train_dataset, num_replicas=units, rank=t.unit_rank,
                              **kw(args.dataset_sampler.train_args))
        t.train_sampler = SkipSampler(sampler)
        t.train_loader = loader_cls(t.train_dataset, batch_size=args.micro_batch_size,
                                    sampler=t.train_sampler, **kw(args.dataloader.train_args))
        if t.val_dataset is not None:
            val_sampler_args = {"shuffle": False, **kw(args.dataset_sampler.val_args)}
            val_sampler = sampler_cls(t.val_dataset, num_replicas=units,
                                      rank=t.unit_rank, **val_sampler_args)
            val_loader_args = args.dataloader.val_args or args.dataloader.train_args
            t.val_loader = loader_cls(t.val_dataset, batch_size=args.micro_batch_size,
                                      sampler=val_sampler, **kw(val_loader_args))

    def make_dummy_input(self) -> None:
        """A first batch for tracing, built without touching any RNG (so training draws
        the same numbers whether or not the code is generated in this run)."""
        from torch.utils.data import default_collate

        t = self.trainer
        states = layout.get_rng_states()
        try:
            collate = default_collate
            loader_args = t.args.dataloader.train_args
            if "collate_fn" in loader_args:
                collate = resolve_object(loader_args["collate_fn"], "dataloader.train_args."
                                                                    "collate_fn")
            samples = [t.train_dataset[i % len(t.train_dataset)]
                       for i in range(t.args.micro_batch_size)]
            t.dummy_input = t.precision.cast_input(collate(samples), t.device)
        finally:
            layout.set_rng_states(states)

    # -- model --------------------------------------------------------------------------
    def model_class(self) -> type:
        cls = resolve_object(self.trainer.args.model.type, "model.type")
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise ConfigError(
                f"model.type must be a torch.nn.Module subclass (or its import path), got "
                f"{cls!r}. Fix: name the model class; its constructor gets model.args.",
                "model.type",
            )
        return cls

    def _module_fn(self) -> Callable[[], torch.nn.Module]:
        args = self.trainer.args
        cls = self.model_class()

        def build() -> torch.nn.Module:
            if self.meta_parameters():
                from nnscaler.checkpoint import meta_parameters

                with meta_parameters():
                    return cls(**args.create_kwarg(args.model.args, "model.args"))
            model = cls(**args.create_kwarg(args.model.args, "model.args"))
            if args.tracing_from_weights is not None:
                from nnscaler.checkpoint import load

                model.load_state_dict(load(args.tracing_from_weights))
            return model

        return build

    def meta_parameters(self) -> bool:
        """Pretrained weights with a meta trace: the model is built without its weights."""
        args = self.trainer.args
        return (args.model.pretrained is not None
                and args.compute_config.trace_strategy == "meta")

    def parallelize(self, *, load_module: bool) -> Any:
        """``nnscaler.parallelize`` the model class on the dummy input; the parallel
        module class (with ``load_module``)."""
        from nnscaler.parallel import parallelize

        t, args = self.trainer, self.trainer.args
        reuse = args.gen_reuse
        if reuse == "auto":
            reuse = "moo" if args.run_mode == "compile" else "match"
        strategy = args.broadcast_strategy if is_distributed() else "none"
        forward_arg = self._forward_arg_name()
        return parallelize(
            self.model_class(),
            {forward_arg: t.dummy_input},
            args.pas_policy,
            args.compute_config,
            gen_savedir=args.gen_savedir,
            reuse=reuse,
            instance_name=args.instance_name,
            load_module=load_module,
            module_dtype=t.precision.module_dtype,
            module_fn=self._module_fn(),
            broadcast_strategy=strategy,
        )

    def build_model(self) -> torch.nn.Module:
        """The model to train: the parallel module of the whole model, or (with
        ``model.parallel_modules``) the model with those submodules parallelized."""
        t, args = self.trainer, self.trainer.args
        if args.model.parallel_modules:
            from nnscaler.trainer.submodules import build_with_parallel_submodules

            return build_with_parallel_submodules(t, load_module=True, model_fn=self._module_fn())
        cls = self.parallelize(load_module=True)
        return cls(init_params=not self.meta_parameters())

    def resolve_compute_config(self) -> None:
        """After `build_model`: the Trainer's ``compute_config`` with what ``parallelize``
        chose for its ``'auto'`` fields (the unit size, the ZeRO stage), read from the
        parallel modules, and the batch sizes checked against the scale units."""
        from nnscaler.parallel.optimizer import as_chosen
        from nnscaler.runtime.module import ParallelModule

        t, args = self.trainer, self.trainer.args
        pms = [m for m in t.model.modules() if isinstance(m, ParallelModule)]
        args.resolve(as_chosen(args.compute_config, pms, pms[0].plan_ngpus))

    def compile_model(self) -> None:
        """Generate the code of every rank (``run_mode='compile'``)."""
        args = self.trainer.args
        if args.model.parallel_modules:
            from nnscaler.trainer.submodules import build_with_parallel_submodules

            build_with_parallel_submodules(self.trainer, load_module=False,
                                           model_fn=self._module_fn())
            return
        self.parallelize(load_module=False)

    def _forward_arg_name(self) -> str:
        import inspect

        cls = self.model_class()
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
    def build_optimizer(self) -> None:
        """The optimizer over the parallel model (fp32 master weights below fp32), the
        loss scaler (fp16) and the LR scheduler."""
        from nnscaler.parallel import build_optimizer

        t, args = self.trainer, self.trainer.args
        opt_type = resolve_object(args.optimizer.type, "optimizer.type")
        opt_type = t.precision.optimizer_class(opt_type)
        t.loss_scaler = t.precision.loss_scaler()
        t.optimizer = build_optimizer(t.model, opt_type,
                                      **args.create_kwarg(args.optimizer.args, "optimizer.args"))
        if args.lr_scheduler is not None:
            sched_type = resolve_object(args.lr_scheduler.type, "lr_scheduler.type")
            t.lr_scheduler = sched_type(t.optimizer, **args.create_kwarg(
                args.lr_scheduler.args, "lr_scheduler.args"))
