"""The tests' name for :mod:`nnscaler.testing`'s process launcher."""

from nnscaler.testing import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
