"""The training loop: epochs of steps (each ``grad_accumulation_steps`` micro-batches
per scale unit, then one optimizer update), validation, and when to validate and save.

A step's gradients, summed over micro-batches and units by the reducers, are scaled as
``optimizer.grad_reduction`` says: ``'mean'`` and fp16 loss scaling scale the loss before
backward; ``'per-token-mean'`` (and the loss scale's inverse) scale the gradients after.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nnscaler.ops.builtin.moe import record_routing
from nnscaler.trainer import ckpt_layout as layout
from nnscaler.trainer.args import AggregatedOutputs
from nnscaler.trainer.collective import is_distributed, sum_over_units
from nnscaler.trainer.errors import ConfigError, TrainerError
from nnscaler.trainer.fields import resolve_object
from nnscaler.trainer.hooks import call_hooks
from nnscaler.trainer.progress import logger

if TYPE_CHECKING:
    from nnscaler.trainer.trainer import Trainer

__all__ = ["StepLoop"]


def _first(out: Any) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


class StepLoop:
    """Trains and validates ``trainer``'s model, advancing its position (``epoch``,
    ``global_step``, ``step_in_epoch``) and calling its hooks."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    # -- the position -------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        t = self.trainer
        return len(t.train_loader) // t.args.update_freq

    @property
    def total_train_steps(self) -> int | None:
        args = self.trainer.args
        limits = []
        if args.max_train_steps is not None:
            limits.append(args.max_train_steps)
        if args.max_epochs is not None:
            limits.append(args.max_epochs * self.steps_per_epoch)
        return min(limits) if limits else None

    def done(self) -> bool:
        total = self.total_train_steps
        return total is not None and self.trainer.global_step >= total

    # -- the loop -----------------------------------------------------------------------
    def train(self) -> None:
        """Train from the current position to the end, then save a last checkpoint."""
        t, args = self.trainer, self.trainer.args
        self._check_can_train()
        logger.info("Training...")
        call_hooks(t.hooks, "on_train_start", t)
        t.model.train()
        t.progress.open()
        try:
            while not self.done():
                if t.epoch_end_done:  # resumed from a checkpoint taken at an epoch end
                    t.epoch += 1
                    t.step_in_epoch = 0
                    t.epoch_end_done = False
                    if args.max_epochs is not None and t.epoch >= args.max_epochs:
                        break
                self._train_epoch()
        finally:
            t.progress.close()
        call_hooks(t.hooks, "on_train_end", t)
        if self.done():
            logger.info("Reached max train steps(%s): Training is done.", t.global_step)
        if not args.checkpoint.no_save and t.checkpointer.last_saved_step != t.global_step:
            t.save_checkpoint(self.validate_for_checkpoint())

    def _check_can_train(self) -> None:
        t, args = self.trainer, self.trainer.args
        if self.steps_per_epoch == 0:
            raise TrainerError(
                f"an epoch has no step: each unit gets {len(t.train_loader)} micro-batches "
                f"of {args.micro_batch_size} samples, and a step takes {args.update_freq}. "
                f"Fix: a larger dataset, or smaller micro_batch_size / "
                f"grad_accumulation_steps / global_batch_size."
            )
        if args.max_train_steps is None and args.max_epochs is None:
            raise ConfigError("set max_train_steps or max_epochs: the Trainer would never stop.",
                              "max_train_steps")

    def _train_epoch(self) -> None:
        t, args = self.trainer, self.trainer.args
        if t.train_sampler is None:
            raise TrainerError("train() runs after setup(); call run() or setup() first")
        t.train_sampler.set_epoch(t.epoch)
        t.train_sampler.skip = (t.step_in_epoch * args.update_freq
                                * args.micro_batch_size)
        if t.step_in_epoch == 0:
            call_hooks(t.hooks, "on_epoch_start", t, t.epoch)
        it = iter(t.train_loader)
        t.checkpointer.restore_pending_rng()
        while t.step_in_epoch < self.steps_per_epoch and not self.done():
            batches = [next(it) for _ in range(args.update_freq)]
            self.train_step(batches)
            t.step_in_epoch += 1
            t.global_step += 1
            self.after_step()
        if t.step_in_epoch >= self.steps_per_epoch:
            self._end_epoch()

    def _end_epoch(self) -> None:
        t, args = self.trainer, self.trainer.args
        call_hooks(t.hooks, "on_epoch_end", t, t.epoch)
        if t.lr_scheduler is not None and args.lr_scheduler.interval == "epoch":
            t.lr_scheduler.step()
        val_loss = None
        if (t.val_loader is not None and args.val_every_n_epochs is not None
                and (t.epoch + 1) % args.val_every_n_epochs == 0):
            val_loss = self.validate()
        t.epoch_end_done = True
        every = args.checkpoint.every_n_epochs
        if not args.checkpoint.no_save and every is not None and (t.epoch + 1) % every == 0:
            t.save_checkpoint(val_loss if val_loss is not None
                              else self.validate_for_checkpoint())
        if not self.done():
            t.epoch += 1
            t.step_in_epoch = 0
            t.epoch_end_done = False

    def after_step(self) -> None:
        """After a step: the progress bar and logs, then validation and a checkpoint when
        their interval ends here."""
        t, args = self.trainer, self.trainer.args
        t.progress.update(done=self.done())
        val_loss = None
        every_val = args.val_every_n_train_steps
        if t.val_loader is not None and every_val and t.global_step % every_val == 0:
            val_loss = self.validate()
        every = args.checkpoint.every_n_train_steps
        if not args.checkpoint.no_save and every and t.global_step % every == 0:
            t.save_checkpoint(val_loss if val_loss is not None
                              else self.validate_for_checkpoint())

    # -- one step -----------------------------------------------------------------------
    def train_step(self, batches: list[Any]) -> None:
        """One optimizer update on this unit's micro-batches ``batches``."""
        t, args = self.trainer, self.trainer.args
        call_hooks(t.hooks, "on_train_step_start", t, batches)
        call_hooks(t.hooks, "on_step_start", t, t.epoch, t.step_in_epoch)
        batches = [t.precision.cast_input(b, t.device) for b in batches]
        scale_fn = self._loss_scale_fn()
        call_hooks(t.hooks, "before_zero_grad", t)
        # train_step zeroes the gradients first; what the MoE layers routed is logged
        with record_routing() as routing:
            if args.model.parallel_modules:  # the whole model around its parallel submodules
                from nnscaler.trainer import submodules

                t.optimizer.zero_grad()
                outputs = submodules.train_step(t.model, batches, scale_fn)
            else:
                outputs = t.model.train_step(batches, scale_fn=scale_fn)
        t.last_routing = routing
        call_hooks(t.hooks, "after_zero_grad", t)
        agg = self.aggregate(outputs)
        loss = agg.loss_sum / agg.num_batches if args.optimizer.loss_reduction == "mean" \
            else agg.loss_sum
        t.last_train_loss = loss
        t.last_tokens = agg.num_tokens
        call_hooks(t.hooks, "after_aggregate_train_step_outputs", t, agg, loss)
        call_hooks(t.hooks, "before_sync_grad", t)
        t.optimizer.sync_shard_grad()
        call_hooks(t.hooks, "after_sync_grad", t)
        if self._unscale_grads(agg):
            self._clip_and_step()
        call_hooks(t.hooks, "on_train_step_end", t, outputs)

    def _loss_scale_fn(self) -> Any:
        """What multiplies each micro-batch's loss before backward (None: nothing)."""
        t, args = self.trainer, self.trainer.args
        loss_factor = 1.0
        if args.optimizer.grad_reduction == "mean":
            loss_factor = 1.0 / (args.update_freq * args.scaling_factor)
        if t.loss_scaler is not None:
            loss_factor *= t.loss_scaler.scale
        return None if loss_factor == 1.0 else (lambda loss: loss * loss_factor)

    def _unscale_grads(self, agg: AggregatedOutputs) -> bool:
        """Scale the summed gradients as ``grad_reduction`` and the loss scale say;
        False when an fp16 gradient overflowed (the step is skipped)."""
        t = self.trainer
        unscale = 1.0
        if t.args.optimizer.grad_reduction == "per-token-mean":
            unscale = self._per_token_factor(agg)
        if t.loss_scaler is not None:
            unscale /= t.loss_scaler.scale
            if t.precision.overflowed(t.optimizer, t.device):
                t.loss_scaler.update(True)
                t.optimizer.zero_grad()
                logger.info("step %d: gradient overflow in fp16, step skipped; loss scale "
                            "now %g", t.global_step + 1, t.loss_scaler.scale)
                t.last_gnorm = math.nan
                return False
            t.loss_scaler.update(False)
        if unscale != 1.0:
            t.optimizer.scale_grads(unscale)
        return True

    def _per_token_factor(self, agg: AggregatedOutputs) -> float:
        if not agg.num_tokens:
            raise TrainerError(
                "optimizer.grad_reduction='per-token-mean' divides the gradients by the "
                "number of tokens, but this step counted none: forward must return "
                "(loss_sum, num_tokens, ...) or optimizer.aggregate_outputs_fn must give "
                "num_tokens."
            )
        return 1.0 / float(agg.num_tokens)

    def _clip_and_step(self) -> None:
        t, args = self.trainer, self.trainer.args
        if args.debug.check_gradient_sync_cross_devices:
            from nnscaler.trainer.debug import check_gradient_sync

            check_gradient_sync(t.model, t.optimizer)
        # as in nnScaler, the norm is computed (and the hooks run) every step; it is
        # clipped only when optimizer.clip_gnorm is set
        call_hooks(t.hooks, "before_gnorm_clip", t)
        gnorm = t.optimizer.clip_gnorm(args.optimizer.clip_gnorm or None)
        t.last_gnorm = gnorm
        call_hooks(t.hooks, "after_gnorm_clip", t, gnorm)
        call_hooks(t.hooks, "before_optimizer_step", t)
        t.optimizer.step()
        call_hooks(t.hooks, "after_optimizer_step", t)
        if t.lr_scheduler is not None and args.lr_scheduler.interval == "step":
            t.lr_scheduler.step()

    def aggregate(self, outputs: list[Any]) -> AggregatedOutputs:
        """This step's loss sum, batch and token counts over all units (a collective)."""
        t = self.trainer
        fn = t.args.optimizer.aggregate_outputs_fn
        group = dist.group.WORLD if is_distributed() else None
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
        if is_distributed():
            packed = sum_over_units(packed, t.device, t.args.compute_config.plan_ngpus)
        return AggregatedOutputs(
            loss_sum=float(packed[0]), num_batches=int(packed[1]),
            num_tokens=int(packed[2]) if has_tokens else None,
        )

    # -- validation ---------------------------------------------------------------------
    def validate_for_checkpoint(self) -> float:
        """The loss a checkpoint is ranked by: validation's, else the last train loss."""
        t = self.trainer
        if t.val_loader is None:
            return t.last_train_loss
        return self.validate()

    def validate(self) -> float:
        """The mean validation loss over all units (RNG states untouched)."""
        t = self.trainer
        states = layout.get_rng_states()
        call_hooks(t.hooks, "on_val_start", t)
        t.model.eval()
        try:
            total, count = self._val_loss_sum()
        finally:
            t.model.train()
            layout.set_rng_states(states)
        loss = total / count if count else math.nan
        logger.info("Validation loss after %d steps: %.4f", t.global_step, loss)
        metrics = {"loss": loss}
        call_hooks(t.hooks, "before_log_val_metrics", t, metrics)
        t.progress.log(metrics, tag="val")
        call_hooks(t.hooks, "on_val_end", t, loss)
        return loss

    def _val_loss_sum(self) -> tuple[float, int]:
        t, args = self.trainer, self.trainer.args
        total, count = 0.0, 0
        group: list[Any] = []
        steps = 0
        for batch in iter(t.val_loader):
            group.append(t.precision.cast_input(batch, t.device))
            if len(group) < args.update_freq:
                continue
            call_hooks(t.hooks, "on_val_step_start", t, group)
            if t.args.model.parallel_modules:
                from nnscaler.trainer import submodules

                outputs = submodules.infer_step(t.model, group)
            else:
                outputs = t.model.infer_step(group)
            call_hooks(t.hooks, "on_val_step_end", t, outputs)
            agg = self.aggregate(outputs)
            total += agg.loss_sum
            count += agg.num_batches
            group = []
            steps += 1
            if args.max_val_steps is not None and steps >= args.max_val_steps:
                break
        return total, count
