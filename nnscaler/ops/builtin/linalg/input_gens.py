"""Input generators of the linear-algebra ops (`nnscaler.ops.builtin.linalg`): random
arguments of the shapes each op takes, drawn by the promise test that checks every
annotation. Float64 values, so the checks compare sums of parts tightly.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from nnscaler.ops.builtin._common import SPLITTABLE_SIZES, randint, randn
from nnscaler.ops.builtin.linalg.einsum import einsum_terms


def _f64(rng: random.Random, *shape: int) -> torch.Tensor:
    return randn(rng, *shape, dtype=torch.float64)


def _sz(rng: random.Random) -> int:
    return rng.choice(SPLITTABLE_SIZES)


def _small(rng: random.Random) -> int:
    return rng.choice((1, 2, 3, 4, 6))


def gen_linear(rng: random.Random) -> tuple[tuple, dict]:
    lead = tuple(_small(rng) for _ in range(rng.randint(0, 2)))
    k, n = _sz(rng), _sz(rng)
    x = _f64(rng, *lead, k)
    if rng.random() < 0.1:  # a 1-d weight (torch takes no bias then)
        w = _f64(rng, k)
        bias = None
    else:
        w = _f64(rng, n, k)
        bias = rng.choice([None, None, _f64(rng, n), _f64(rng, 1)])
    if bias is None and rng.random() < 0.5:
        return (x, w), {}
    if rng.random() < 0.5:
        return (x, w, bias), {}
    return (x, w), {"bias": bias}


def _batch_shapes(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...]]:
    nd = rng.randint(0, 2)
    out = [rng.choice((2, 3, 4)) for _ in range(nd)]
    a = [n if rng.random() < 0.7 else 1 for n in out]
    b = [n if rng.random() < 0.7 else 1 for n in out]
    # drop leading dims of one of them sometimes
    if nd and rng.random() < 0.3:
        a = a[rng.randint(1, nd):]
    return tuple(a), tuple(b)


def gen_matmul(rng: random.Random) -> tuple[tuple, dict]:
    m, k, n = _sz(rng), _sz(rng), _sz(rng)
    ba, bb = _batch_shapes(rng)
    kind = rng.random()
    if kind < 0.1:
        a, b = _f64(rng, k), _f64(rng, k)
    elif kind < 0.2:
        a, b = _f64(rng, k), _f64(rng, *bb, k, n)
    elif kind < 0.3:
        a, b = _f64(rng, *ba, m, k), _f64(rng, k)
    else:
        a, b = _f64(rng, *ba, m, k), _f64(rng, *bb, k, n)
    if rng.random() < 0.2:
        return (a,), {"other": b}
    return (a, b), {}


def gen_rmatmul(rng: random.Random) -> tuple[tuple, dict]:
    (a, *rest), kw = gen_matmul(rng)
    b = rest[0] if rest else kw["other"]
    return (b, a), {}  # b.__rmatmul__(a) is a @ b


def gen_mm(rng: random.Random) -> tuple[tuple, dict]:
    m, k, n = _sz(rng), _sz(rng), _sz(rng)
    return (_f64(rng, m, k), _f64(rng, k, n)), {}


def gen_bmm(rng: random.Random) -> tuple[tuple, dict]:
    b, m, k, n = _small(rng), _sz(rng), _sz(rng), _sz(rng)
    return (_f64(rng, b, m, k), _f64(rng, b, k, n)), {}


def _beta_alpha(rng: random.Random) -> dict:
    kw: dict[str, Any] = {}
    r = rng.random()
    if r < 0.3:
        kw["beta"] = 0
    elif r < 0.5:
        kw["beta"] = 0.5
    if rng.random() < 0.3:
        kw["alpha"] = rng.choice((2, 0.25))
    return kw


def _bcast_to(rng: random.Random, shape: Sequence[int], full: bool) -> torch.Tensor:
    if full:
        return _f64(rng, *shape)
    nd = rng.randint(0, len(shape))
    sub = [n if rng.random() < 0.7 else 1 for n in shape[len(shape) - nd :]]
    return _f64(rng, *sub)


def gen_add_product(shapes: tuple[Sequence[int], Sequence[int]], out: Sequence[int], full: bool):
    def gen(rng: random.Random) -> tuple[tuple, dict]:
        sizes: dict[str, int] = {}

        def size(name: str) -> int:
            if name not in sizes:
                sizes[name] = _small(rng) if name == "b" else _sz(rng)
            return sizes[name]

        a = _f64(rng, *(size(d) for d in shapes[0]))
        b = _f64(rng, *(size(d) for d in shapes[1]))
        inp = _bcast_to(rng, [size(d) for d in out], full)
        return (inp, a, b), _beta_alpha(rng)

    return gen


def gen_mv(rng: random.Random) -> tuple[tuple, dict]:
    n, k = _sz(rng), _sz(rng)
    return (_f64(rng, n, k), _f64(rng, k)), {}


def gen_vec2(rng: random.Random) -> tuple[tuple, dict]:
    k = _sz(rng)
    return (_f64(rng, k), _f64(rng, k)), {}


def gen_outer(rng: random.Random) -> tuple[tuple, dict]:
    return (_f64(rng, _sz(rng)), _f64(rng, _sz(rng))), {}


def gen_inner(rng: random.Random) -> tuple[tuple, dict]:
    if rng.random() < 0.15:
        return (_f64(rng), _f64(rng, _sz(rng), _small(rng))), {}
    k = _sz(rng)
    a = _f64(rng, *(_small(rng) for _ in range(rng.randint(0, 2))), k)
    b = _f64(rng, *(_small(rng) for _ in range(rng.randint(0, 2))), k)
    return (a, b), {}


def gen_vecdot(rng: random.Random) -> tuple[tuple, dict]:
    shape = [_sz(rng) for _ in range(rng.randint(1, 3))]
    d = rng.randrange(len(shape))
    # torch broadcasts the other dims, but not the one it contracts
    y_shape = [n if i == d or rng.random() < 0.8 else 1 for i, n in enumerate(shape)]
    kw = {}
    if d != len(shape) - 1 or rng.random() < 0.5:
        kw["dim"] = d - len(shape) if rng.random() < 0.5 else d
    return (_f64(rng, *shape), _f64(rng, *y_shape)), kw


def gen_bilinear(rng: random.Random) -> tuple[tuple, dict]:
    lead = tuple(_small(rng) for _ in range(rng.randint(1, 2)))
    i, j, o = _sz(rng), _sz(rng), _sz(rng)
    args: tuple = (_f64(rng, *lead, i), _f64(rng, *lead, j), _f64(rng, o, i, j))
    if rng.random() < 0.5:
        args = (*args, _f64(rng, o))
    return args, {}


def gen_tensordot(rng: random.Random) -> tuple[tuple, dict]:
    nc = rng.randint(0, 2)
    contracted = [_sz(rng) for _ in range(nc)]
    fa = [_small(rng) for _ in range(rng.randint(0, 2))]
    fb = [_small(rng) for _ in range(rng.randint(0, 2))]
    if rng.random() < 0.5:
        a = _f64(rng, *fa, *contracted)
        b = _f64(rng, *contracted, *fb)
        if rng.random() < 0.7:
            return (a, b), {"dims": nc}
        return (a, b, nc), {}
    # explicit dims lists, in shuffled positions
    sa = fa + contracted
    order_a = list(range(len(sa)))
    rng.shuffle(order_a)
    a_shape = [sa[i] for i in order_a]
    sb = contracted + fb
    order_b = list(range(len(sb)))
    rng.shuffle(order_b)
    b_shape = [sb[i] for i in order_b]
    da = [order_a.index(len(fa) + j) for j in range(nc)]
    db = [order_b.index(j) for j in range(nc)]
    if da and rng.random() < 0.5:
        da[0] -= len(a_shape)
    return (_f64(rng, *a_shape), _f64(rng, *b_shape)), {"dims": (da, db)}


_EINSUM_CASES = (
    "ij,jk->ik",
    "ij,kj->ik",
    "bij,bjk->bik",
    "bhld,bhsd->bhls",
    "i,i->",
    "i,j->ij",
    "ij->ji",
    "ii->i",
    "ii",
    "ij->",
    "ij",
    "ij,jk",
    "...ij,...jk->...ik",
    "...ij->...",
    "b...d,d->b...",
    "abc,cd,de->abe",
    "bn,anm,bm->ba",
    "ij,ij->ij",
)


def gen_einsum(rng: random.Random) -> tuple[tuple, dict]:
    eq = rng.choice(_EINSUM_CASES)
    terms, _ = einsum_terms(eq)
    sizes: dict[str, int] = {}
    ell = tuple(rng.choice((1, 2, 3)) for _ in range(rng.randint(0, 2)))
    ops = []
    for term in terms:
        shape: list[int] = []
        for lab in term:
            if lab == "...":
                shape.extend(n if rng.random() < 0.8 else 1 for n in ell)
            else:
                shape.append(sizes.setdefault(lab, _sz(rng)))
        ops.append(_f64(rng, *shape))
    r = rng.random()
    if r < 0.1:  # the list form
        return (eq, ops), {}
    if r < 0.2 and "..." not in eq:  # the sublist form
        labels = sorted({lab for t in terms for lab in t})
        sub = {lab: i for i, lab in enumerate(labels)}
        args: list[Any] = []
        for term, op in zip(terms, ops, strict=True):
            args.extend([op, [sub[lab] for lab in term]])
        _, rhs = einsum_terms(eq)
        if rhs is not None:
            args.append([sub[lab] for lab in rhs])
        return tuple(args), {}
    return (eq, *ops), {}


def _gmm_operand(rng: random.Random, *shape: int, transposed: bool = False) -> torch.Tensor:
    """A small-integer float32 tensor (exact sums), row-major or with its last two dims
    transposed in memory (MoE weights are often ``w.transpose(-2, -1)``)."""
    if not transposed:
        return randint(rng, -3, 4, *shape).to(torch.float32)
    t = randint(rng, -3, 4, *shape[:-2], shape[-1], shape[-2]).to(torch.float32)
    return t.transpose(-2, -1)


def _gmm_offs(rng: random.Random, e: int, total: int) -> torch.Tensor:
    cuts = sorted(rng.randint(0, total) for _ in range(e - 1))
    return torch.tensor([*cuts, total], dtype=torch.int32)


def gen_grouped_mm(rng: random.Random) -> tuple[tuple, dict]:
    four = (4, 8, 12)
    e = rng.choice((1, 2, 3, 4))
    k, n, m = rng.choice(four), rng.choice(four), rng.choice(four)
    mode = rng.random()
    tb = rng.random() < 0.5
    if mode < 0.55:  # the MoE forward: tokens sorted by expert
        a = _gmm_operand(rng, m, k, transposed=rng.random() < 0.3)  # m is a multiple of 4
        b = _gmm_operand(rng, e, k, n, transposed=tb)
        offs = _gmm_offs(rng, e, m)
    elif mode < 0.7:
        a = _gmm_operand(rng, e, m, k)
        b = _gmm_operand(rng, k, n, transposed=tb)
        offs = _gmm_offs(rng, e, n)
    elif mode < 0.85:
        a = _gmm_operand(rng, m, k)
        b = _gmm_operand(rng, k, n, transposed=tb)
        offs = _gmm_offs(rng, e, k)
    else:
        return (_gmm_operand(rng, e, m, k), _gmm_operand(rng, e, k, n, transposed=tb)), {}
    if rng.random() < 0.3:
        return (a, b, offs), {}
    return (a, b), {"offs": offs}
