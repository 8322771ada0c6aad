"""The Trainer layer: :mod:`nnscaler.cli.trainer_args` (configs),
:mod:`nnscaler.cli.trainer` (``Trainer(train_args=...).run()``) and the ``nnscaler-train``
command (:mod:`nnscaler.cli.train`). Kept free of imports so that
``nnscaler.cli.loggers`` loads as a plugin without pulling in the Trainer."""
