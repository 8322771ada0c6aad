"""The import path of the Trainer's mixed precision before it moved to
`nnscaler.trainer.precision` (fp32 master weights, fp16 loss scaling)."""

from __future__ import annotations

from nnscaler.trainer.precision import (
    DTYPES,
    DynamicLossScaler,
    MixedPrecisionAdam,
    MixedPrecisionAdamW,
    MixedPrecisionError,
    grads_overflow,
    mixed_precision,
)

__all__ = [
    "DTYPES",
    "DynamicLossScaler",
    "MixedPrecisionAdam",
    "MixedPrecisionAdamW",
    "MixedPrecisionError",
    "grads_overflow",
    "mixed_precision",
]
