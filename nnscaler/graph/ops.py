"""Ops that the graph API inserts into a graph, registered as a built-in plugin.

- ``nnscaler.graph.ops.multiref``: ``multiref(tensor, times)`` returns ``times``
  references to ``tensor``, one for each consumer (see
  [`IRGraph.multiref`][nnscaler.IRGraph.multiref]). It is the identity, so every dim splits and the
  copies split the same way: ``d0 d1 -> d0 d1, d0 d1``.
"""

from __future__ import annotations

import random

import torch

from nnscaler.anno import OpAnno, parse
from nnscaler.hookspecs import hookimpl
from nnscaler.ops.registry import OpRegistry

MULTIREF_NAME = "nnscaler.graph.ops.multiref"


def multiref(tensor: torch.Tensor, times: int) -> tuple[torch.Tensor, ...]:
    """``times`` references to ``tensor``: one for each consumer of a multiref'd tensor."""
    return tuple(tensor for _ in range(times))


def multiref_annotation(ndim: int, times: int) -> OpAnno:
    """The annotation of ``multiref`` on a tensor of ``ndim`` dims with ``times`` copies."""
    return parse(_multiref_text(ndim, times))


def _multiref_text(ndim: int, times: int) -> str:
    one = " ".join(f"d{i}" for i in range(ndim)) or "1"
    return f"{one} -> {', '.join([one] * times)}"


def _multiref_anno(tensor: torch.Tensor, times: int) -> str:
    return _multiref_text(tensor.dim(), times)


def _gen_multiref(rng: random.Random) -> tuple[tuple, dict]:
    shape = [rng.choice((1, 2, 4, 6)) for _ in range(rng.randint(0, 3))]
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return (torch.randn(shape, generator=g),), {"times": rng.randint(2, 3)}


@hookimpl
def nnscaler_register_ops(registry: OpRegistry) -> None:
    registry.register(multiref, _multiref_anno, name=MULTIREF_NAME, input_gen_fn=_gen_multiref)
