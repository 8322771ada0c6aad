"""The operator registry, ``register_op`` and the built-in annotations of torch functions
(:mod:`nnscaler.ops.builtin`, by family)."""
