"""Helpers shared by the built-in op families: annotation builders and input generators.

Conventions for a family module:

- it defines ``register(registry)`` which calls ``registry.register(fn, annotation, ...)``
  for each torch callable, passing ``aliases=`` for the other spellings the tracer may
  see (``torch.add`` / ``torch.Tensor.add`` / ``torch.Tensor.__add__``);
- an annotation that depends on the call is a function with the op's own parameters
  (it doubles as the op's signature when torch gives none);
- every op gets an ``input_gen_fn(rng: random.Random) -> (args, kwargs)`` that draws one
  random valid call; the promise tests run each op through its whole transform space on
  such calls.
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from typing import Any

import torch

#: sizes drawn for tensor dims: small, with many divisors so that splits exist
SIZES = (1, 2, 3, 4, 6, 8, 12)
SPLITTABLE_SIZES = (2, 4, 6, 8, 12)


def idents(n: int, start: int = 0) -> list[str]:
    """``n`` distinct identifiers: a, b, c, ... (skipping none)."""
    letters = string.ascii_lowercase
    out = []
    for i in range(start, start + n):
        out.append(letters[i] if i < 26 else f"{letters[i % 26]}{i // 26}")
    return out


def tensor_str(dims: Sequence[str]) -> str:
    return " ".join(dims) if dims else "1"  # 0-d tensors: see scalar_str


def join_anno(inputs: Sequence[Sequence[str] | str], outputs: Sequence[Sequence[str] | str]) -> str:
    """Join per-tensor dim lists (or ready entries such as ``'?'``) into an annotation:
    ``join_anno([["a", "b"], "?"], [["b"]])`` is ``'a b, ? -> b'``."""

    def one(t: Sequence[str] | str) -> str:
        return t if isinstance(t, str) else tensor_str(t)

    return f"{', '.join(map(one, inputs))} -> {', '.join(map(one, outputs))}"


def shape_of(x: Any) -> tuple[int, ...]:
    """The shape of a tensor as a tuple of Python ints."""
    return tuple(int(s) for s in x.shape)


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def norm_dim(dim: int, ndim: int) -> int:
    if ndim == 0:
        return 0
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} out of range for a tensor with {ndim} dims")
    return dim % ndim


def broadcast_anno(values: Sequence[Any], *, out_mark: str = "") -> tuple[list[str], str]:
    """Annotate elementwise inputs that broadcast together.

    Returns (per-input annotation strings, output annotation string). Non-tensors and
    0-d tensors are ``?`` (taken whole). An input dim of size 1 against a larger output
    dim is the number ``1``; other dims share the output's identifier.
    """
    shapes = [tuple(v.shape) if is_tensor(v) and v.dim() > 0 else None for v in values]
    ndim = max((len(s) for s in shapes if s is not None), default=0)
    out_shape = list(torch.broadcast_shapes(*[s for s in shapes if s is not None])) if ndim else []
    names = idents(ndim)
    ins = []
    for s in shapes:
        if s is None:
            ins.append("?")
            continue
        off = ndim - len(s)
        dims = []
        for i, size in enumerate(s):
            j = off + i
            dims.append("1" if size == 1 and out_shape[j] != 1 else names[j] + out_mark)
        ins.append(" ".join(dims))
    out = " ".join(n + out_mark for n in names) if ndim else "?"
    return ins, out


def rand_shape(
    rng: random.Random, min_ndim: int = 1, max_ndim: int = 4, sizes: Sequence[int] = SIZES
) -> tuple[int, ...]:
    return tuple(rng.choice(sizes) for _ in range(rng.randint(min_ndim, max_ndim)))


def randn(rng: random.Random, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A float tensor drawn deterministically from ``rng`` (float64 math, then cast)."""
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)


def randint(rng: random.Random, low: int, high: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    return torch.randint(low, high, shape, generator=g)


def randbool(rng: random.Random, *shape: int) -> torch.Tensor:
    return randint(rng, 0, 2, *shape).bool()
