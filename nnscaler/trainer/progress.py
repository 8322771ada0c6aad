"""Progress and logs: the progress bar, the training metrics every
``log_every_n_steps``, the metric loggers (``TrainerArgs.log``), and the logger every
part of the Trainer writes its messages to."""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nnscaler.ops.builtin.moe import routing_metrics
from nnscaler.trainer.fields import resolve_object
from nnscaler.trainer.hooks import call_hooks

if TYPE_CHECKING:
    from nnscaler.trainer.trainer import Trainer

__all__ = ["Progress", "logger"]

# the name nnScaler users filter on: the Trainer's messages kept it when the Trainer
# moved out of nnscaler.cli
logger = logging.getLogger("nnscaler.cli.trainer")


class _RankZeroFilter(logging.Filter):
    """Informational records of the Trainer come from rank 0 only (warnings from all)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


logger.addFilter(_RankZeroFilter())


def _as_float(x: Any) -> float:
    return float(x.item()) if torch.is_tensor(x) else float(x)


class Progress:
    """The progress bar (rank 0, ``enable_progress_bar``), the train metrics and the
    metric loggers of ``trainer``."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.bar: Any = None
        self._t_last = 0.0
        self._step_last = 0

    def build_loggers(self) -> None:
        """Rank 0 builds the loggers of ``TrainerArgs.log`` (a registered name or a
        class), each set up with the whole configuration."""
        t = self.trainer
        if t.rank != 0:
            return
        from nnscaler.plugins import get_plugin_manager

        for i, cfg in enumerate(t.args.log):
            ref = cfg.type
            if isinstance(ref, str) and "." not in ref:
                cls = get_plugin_manager().loggers.get(ref)
            else:
                cls = resolve_object(ref, f"log.{i}.type")
            log = cls(**t.args.create_kwarg(cfg.args, f"log.{i}.args"))
            log.setup(t.args.to_dict())
            t.loggers.append(log)

    def open(self) -> None:
        t = self.trainer
        self._t_last = time.perf_counter()
        self._step_last = t.global_step
        if t.rank != 0 or not t.args.enable_progress_bar:
            return
        from tqdm import tqdm

        self.bar = tqdm(total=t.total_train_steps, initial=t.global_step,
                        desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def update(self, *, done: bool) -> None:
        """After a step: advance the bar; every ``log_every_n_steps`` steps (and at the
        last) show and log the train metrics."""
        t = self.trainer
        if self.bar is not None:
            self.bar.update(1)
        if t.global_step % t.args.log_every_n_steps and not done:
            return
        metrics = self._train_metrics()
        call_hooks(t.hooks, "before_log_train_metrics", t, metrics)
        self._show(metrics)
        self.log(metrics, tag="train")

    def _train_metrics(self) -> dict[str, float]:
        t = self.trainer
        now = time.perf_counter()
        steps = t.global_step - self._step_last
        elapsed = max(now - self._t_last, 1e-9)
        self._t_last, self._step_last = now, t.global_step
        lr = float(t.optimizer.param_groups[0].get("lr", math.nan))
        metrics = {"loss": t.last_train_loss, "lr": lr,
                   "samples_per_sec": steps * t.args.effective_global_batch_size / elapsed}
        tokens = t.last_tokens
        if tokens:
            metrics["tokens_per_sec"] = steps * tokens / elapsed
        gnorm = t.last_gnorm
        if torch.is_tensor(gnorm) or not math.isnan(gnorm):
            metrics["gnorm"] = _as_float(gnorm)
        if t.loss_scaler is not None:
            metrics["loss_scale"] = t.loss_scaler.scale
        metrics.update(routing_metrics(t.last_routing))
        return metrics

    def _show(self, metrics: dict[str, float]) -> None:
        t = self.trainer
        if self.bar is not None:
            speed = (f"{metrics['tokens_per_sec']:.0f} tok/s" if "tokens_per_sec" in metrics
                     else f"{metrics['samples_per_sec']:.1f} samples/s")
            self.bar.set_postfix_str(
                f"loss={metrics['loss']:.4f}, lr={metrics['lr']:.3g}, {speed}", refresh=False)
        elif t.rank == 0:
            total = t.total_train_steps
            extra = "".join(f", {k}={v:.4g}" for k, v in metrics.items()
                            if k != "loss" and not k.startswith("moe/"))
            logger.info("Epoch %d: %03d/%s train_loss=%.4f%s", t.epoch, t.global_step,
                        f"{total:03d}" if total is not None else "?", metrics["loss"], extra)

    def log(self, metrics: dict[str, float], *, tag: str) -> None:
        """Hand ``metrics`` to every metric logger, at the current step."""
        t = self.trainer
        for log in t.loggers:
            log.log_metrics(metrics, t.global_step, tag=tag)

    def finalize(self) -> None:
        call_hooks(self.trainer.hooks, "on_finalize", self.trainer)
        for log in self.trainer.loggers:
            log.finalize()
