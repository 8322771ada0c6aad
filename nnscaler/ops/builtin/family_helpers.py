"""Helpers shared by the op families whose ops act element by element (``elementwise``,
``compare``, ``creation``, ``reduce``): annotations for broadcasting ops, registering a
function under all its spellings (``torch.x``, ``Tensor.x``, ``Tensor.x_``), and the
random input generators the promise test draws from.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nnscaler.anno import TransformRule
from nnscaler.ops.builtin._common import SIZES, broadcast_anno, is_tensor, rand_shape, randint
from nnscaler.ops.builtin._common import randn as _randn
from nnscaler.ops.registry import OpRegistry

#: the largest tensor an input generator draws (keeps the promise test fast)
MAX_NUMEL = 1024

Gen = Callable[[random.Random], tuple[tuple[Any, ...], dict[str, Any]]]


# ---------------------------------------------------------------------------------------
# annotation helpers
# ---------------------------------------------------------------------------------------


def broadcast_text(values: Sequence[Any]) -> str:
    """The annotation of an elementwise op whose inputs ``values`` broadcast together.

    A result that is 0-d (every input a scalar or a 0-d tensor) is ``1``, nnScaler's
    notation for a 0-d tensor, so that its shape is still checked.
    """
    ins, out = broadcast_anno(values)
    if out == "?" and any(is_tensor(v) for v in values):
        out = "1"
    return f"{', '.join(ins)} -> {out}"


def broadcast_op(template: Callable[..., Any], n_inputs: int) -> Callable[..., str]:
    """An annotation function with ``template``'s signature whose first ``n_inputs``
    parameters broadcast together elementwise."""
    signature = inspect.signature(template)
    names = list(signature.parameters)[:n_inputs]

    def annotation(*args: Any, **kwargs: Any) -> str:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return broadcast_text([bound.arguments[n] for n in names])

    annotation.__signature__ = signature  # type: ignore[attr-defined]
    annotation.__name__ = annotation.__qualname__ = template.__name__
    return annotation


def spellings(name: str, *extra: Any) -> tuple[Any, ...]:
    """``torch.<name>`` and ``torch.Tensor.<name>`` where they exist, plus ``extra``."""
    found = [getattr(torch, name, None), getattr(torch.Tensor, name, None), *extra]
    out: list[Any] = []
    for f in found:
        if f is not None and not any(f is g for g in out):
            out.append(f)
    return tuple(out)


def register_all(
    registry: OpRegistry,
    fns: Sequence[Any],
    annotation: str | Callable[..., str],
    *,
    name: str,
    gen: Gen,
    signature: Callable[..., Any] | None = None,
    transform_rules: Callable[[Any], list[TransformRule]] | None = None,
) -> None:
    """Register ``fns[0]`` as op ``name`` with the other callables of ``fns`` as aliases."""
    fns = [f for f in fns if f is not None]
    uniq: list[Any] = []
    for f in fns:
        if not any(f is g for g in uniq):
            uniq.append(f)
    registry.register(
        uniq[0], annotation, name=name, aliases=tuple(uniq[1:]), input_gen_fn=gen,
        signature=signature, transform_rules=transform_rules,
    )


# ---------------------------------------------------------------------------------------
# input generators
# ---------------------------------------------------------------------------------------


def shape(
    rng: random.Random, min_ndim: int = 1, max_ndim: int = 4, sizes: Sequence[int] = SIZES
) -> tuple[int, ...]:
    """A random shape with at most `MAX_NUMEL` elements."""
    while True:
        s = rand_shape(rng, min_ndim, max_ndim, sizes)
        if math.prod(s) <= MAX_NUMEL:
            return s


def randn(rng: random.Random, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``_common.randn`` that also draws 0-d tensors."""
    return _randn(rng, *shape, dtype=dtype) if shape else _randn(rng, 1, dtype=dtype).reshape(())


def broadcast_shape(rng: random.Random, full: Sequence[int]) -> tuple[int, ...]:
    """A shape that broadcasts to ``full``: a suffix of it, some dims set to 1."""
    keep = rng.randint(0, len(full))
    return tuple(1 if rng.random() < 0.3 else n for n in full[len(full) - keep:])


def POS(x: torch.Tensor) -> torch.Tensor:
    """Values in [0.5, inf): for log, sqrt, divisors, bases of pow."""
    return x.abs() + 0.5


def AWAY(x: torch.Tensor) -> torch.Tensor:
    """Values at least 0.5 away from zero, either sign."""
    return torch.where(x < 0, x - 0.5, x + 0.5)


def UNIT(x: torch.Tensor) -> torch.Tensor:
    """Values in (-0.9, 0.9): for asin, atanh, erfinv."""
    return x.tanh() * 0.9


def PROB(x: torch.Tensor) -> torch.Tensor:
    """Values in (0.05, 0.95): for logit."""
    return x.sigmoid() * 0.9 + 0.05


def GE1(x: torch.Tensor) -> torch.Tensor:
    """Values in [1.1, inf): for acosh."""
    return x.abs() + 1.1


Domain = Callable[[torch.Tensor], torch.Tensor] | None


def unary_gen(
    domain: Domain = None,
    *,
    kwargs: Callable[[random.Random], dict[str, Any]] | None = None,
    ints: bool = False,
    min_ndim: int = 0,
) -> Gen:
    """One tensor (any rank, 0-d included) plus optional keyword arguments."""

    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        s = shape(rng, min_ndim, 4)
        x = randint(rng, -20, 20, *s) if ints else randn(rng, *s)
        if domain is not None:
            x = domain(x)
        return (x,), (kwargs(rng) if kwargs else {})

    return gen


def operands(
    rng: random.Random,
    n: int,
    *,
    domains: Sequence[Domain] = (),
    inplace: bool = False,
    scalars: Sequence[int] = (),
    ints: bool = False,
    dtype: torch.dtype = torch.float32,
) -> list[Any]:
    """``n`` operands that broadcast together.

    The first sets the output shape when ``inplace``; otherwise any may be the larger.
    Operands at the indices ``scalars`` may come out as Python numbers or 0-d tensors.
    """
    full = shape(rng, 1, 4)
    out: list[Any] = []
    big = 0 if inplace else rng.randrange(n)
    for i in range(n):
        domain = domains[i] if i < len(domains) else None
        r = rng.random()
        if i in scalars and r < 0.25:
            v = randn(rng, 1, dtype=torch.float64)
            if domain is not None:
                v = domain(v)
            out.append(int(v.round().item()) or 1 if ints else float(v.item()))
            continue
        if i in scalars and r < 0.35:
            s: tuple[int, ...] = ()
        elif i == big:
            s = full
        else:
            s = broadcast_shape(rng, full)
        t = randint(rng, -20, 20, *s) if ints else randn(rng, *s, dtype=dtype)
        if domain is not None:
            t = domain(t)
        out.append(t)
    return out


def binary_gen(
    *domains: Domain,
    inplace: bool = False,
    scalar_first: bool = False,
    kwargs: Callable[[random.Random], dict[str, Any]] | None = None,
    ints: bool = False,
    numbers: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Gen:
    """A broadcasting pair; the second (or, when ``scalar_first``, either) may be a number
    or a 0-d tensor (only 0-d tensors when not ``numbers``: the op takes tensors only)."""

    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        scalars = (0, 1) if scalar_first else (1,)
        a, b = operands(rng, 2, domains=domains, inplace=inplace, scalars=scalars, ints=ints,
                        dtype=dtype)
        if not numbers:
            a = a if is_tensor(a) else torch.tensor(a, dtype=dtype)
            b = b if is_tensor(b) else torch.tensor(b, dtype=dtype)
        if not is_tensor(a) and not is_tensor(b):
            a = torch.tensor(a)
        return (a, b), (kwargs(rng) if kwargs else {})

    return gen
