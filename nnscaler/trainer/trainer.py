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

The Trainer holds the run's state (what it built and where training stands; hooks read
it) and hands the work to its parts: `Builder` (process
group, data, model, optimizer), `StepLoop` (the loop, a
step, validation), `Precision`,
`Progress` (progress bar and metric loggers) and
`Checkpointer` (saving and resuming).
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from typing import Any

import torch

from nnscaler.config import AUTO
from nnscaler.trainer.args import TrainerArgs
from nnscaler.trainer.build import Builder, SkipSampler
from nnscaler.trainer.checkpointer import Checkpointer
from nnscaler.trainer.collective import all_gather, is_distributed, wake_local_peers
from nnscaler.trainer.errors import TrainerError
from nnscaler.trainer.fields import resolve_object
from nnscaler.trainer.hooks import TrainHook, build_hooks, call_hooks
from nnscaler.trainer.precision import DynamicLossScaler, Precision
from nnscaler.trainer.progress import Progress, logger
from nnscaler.trainer.step import StepLoop

__all__ = ["TrainHook", "Trainer", "TrainerError"]


class Trainer:
    """Trains ``train_args.model`` as ``train_args`` says; see the module docstring.

    ``argv``: command-line arguments of ``nnscaler-train`` (``-f config.yaml`` and
    dotted overrides), used when ``train_args`` is None. ``train_args``: a
    `TrainerArgs` or a mapping of its fields.
    """

    def __init__(self, argv: list[str] | None = None, *,
                 train_args: TrainerArgs | dict[str, Any] | None = None) -> None:
        if train_args is None:
            from nnscaler.trainer.cmdline import parse_args

            train_args = parse_args(argv or [])
        elif argv is not None:
            raise TrainerError("give either argv or train_args, not both")
        if not isinstance(train_args, TrainerArgs):
            train_args = TrainerArgs.from_dict(train_args)
        self.train_args = train_args
        self.rank = 0
        self.world_size = 1
        self.device = torch.device("cpu")
        self.model: Any = None
        self.optimizer: Any = None
        self.lr_scheduler: Any = None
        self.loss_scaler: DynamicLossScaler | None = None
        self.train_dataset: Any = None
        self.val_dataset: Any = None
        self.train_loader: Any = None
        self.val_loader: Any = None
        self.train_sampler: SkipSampler | None = None
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
        self.last_tokens: int | None = None
        self.last_gnorm: Any = math.nan
        self.last_routing: list = []  # the MoE layers' RoutingRecords of the last step
        self.train_status: dict[str, Any] = {}
        # the parts, each working on this Trainer's state
        self.builder = Builder(self)
        self.precision = Precision(train_args)
        self.loop = StepLoop(self)
        self.progress = Progress(self)
        self.checkpointer = Checkpointer(self)
        self._peers: list[tuple[str, int]] = []
        self._setup_done = False

    @property
    def args(self) -> TrainerArgs:
        return self.train_args

    @property
    def distributed(self) -> bool:
        return is_distributed()

    @property
    def unit_rank(self) -> int:
        """This rank's scale unit (its data-parallel rank)."""
        return self.rank // self.args.compute_config.plan_ngpus

    @property
    def steps_per_epoch(self) -> int:
        return self.loop.steps_per_epoch

    @property
    def total_train_steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch (nnScaler's name of `steps_per_epoch`)."""
        return self.loop.steps_per_epoch

    @property
    def total_train_steps(self) -> int | None:
        return self.loop.total_train_steps

    @classmethod
    def merge_checkpoint(cls, checkpoint_files: list[str | os.PathLike[str]],
                         output_file: str | os.PathLike[str]) -> None:
        """Merge the per-rank files of one checkpoint (every rank's, sharded or deduped)
        into one file that the original (single-device) model and optimizer load, and
        that ``checkpoint.resume_from`` accepts for any plan (nnScaler's classmethod; one
        process, no process group). The file is written under a temporary name, then
        renamed."""
        from nnscaler.trainer.merge import merge_checkpoint_files

        merge_checkpoint_files(checkpoint_files, output_file)

    # -- the phases of a run ------------------------------------------------------------
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
        self.builder.seed()
        self.builder.build_datasets(loaders=False)
        self.builder.make_dummy_input()
        self.builder.compile_model()
        logger.info("Compiled %s for %d ranks into %s",
                    self.builder.model_class().__qualname__,
                    args.compute_config.runtime_ngpus, args.gen_savedir)

    def setup(self) -> None:
        """Everything before the first step: process group, data, model, optimizer,
        scheduler, loggers, hooks, and the checkpoint to resume from."""
        args = self.args
        build = self.builder
        build.init_process_group()
        self._peers = all_gather((socket.gethostname(), os.getpid()), self.world_size)
        if args.init_env_fn is not None:
            resolve_object(args.init_env_fn, "init_env_fn")(self)
        build.seed()
        auto = args.compute_config.plan_ngpus == AUTO  # the plan chooses the scale units
        build.build_datasets(loaders=not auto)
        build.make_dummy_input()
        self.model = build.build_model()
        build.resolve_compute_config()
        if auto:
            build.build_loaders()
        if args.model.pretrained is not None:
            from nnscaler.checkpoint import load_pretrained

            load_pretrained(self.model, args.model.pretrained)
        build.seed()  # ranks leave parallelize with different RNG states; even them out
        build.build_optimizer()
        self.progress.build_loggers()
        self.hooks = build_hooks(args, self.optimizer, self.lr_scheduler)
        self.checkpointer.resume()
        self._setup_done = True
        call_hooks(self.hooks, "after_setup", self)

    def train(self) -> None:
        """The training loop (after `setup`)."""
        try:
            self.loop.train()
        except BaseException:
            wake_local_peers(self._peers, self.rank)
            raise

    def validate(self) -> float:
        """The mean validation loss over all units (RNG states untouched)."""
        return self.loop.validate()

    def save_checkpoint(self, loss: float) -> Path:
        """Write the checkpoint of the current position (collective); returns its folder."""
        return self.checkpointer.save(loss)

    def load_checkpoint(self, folder: str | os.PathLike[str]) -> None:
        """Restore everything from a checkpoint folder (collective). The same world size
        and plan restore each rank's own file; otherwise the checkpoint is merged and cut
        into this plan's pieces."""
        self.checkpointer.load(folder)

    def _finalize(self) -> None:
        self.progress.finalize()
