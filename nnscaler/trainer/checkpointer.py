"""Checkpoints of a run and resuming from them.

A checkpoint holds the model, the optimizer, the LR scheduler, the loss scaler, every
RNG and the training position, so that a resumed run equals the uninterrupted one
bitwise (same world size and plan). Each rank writes its part into a ``.partial``
folder; rank 0 renames it into place only when every rank reported success (the folder
layout is `nnscaler.trainer.ckpt_layout`). Resuming with the same world size and
plan reads each rank's own file; otherwise the checkpoint is merged and cut into this
plan's pieces.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from nnscaler.gendir import gencode_name
from nnscaler.trainer import ckpt_layout as layout
from nnscaler.trainer.collective import agree, barrier, gather
from nnscaler.trainer.errors import TrainerError
from nnscaler.trainer.hooks import call_hooks
from nnscaler.trainer.progress import logger

if TYPE_CHECKING:
    from nnscaler.trainer.trainer import Trainer

__all__ = ["Checkpointer"]


def _to_cpu(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.cpu() if torch.is_tensor(x) else x, tree)


class Checkpointer:
    """Saves ``trainer``'s state as ``TrainerArgs.checkpoint`` says, and restores it."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        #: the global step of the last checkpoint saved or resumed from
        self.last_saved_step = -1
        # RNG states of a checkpoint taken mid-epoch, restored when the epoch's data
        # iterator has been made (as it was before the checkpoint in the original run)
        self.pending_rng: dict[str, Any] | None = None

    def plan_fingerprint(self) -> str:
        """A digest of this rank's generated code: equal digests, equal plan."""
        from nnscaler.runtime.module import ParallelModule

        t = self.trainer
        digest = hashlib.sha256()
        classes = dict.fromkeys(type(m) for m in t.model.modules()
                                if isinstance(m, ParallelModule))
        for cls in classes:  # the whole model, or each parallel submodule type
            digest.update((Path(cls.generated_dir()) / gencode_name(t.rank)).read_bytes())
        return digest.hexdigest()[:16]

    def status(self) -> dict[str, Any]:
        """The training position and the numbers saved with it."""
        t = self.trainer
        return {
            "epoch": t.epoch,
            "step": t.global_step,
            "step_in_epoch": t.step_in_epoch,
            "epoch_end_done": t.epoch_end_done,
            "best_loss": t.best_loss,
            "train_loss": t.last_train_loss,
            "global_batch_size": t.args.effective_global_batch_size,
        }

    # -- saving -------------------------------------------------------------------------
    def save(self, loss: float) -> Path:
        """Write the checkpoint of the current position (collective); returns its folder."""
        t = self.trainer
        cfg = t.args.checkpoint
        save_dir = Path(cfg.save_dir)
        name = layout.checkpoint_name(t.epoch, t.global_step)
        logger.info("Saving checkpoint after %d steps with loss=%.4f.", t.global_step, loss)
        better = loss < t.best_loss
        if better and cfg.save_best:
            logger.info("Best loss updated: %.4f -> %.4f", t.best_loss, loss)
            t.best_loss = loss
        self._write_everywhere(save_dir, name)
        plans = gather(self.plan_fingerprint(), t.rank, t.world_size)
        error: BaseException | None = None
        if t.rank == 0:
            try:
                self._publish(save_dir, name, plans, better)
            except Exception as e:  # noqa: BLE001 - every rank must learn of it
                error = e
        if not agree(error is None, t.device):
            raise TrainerError(
                f"publishing checkpoint {name} in {save_dir} failed on rank 0"
                + (f" ({type(error).__name__}: {error})" if error else "")
                + ". Fix the cause (disk space, permissions) and resume from 'last'."
            ) from error
        barrier()
        self.last_saved_step = t.global_step
        return save_dir / name

    def _write_everywhere(self, save_dir: Path, name: str) -> None:
        """Every rank writes its part into the checkpoint's ``.partial`` folder; raises
        on every rank when one failed."""
        t = self.trainer
        tmp = layout.partial_dir(save_dir, name)
        if t.rank == 0:
            save_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)
        barrier()
        error: BaseException | None = None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            self.write_state(tmp)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            error = e
        if not agree(error is None, t.device):
            raise TrainerError(
                f"saving checkpoint {name} failed on at least one rank"
                + (f" (here: {type(error).__name__}: {error})" if error else "")
                + f"; {tmp} is left incomplete and will never be resumed from. Fix the cause "
                f"(disk space, permissions of {save_dir}) and resume from 'last'."
            ) from error

    def _publish(self, save_dir: Path, name: str, plans: Any, better: bool) -> None:
        """Rank 0: rename the finished folder into place, point last/best, rotate."""
        t = self.trainer
        cfg = t.args.checkpoint
        meta = {
            "format": 1,
            "save_type": cfg.save_type,
            "world_size": t.world_size,
            "plan_ngpus": t.args.compute_config.plan_ngpus,
            "plans": plans,
            "train_status": self.status(),
        }
        final = layout.publish(save_dir, name, meta)
        logger.info("Saving checkpoint to %s", final)
        if cfg.save_last:
            logger.info("Saving checkpoint as the last checkpoint.")
            layout.point(save_dir, "last", final, symlink=cfg.symlink_best_and_last)
        if better and cfg.save_best:
            logger.info("Saving checkpoint as the best checkpoint.")
            layout.point(save_dir, "best", final, symlink=cfg.symlink_best_and_last)
        for removed in layout.rotate(save_dir, cfg.keep_last_n_checkpoints):
            logger.info("Removed old checkpoint %s", removed)

    def _state(self) -> dict[str, Any]:
        t = self.trainer
        extra: dict[str, Any] = {}
        call_hooks(t.hooks, "on_save_checkpoint", t, extra)
        return {
            "lr_scheduler": (t.lr_scheduler.state_dict()
                             if t.lr_scheduler is not None else None),
            "loss_scaler": (t.loss_scaler.state_dict()
                            if t.loss_scaler is not None else None),
            "train_status": self.status(),
            "rng_states": layout.get_rng_states(),
            "user": extra,
        }

    def write_state(self, folder: Path) -> None:
        """Write this rank's part of the checkpoint into ``folder`` (merged: rank 0
        writes the whole)."""
        from nnscaler import checkpoint as ck

        t = self.trainer
        save_type = t.args.checkpoint.save_type
        state = self._state()
        if save_type == "sharded":  # ZeRO stage 3: the rank's shards, nothing gathered
            state["model"] = ck.rank_state_dict(t.model)
            state["optimizer"] = t.optimizer.state_dict()
            ck.save(state, layout.rank_file(folder, t.rank))
        elif save_type == "deduped":
            state["model"], state["optimizer"] = ck.deduped_state_dict(t.model, t.optimizer)
            ck.save(state, layout.rank_file(folder, t.rank))
        else:
            model_sd = _to_cpu(ck.rank_state_dict(t.model))
            opt_sd = _to_cpu(t.optimizer.state_dict())
            gathered = gather((model_sd, opt_sd, state["rng_states"]), t.rank, t.world_size)
            if gathered is not None:  # rank 0
                merged, merged_opt = ck.merge_state_dicts([g[0] for g in gathered],
                                                          [g[1] for g in gathered])
                state["model"], state["optimizer"] = merged, merged_opt
                state["rng_states"] = [g[2] for g in gathered]
                ck.save(state, folder / layout.MERGED_FILE)

    # -- resuming -----------------------------------------------------------------------
    def resume(self) -> None:
        """Load ``checkpoint.resume_from`` when it exists (``'last'`` after a restart of
        a self-healing job). A `ResumeOptions` may name a merged file of any name
        (``Trainer.merge_checkpoint``'s output), with a ``convert_fn`` for its contents,
        and force (``with_merged``) or forbid loading a folder through the merged state."""
        cfg = self.trainer.args.checkpoint
        options = cfg.resume_options
        resume_from = options.checkpoint if options is not None else None
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if resume_from is None and restarts > 0:
            # a restarted attempt of a self-healing run: carry on from the last checkpoint
            resume_from = "last"
            logger.info("Restart %d of this job: resuming from the last checkpoint.", restarts)
        if resume_from is not None and layout.is_merged_file(resume_from):
            self.load_merged_file(resume_from, options.convert_fn if options else None)
            return
        if options is not None and options.convert_fn is not None:
            raise TrainerError(
                f"checkpoint.resume_from.convert_fn converts a merged checkpoint file, but "
                f"{resume_from!r} is a checkpoint folder. Fix: merge it first "
                f"(Trainer.merge_checkpoint) and resume from the file, or drop convert_fn.")
        folder = layout.resolve_resume(resume_from, cfg.save_dir)
        if folder is None:
            if resume_from is not None:
                logger.info("No %r checkpoint in %s yet: starting from scratch.", resume_from,
                            cfg.save_dir)
            return
        self.load(folder, with_merged=options.with_merged if options else None)

    def load(self, folder: str | os.PathLike[str], with_merged: bool | None = None) -> None:
        """Restore everything from a checkpoint folder (collective). The same world size
        and plan restore each rank's own file; otherwise the checkpoint is merged and cut
        into this plan's pieces. ``with_merged``: True always takes the second way,
        False refuses it (nnScaler's ``ResumeOptions.with_merged``)."""
        t = self.trainer
        folder = Path(folder)
        meta = layout.read_meta(folder)
        logger.info("Resuming from checkpoint %s", folder)
        mine = self.plan_fingerprint()
        same = (meta["save_type"] != "merged" and meta["world_size"] == t.world_size
                and meta["plans"][t.rank] == mine)
        same = agree(same, t.device)
        if with_merged is False and not same:
            raise TrainerError(
                f"checkpoint.resume_from.with_merged is false, so {folder} must be this "
                f"plan's own per-rank files, but it was saved by {meta['world_size']} ranks "
                f"({meta['save_type']}) with another plan or world size than this job's "
                f"{t.world_size}. Fix: set with_merged to null (or true) to reshard it.")
        if same and not with_merged:
            state, rng = self._load_own(folder, meta)
        else:
            state, rng = self._load_resharded(folder, meta)
        self._restore_rest(folder, state, rng)

    def load_merged_file(self, path: str | os.PathLike[str], convert_fn: Any = None) -> None:
        """Restore from one merged file (what ``Trainer.merge_checkpoint`` writes), cut
        into this plan's pieces; ``convert_fn`` (a function or its import path) first
        turns the file's contents into this format (collective)."""
        from nnscaler import checkpoint as ck
        from nnscaler.trainer.fields import resolve_object

        t = self.trainer
        logger.info("Resuming from merged checkpoint %s", path)
        state = ck.load(path, map_location="cpu")
        if convert_fn is not None:
            state = resolve_object(convert_fn, "checkpoint.resume_from.convert_fn")(state)
        for part in ("model", "optimizer", "train_status"):
            if part not in state:
                raise TrainerError(
                    f"{path}: a merged Trainer checkpoint holds 'model', 'optimizer' and "
                    f"'train_status'; this one has {sorted(state)}. Fix: give a convert_fn "
                    f"(checkpoint.resume_from.convert_fn) that returns that form.")
        ck.load_merged_state_dicts(t.model, state["model"], t.optimizer, state["optimizer"])
        self._restore_rest(Path(path), {"lr_scheduler": None, "loss_scaler": None,
                                        **state}, None)

    def _restore_rest(self, folder: Path, state: dict[str, Any], rng: Any) -> None:
        t = self.trainer
        if t.lr_scheduler is not None and state["lr_scheduler"] is not None:
            t.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if t.loss_scaler is not None and state["loss_scaler"] is not None:
            t.loss_scaler.load_state_dict(state["loss_scaler"])
        self._restore_position(folder, state["train_status"], rng)
        call_hooks(t.hooks, "on_load_checkpoint", t, state.get("user", {}))
        barrier()

    def _load_own(self, folder: Path, meta: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """Same world size and plan: this rank's own file."""
        from nnscaler import checkpoint as ck

        t = self.trainer
        state = ck.load(layout.rank_file(folder, t.rank), map_location="cpu")
        if meta["save_type"] == "sharded":
            t.model.load_state_dict(state["model"])
            t.optimizer.load_state_dict(state["optimizer"])
        else:
            ck.load_deduped_state_dict(t.model, state["model"], t.optimizer,
                                       state["optimizer"])
        return state, state["rng_states"]

    def _load_resharded(self, folder: Path, meta: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """Another world size or plan: per-rank (sharded or deduped) files are read
        memory-mapped, each rank taking only the pieces and optimizer slices of its own
        plan (``load_resharded``); a merged file is cut into this plan's pieces. The RNG
        states only when the world size is the same."""
        from nnscaler import checkpoint as ck

        t = self.trainer
        if meta["save_type"] == "merged":
            state = ck.load(folder / layout.MERGED_FILE, map_location="cpu")
            rngs = state["rng_states"]
            ck.load_merged_state_dicts(t.model, state["model"], t.optimizer, state["optimizer"])
        else:
            states = [ck.load(layout.rank_file(folder, r), map_location="cpu", mmap=True)
                      for r in range(meta["world_size"])]
            rngs = [s["rng_states"] for s in states]
            state = states[0]
            if _over_parallel_modules(t.model, t.optimizer):
                ck.load_resharded(t.model, [s["model"] for s in states], t.optimizer,
                                  [s["optimizer"] for s in states])
            else:  # tensors outside the parallel modules: through the merged state
                merged, merged_opt = ck.merge_state_dicts([s["model"] for s in states],
                                                          [s["optimizer"] for s in states])
                ck.load_merged_state_dicts(t.model, merged, t.optimizer, merged_opt)
        rng = rngs[t.rank] if meta["world_size"] == t.world_size else None
        if rng is None:
            logger.warning("The checkpoint was saved by %d ranks, this job has %d: random "
                           "number generators start from the seed.", meta["world_size"],
                           t.world_size)
        return state, rng

    def _restore_position(self, folder: Path, status: dict[str, Any], rng: Any) -> None:
        t = self.trainer
        if (status["step_in_epoch"] and not status["epoch_end_done"]
                and status["global_batch_size"] != t.args.effective_global_batch_size):
            raise TrainerError(
                f"the checkpoint {folder} stopped in the middle of an epoch with a global "
                f"batch size of {status['global_batch_size']} samples; this run takes "
                f"{t.args.effective_global_batch_size} per step, so the data position "
                f"cannot be carried over. Fix: keep global_batch_size (micro_batch_size x "
                f"grad_accumulation_steps x scale units) equal, or resume from an epoch end."
            )
        t.epoch = int(status["epoch"])
        t.global_step = int(status["step"])
        t.step_in_epoch = int(status["step_in_epoch"])
        t.epoch_end_done = bool(status["epoch_end_done"])
        t.best_loss = float(status["best_loss"])
        t.last_train_loss = float(status["train_loss"])
        self.last_saved_step = t.global_step
        self.pending_rng = rng
        if rng is not None and t.epoch_end_done:
            # the next iterator is made after this point in the uninterrupted run too
            layout.set_rng_states(rng)
            self.pending_rng = None

    def restore_pending_rng(self) -> None:
        """Called once the epoch's data iterator is made: the uninterrupted run created
        it (drawing its base seed) before the checkpoint's RNG states were taken."""
        if self.pending_rng is not None:
            layout.set_rng_states(self.pending_rng)
            self.pending_rng = None


def _over_parallel_modules(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the model holds parallel modules and the optimizer updates only their
    tensors (what ``load_resharded`` moves without a merge)."""
    from nnscaler.checkpoint.optimizer import parallel_modules, tensor_entries

    pms = [pm for _, pm in parallel_modules(model)]
    if not pms:
        return False
    entries = tensor_entries(pms)
    return all(id(p) in entries for g in optimizer.param_groups for p in g["params"])
