"""The Trainer, in parts: ``Trainer(train_args=TrainerArgs(...)).run()``.

- `args`: `TrainerArgs` and its config classes, checked by
  `fields`; `cmdline` reads them from a
  YAML file and ``--dotted.key value`` overrides.
- `trainer`: the `Trainer`, which holds the run's state and
  hands the work to its parts: `build` (process group, data,
  model, optimizer), `step` (the loop, a step, validation),
  `precision` (bf16/fp16 with fp32 master weights),
  `progress` (progress bar, metric loggers, the log) and
  `checkpointer` (saving and resuming, in the folders of
  `ckpt_layout`); `hooks` and
  `collective` serve them all.

Users import from ``nnscaler.cli.trainer`` and ``nnscaler.cli.trainer_args``, nnScaler's
paths, which re-export these classes. This package imports nothing when imported itself.
"""
