"""The ``nnscaler-train`` command (`nnscaler.cli.train`), the metric loggers
(`nnscaler.cli.loggers`, a built-in plugin), the chunked loss op
(`nnscaler.cli.ops`), and nnScaler's import paths of the Trainer:
`nnscaler.cli.trainer` and `nnscaler.cli.trainer_args` re-export it from
`nnscaler.trainer`, where it lives in parts. Kept free of imports so that
``nnscaler.cli.loggers`` loads as a plugin without pulling in the Trainer."""
