"""Neural-network functions: softmax, dropout, embedding, one_hot, pad, glu, normalize.

The rest of ``torch.nn.functional`` lives in sibling modules of this family:
`norm` (layer/rms/group/batch/instance norm), `loss` (the losses),
`conv` (convolutions) and `attention` (scaled dot-product attention).
Each is a family of its own in ``FAMILIES``.

A dim that the function mixes non-linearly (the softmax dim, the normalized dims) is
``^``; the other dims split.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from nnscaler.anno import Reduce, Replicate, Split, TransformRule, ValuePartial
from nnscaler.ops.builtin._common import (
    SPLITTABLE_SIZES,
    idents,
    norm_dim,
    randint,
    randn,
    tensor_str,
)
from nnscaler.ops.registry import OpRegistry

#: modules of this family that have a ``register`` of their own

# -- helpers shared by the nn modules ----------------------------------------------------


def marked(names: Sequence[str], mark: str) -> list[str]:
    """``names`` with ``mark`` added to every identifier (numbers stay as they are)."""
    return [n if n.isdigit() else n + mark for n in names]


def bcast(
    shapes: Sequence[Sequence[int] | None], names: Sequence[str] | None = None
) -> tuple[list[list[str] | None], list[str], list[int]]:
    """Dims of tensors that broadcast together (aligned on the right).

    Returns each tensor's dims (``None`` for a non-tensor), the dims of the broadcast
    result and its shape; a dim of size 1 against a larger one is the number ``1``.
    """
    real = [tuple(s) for s in shapes if s is not None]
    out = list(torch.broadcast_shapes(*real)) if real else []
    names = list(names) if names is not None else idents(len(out))
    per: list[list[str] | None] = []
    for s in shapes:
        if s is None:
            per.append(None)
            continue
        off = len(out) - len(s)
        per.append(["1" if n == 1 and out[off + i] != 1 else names[off + i] for i, n in enumerate(s)])
    return per, names[: len(out)], out


def along(ndim: int, frozen: Sequence[int]) -> str:
    """An op that keeps the shape and mixes the dims ``frozen``: ``a b^ -> a b^``."""
    if ndim == 0:
        return "1 -> 1"
    names = idents(ndim)
    t = " ".join(n + "^" if i in frozen else n for i, n in enumerate(names))
    return f"{t} -> {t}"


def f64(rng: random.Random, *shape: int) -> torch.Tensor:
    """A float64 tensor (0-d allowed)."""
    return randn(rng, *shape, dtype=torch.float64)


def size(rng: random.Random) -> int:
    return rng.choice(SPLITTABLE_SIZES)


def small(rng: random.Random) -> int:
    return rng.choice((1, 2, 3, 4, 6))


def shape_of(rng: random.Random, min_ndim: int = 1, max_ndim: int = 3) -> tuple[int, ...]:
    return tuple(rng.choice((1, 2, 3, 4, 6)) for _ in range(rng.randint(min_ndim, max_ndim)))


def a_dim(rng: random.Random, ndim: int) -> int:
    """A random dim index, negative half of the time."""
    d = rng.randrange(ndim)
    return d - ndim if rng.random() < 0.5 else d


# -- softmax and friends -------------------------------------------------------------------


def _legacy_softmax_dim(ndim: int) -> int:
    return 0 if ndim in (0, 1, 3) else 1


def f_softmax_anno(input, dim=None, _stacklevel=3, dtype=None) -> str:
    d = _legacy_softmax_dim(input.dim()) if dim is None else dim
    return along(input.dim(), [norm_dim(d, input.dim())])


def softmax_anno(input, dim, dtype=None) -> str:
    return along(input.dim(), [norm_dim(dim, input.dim())])


def gen_f_softmax(rng: random.Random) -> tuple[tuple, dict]:
    x = f64(rng, *shape_of(rng, 0, 4))
    kw: dict[str, Any] = {}
    if rng.random() < 0.2:
        kw["dtype"] = torch.float32
    if x.dim() and rng.random() < 0.9:
        d = a_dim(rng, x.dim())
        return ((x, d), kw) if rng.random() < 0.5 else ((x,), {"dim": d, **kw})
    return (x,), kw  # the legacy implicit dim (warns)


def gen_softmax(rng: random.Random) -> tuple[tuple, dict]:
    x = f64(rng, *shape_of(rng, 1, 4))
    kw: dict[str, Any] = {"dtype": torch.float32} if rng.random() < 0.2 else {}
    return (x, a_dim(rng, x.dim())), kw


# -- dropout -------------------------------------------------------------------------------


def dropout_anno(input, p=0.5, training=True, inplace=False) -> str:
    return along(input.dim(), [])


def torch_dropout_anno(input, p, train) -> str:
    return along(input.dim(), [])


def _gen_dropout(min_ndim: int, max_ndim: int, train_name: str | None = "training"):
    """Random calls that are deterministic: ``p == 0``, or not training."""

    def gen(rng: random.Random) -> tuple[tuple, dict]:
        x = f64(rng, *shape_of(rng, min_ndim, max_ndim))
        if train_name is None:  # torch.dropout(input, p, train)
            return (x, 0.0, rng.random() < 0.5) if rng.random() < 0.5 else (x, 0.3, False), {}
        if rng.random() < 0.5:
            return (x,), {"p": 0.0, train_name: True}
        kw: dict[str, Any] = {"p": rng.choice((0.1, 0.5)), train_name: False}
        if rng.random() < 0.3:
            kw["inplace"] = True
        return (x,), kw

    return gen


# -- embedding, one_hot --------------------------------------------------------------------


def embedding_anno(
    input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
    sparse=False,
) -> str:
    # a part of the vocabulary must mask the tokens it does not hold: 'V^' here, and a
    # transform rule (embedding_rules) that runs row_parallel_embedding on the parts
    e = "E" if max_norm is None else "E^"  # max_norm renormalizes rows over E
    tokens = idents(input.dim())
    return f"{tensor_str(tokens)}, V^ {e} -> {tensor_str([*tokens, e])}"


#: The part op of an embedding whose table is split by rows (Megatron's
#: vocabulary-parallel embedding): each part looks up the tokens it holds and writes zeros
#: for the others, so the parts sum to the lookup.
ROW_PARALLEL_EMBEDDING = "nnscaler.ops.builtin.nn.row_parallel_embedding"


def row_parallel_embedding(
    input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
    sparse=False, *, row_start=0, num_rows=None,
):
    """``F.embedding`` with the rows ``[row_start, row_start + len(weight))`` of a table of
    ``num_rows`` rows: the tokens outside them give zeros."""
    rows = weight.size(0)
    if padding_idx is not None:
        if padding_idx < 0:
            padding_idx += rows if num_rows is None else num_rows
        padding_idx -= row_start
        if not 0 <= padding_idx < rows:
            padding_idx = None
    local = input - row_start
    held = (local >= 0) & (local < rows)
    if scale_grad_by_freq:  # the counts must not include the tokens held elsewhere
        local, held = local.reshape(-1), held.reshape(-1)
        found = F.embedding(local[held], weight, padding_idx, max_norm, norm_type, True, sparse)
        out = weight.new_zeros((local.numel(), weight.size(1))).index_put((held,), found)
        return out.reshape(*input.shape, weight.size(1))
    found = F.embedding(torch.where(held, local, 0), weight, padding_idx, max_norm, norm_type,
                        False, sparse)
    return torch.where(held.unsqueeze(-1), found, 0.0)


def _row_parallel_embedding_anno(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
                                 scale_grad_by_freq=False, sparse=False, **_: Any) -> str:
    return embedding_anno(input, weight, padding_idx, max_norm, norm_type,
                          scale_grad_by_freq, sparse)


def embedding_rules(bound: Any) -> list[TransformRule]:
    """embedding splits its table by rows: the parts run `row_parallel_embedding`
    and their outputs sum to the lookup (value-partial). Not with ``max_norm``, which
    renormalizes the table in place."""
    x, w = bound.input_shapes[:2]
    if x is None or w is None or bound.expanded.inputs[1].idents[1].reduce is Reduce.FROZEN:
        return []
    num_rows = w[0]

    def modifier(kwargs: dict, idx: int, dim: int, num: int, part: int) -> dict:
        return {**kwargs, "row_start": part * (num_rows // num), "num_rows": num_rows}

    return [TransformRule(inputs=(Replicate(), Split(0)), outputs=(ValuePartial(),),
                          modifier=modifier, part_op=ROW_PARALLEL_EMBEDDING)]


def torch_embedding_anno(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False) -> str:
    tokens = idents(indices.dim())
    return f"V^ E, {tensor_str(tokens)} -> {tensor_str([*tokens, 'E'])}"


def gen_embedding(rng: random.Random) -> tuple[tuple, dict]:
    v, e = rng.choice((3, 5, 8)), size(rng)
    w = f64(rng, v, e)
    idx = randint(rng, 0, v, *shape_of(rng, 0, 3))
    kw: dict[str, Any] = {}
    if rng.random() < 0.3:
        kw["padding_idx"] = rng.randrange(-v, v)
    if rng.random() < 0.2:
        kw["max_norm"] = 1.0
    return (idx, w), kw


def gen_torch_embedding(rng: random.Random) -> tuple[tuple, dict]:
    (idx, w), _ = gen_embedding(rng)
    return (w, idx), {}


def one_hot_anno(tensor, num_classes=-1) -> str:
    dims = idents(tensor.dim())
    if num_classes == -1:
        # the class count is the largest value + 1: parts could see other values
        num_classes = int(tensor.max()) + 1 if tensor.numel() else 0
        dims = marked(dims, "^")
    return f"{tensor_str(dims)} -> {tensor_str([*dims, str(num_classes)])}"


def gen_one_hot(rng: random.Random) -> tuple[tuple, dict]:
    c = rng.choice((2, 3, 5))
    x = randint(rng, 0, c, *shape_of(rng, 0, 3))
    r = rng.random()
    if r < 0.4:
        return (x, c + rng.randint(0, 2)), {}
    if r < 0.7:
        return (x,), {"num_classes": c}
    return (x,), {}


# -- pad, glu, normalize, cosine_similarity ----------------------------------------------------


def pad_anno(input, pad, mode="constant", value=None) -> str:
    names = idents(input.dim())
    out = list(names)
    ins = list(names)
    for i in range(len(pad) // 2):
        d = input.dim() - 1 - i
        lo, hi = int(pad[2 * i]), int(pad[2 * i + 1])
        if lo or hi:
            ins[d] = names[d] + "^"
            out[d] = str(int(input.shape[d]) + lo + hi)
    return f"{tensor_str(ins)} -> {tensor_str(out)}"


def gen_pad(rng: random.Random) -> tuple[tuple, dict]:
    mode = rng.choice(("constant", "constant", "reflect", "replicate", "circular"))
    if mode == "constant":
        x = f64(rng, *shape_of(rng, 1, 4))
        npad = rng.randint(1, x.dim())
        pad = []
        for i in range(npad):
            d = x.dim() - 1 - i
            lo, hi = rng.choice((0, 0, 1, 2)), rng.choice((0, 1, 2))
            if rng.random() < 0.1 and x.shape[d] > 2:
                lo = -1  # a negative pad crops
            pad += [lo, hi]
        kw: dict[str, Any] = {}
        if rng.random() < 0.3:
            kw["value"] = rng.choice((0.5, -1.0))
        return ((x, pad), kw) if rng.random() < 0.5 else ((x,), {"pad": pad, **kw})
    npad = rng.randint(1, 3)  # torch pads 1, 2, 3 dims of 2-3, 3-4, 4-5 dim inputs
    lead = [rng.choice((1, 2, 3, 4)) for _ in range(rng.randint(1, 2))]
    x = f64(rng, *lead, *(rng.choice((3, 4, 6)) for _ in range(npad)))
    pad = []
    for _ in range(npad):
        pad += [rng.choice((0, 1, 2)), rng.choice((0, 1, 2))]
    return (x, pad), {"mode": mode}


def glu_anno(input, dim=-1) -> str:
    d = norm_dim(dim, input.dim())
    names = idents(input.dim())
    ins = [n + "^" if i == d else n for i, n in enumerate(names)]
    out = [str(int(input.shape[d]) // 2) if i == d else n for i, n in enumerate(names)]
    return f"{tensor_str(ins)} -> {tensor_str(out)}"


def gen_glu(rng: random.Random) -> tuple[tuple, dict]:
    shape = list(shape_of(rng, 1, 3))
    d = rng.randrange(len(shape))
    shape[d] = rng.choice((2, 4, 6, 8))
    x = f64(rng, *shape)
    if d == len(shape) - 1 and rng.random() < 0.5:
        return (x,), {}
    return (x,), {"dim": d - len(shape) if rng.random() < 0.5 else d}


def normalize_anno(input, p=2.0, dim=1, eps=1e-12, out=None) -> str:
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return along(input.dim(), [norm_dim(d, input.dim()) for d in dims])


def gen_normalize(rng: random.Random) -> tuple[tuple, dict]:
    x = f64(rng, *shape_of(rng, 2, 4))
    kw: dict[str, Any] = {}
    r = rng.random()
    if r < 0.6:
        kw["dim"] = a_dim(rng, x.dim())
    elif r < 0.7:
        kw["dim"] = (0, -1)
    if rng.random() < 0.4:
        kw["p"] = rng.choice((1, 1.0, 3.0))
    return (x,), kw


def cosine_similarity_anno(x1, x2, dim=1, eps=1e-8) -> str:
    (d1, d2), names, shape = bcast([tuple(x1.shape), tuple(x2.shape)])
    d = norm_dim(dim, len(shape))
    frozen = names[d]
    d1 = [n + "^" if n == frozen else n for n in d1]  # type: ignore[union-attr]
    d2 = [n + "^" if n == frozen else n for n in d2]  # type: ignore[union-attr]
    out = [n for i, n in enumerate(names) if i != d]
    return f"{tensor_str(d1)}, {tensor_str(d2)} -> {tensor_str(out)}"


def gen_cosine_similarity(rng: random.Random) -> tuple[tuple, dict]:
    shape = shape_of(rng, 1, 3)
    d = rng.randrange(len(shape))
    other = [n if i == d or rng.random() < 0.8 else 1 for i, n in enumerate(shape)]
    kw = {} if d == 1 else {"dim": d - len(shape) if rng.random() < 0.5 else d}
    return (f64(rng, *shape), f64(rng, *other)), kw


def local_response_norm_anno(input, size, alpha=0.0001, beta=0.75, k=1.0) -> str:
    return along(input.dim(), [1])  # a window over the channels


def gen_local_response_norm(rng: random.Random) -> tuple[tuple, dict]:
    x = f64(rng, *shape_of(rng, 3, 4))
    return (x, rng.choice((1, 2, 3))), {"alpha": 0.01} if rng.random() < 0.5 else {}


# -- registration --------------------------------------------------------------------------


def register(registry: OpRegistry) -> None:
    T = torch.Tensor
    r = registry.register
    r(F.softmax, f_softmax_anno, name="torch.nn.functional.softmax", input_gen_fn=gen_f_softmax)
    r(F.log_softmax, f_softmax_anno, name="torch.nn.functional.log_softmax",
      input_gen_fn=gen_f_softmax)
    r(F.softmin, f_softmax_anno, name="torch.nn.functional.softmin", input_gen_fn=gen_f_softmax)
    r(torch.softmax, softmax_anno, name="torch.softmax", aliases=(T.softmax,),
      input_gen_fn=gen_softmax)
    r(torch.log_softmax, softmax_anno, name="torch.log_softmax", aliases=(T.log_softmax,),
      input_gen_fn=gen_softmax)

    r(F.dropout, dropout_anno, name="torch.nn.functional.dropout",
      input_gen_fn=_gen_dropout(0, 4))
    r(F.dropout1d, dropout_anno, name="torch.nn.functional.dropout1d",
      input_gen_fn=_gen_dropout(2, 3))
    r(F.dropout2d, dropout_anno, name="torch.nn.functional.dropout2d",
      input_gen_fn=_gen_dropout(4, 4))
    r(F.dropout3d, dropout_anno, name="torch.nn.functional.dropout3d",
      input_gen_fn=_gen_dropout(4, 5))
    r(F.alpha_dropout, dropout_anno, name="torch.nn.functional.alpha_dropout",
      input_gen_fn=_gen_dropout(1, 3))
    r(F.feature_alpha_dropout, dropout_anno, name="torch.nn.functional.feature_alpha_dropout",
      input_gen_fn=_gen_dropout(2, 4))
    for fn in (torch.dropout, torch.alpha_dropout, torch.feature_dropout,
               torch.feature_alpha_dropout):
        r(fn, torch_dropout_anno, name=f"torch.{fn.__name__}",
          input_gen_fn=_gen_dropout(2, 4, train_name=None))

    r(F.embedding, embedding_anno, name="torch.nn.functional.embedding",
      input_gen_fn=gen_embedding, transform_rules=embedding_rules)
    r(row_parallel_embedding, _row_parallel_embedding_anno, name=ROW_PARALLEL_EMBEDDING,
      input_gen_fn=gen_embedding)
    r(torch.embedding, torch_embedding_anno, name="torch.embedding",
      input_gen_fn=gen_torch_embedding)
    r(F.one_hot, one_hot_anno, name="torch.nn.functional.one_hot", input_gen_fn=gen_one_hot)
    r(F.pad, pad_anno, name="torch.nn.functional.pad", input_gen_fn=gen_pad)
    r(F.glu, glu_anno, name="torch.nn.functional.glu", input_gen_fn=gen_glu)
    r(F.normalize, normalize_anno, name="torch.nn.functional.normalize",
      input_gen_fn=gen_normalize)
    r(F.cosine_similarity, cosine_similarity_anno, name="torch.nn.functional.cosine_similarity",
      input_gen_fn=gen_cosine_similarity)
    r(F.local_response_norm, local_response_norm_anno,
      name="torch.nn.functional.local_response_norm", input_gen_fn=gen_local_response_norm)
