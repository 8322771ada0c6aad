"""Bridges from nnscaler to other trainers; each is an optional extra.

- `nnscaler.integration.lightning`: ``NnScalerStrategy``, a PyTorch Lightning
  strategy (``pip install "nnscaler[lightning]"``).

Nothing here is imported by ``import nnscaler``: a bridge imports its trainer, which
may not be installed.
"""
