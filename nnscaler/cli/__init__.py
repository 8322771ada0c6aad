"""The ``nnscaler-train`` command (:mod:`nnscaler.cli.train`), the metric loggers
(:mod:`nnscaler.cli.loggers`, a built-in plugin), the chunked loss op
(:mod:`nnscaler.cli.ops`), and nnScaler's import paths of the Trainer:
:mod:`nnscaler.cli.trainer` and :mod:`nnscaler.cli.trainer_args` re-export it from
:mod:`nnscaler.trainer`, where it lives in parts. Kept free of imports so that
``nnscaler.cli.loggers`` loads as a plugin without pulling in the Trainer."""
