"""The Trainer, in parts: ``Trainer(train_args=TrainerArgs(...)).run()``.

- :mod:`~nnscaler.trainer.args`: :class:`TrainerArgs` and its config classes, checked by
  :mod:`~nnscaler.trainer.fields`; :mod:`~nnscaler.trainer.cmdline` reads them from a
  YAML file and ``--dotted.key value`` overrides.
- :mod:`~nnscaler.trainer.trainer`: the :class:`Trainer`, which holds the run's state and
  hands the work to its parts: :mod:`~nnscaler.trainer.build` (process group, data,
  model, optimizer), :mod:`~nnscaler.trainer.step` (the loop, a step, validation),
  :mod:`~nnscaler.trainer.precision` (bf16/fp16 with fp32 master weights),
  :mod:`~nnscaler.trainer.progress` (progress bar, metric loggers, the log) and
  :mod:`~nnscaler.trainer.checkpointer` (saving and resuming, in the folders of
  :mod:`~nnscaler.trainer.ckpt_layout`); :mod:`~nnscaler.trainer.hooks` and
  :mod:`~nnscaler.trainer.collective` serve them all.

Users import from ``nnscaler.cli.trainer`` and ``nnscaler.cli.trainer_args``, nnScaler's
paths, which re-export these classes. This package imports nothing when imported itself.
"""
