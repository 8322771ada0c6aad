"""A Trainer job for the torchrun tests (self-healing and hung ranks).

``python torchrun_job.py OUT_DIR`` under torchrun, with the environment:
``JOB_KILL_STEP`` (rank 1 SIGKILLs itself in that step, first attempt only),
``JOB_STOP_STEP`` (rank 1 writes the time to ``JOB_STOP_FILE`` and SIGSTOPs itself in
that step), ``JOB_TIMEOUT``
(collective_timeout in seconds). Each rank saves its final state dicts to
``OUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: `cli.common`

from cli.common import NoisyDataset, trainer_args  # noqa: E402
from nnscaler.cli.trainer import Trainer  # noqa: E402
from nnscaler.cli.trainer_args import CheckpointConfig  # noqa: E402
from nnscaler.utils import set_default_logger_level  # noqa: E402


class Faults:
    """Kills or stops rank 1 in the middle of a step (after backward, before the update)."""

    def before_optimizer_step(self, trainer: Trainer) -> None:
        step = trainer.global_step + 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.rank != 1:
            return
        if first_attempt and step == int(os.environ.get("JOB_KILL_STEP", "0")):
            os.kill(os.getpid(), signal.SIGKILL)
        if step == int(os.environ.get("JOB_STOP_STEP", "0")):
            Path(os.environ["JOB_STOP_FILE"]).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)


def main(out: Path) -> None:
    set_default_logger_level("INFO")
    args = trainer_args(
        out, world=2, dataset=NoisyDataset, max_train_steps=10,
        collective_timeout=float(os.environ.get("JOB_TIMEOUT", "60")),
        checkpoint=CheckpointConfig(save_dir=str(out / "ckpt"), every_n_train_steps=1),
    )
    trainer = Trainer(train_args=args)
    trainer.setup()
    trainer.hooks.append(Faults())
    trainer.train()
    rank = trainer.rank
    torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                "step": trainer.global_step}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
