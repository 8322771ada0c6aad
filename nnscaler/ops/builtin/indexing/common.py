"""Helpers shared by the indexing sub-families: annotation pieces and the random inputs
of the promise tests.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from nnscaler.ops.builtin._common import (
    SPLITTABLE_SIZES,
    rand_shape,
    randn,
)


def frozen_dims(names: Sequence[str]) -> list[str]:
    return [n + "^" for n in names]


Call = tuple[tuple[Any, ...], dict[str, Any]]


def small_shape(rng: random.Random, lo: int = 1, hi: int = 3) -> tuple[int, ...]:
    return rand_shape(rng, lo, hi, sizes=SPLITTABLE_SIZES + (1, 3))


def rand_tensor(rng: random.Random, shape: Sequence[int]) -> torch.Tensor:
    return randn(rng, *shape) if shape else randn(rng, 1).reshape(())
