"""Reductions, scans and sorts: ``sum``, ``mean``, ``max``, ``norm``, ``cumsum``, ``topk``...

The dims an op does not reduce split freely. A reduced dim is ``+`` only where the
whole result is the sum of the parts' results (``sum``, ``nansum``, ``count_nonzero``);
everything else that combines the values along a dim non-additively is ``^``: ``prod``,
``amax``, ``max`` (and its indices, which are local to a part), ``all``/``any``, norms,
``std``/``var``, ``logsumexp``, the scanned dim of ``cumsum``, the sorted dim of ``sort``.

``mean`` is ``^`` on the reduced dims: the mean of a part is not a share of the mean
(a part would have to divide by the whole size, and ``mean`` has no argument for that).
Splitting the hidden dim of RMSNorm's ``x.pow(2).mean(-1, keepdim=True)`` is rarely
wanted, so nothing is lost in practice.

A reduction over every dim gives a 0-d tensor, annotated ``1`` (nnScaler's notation for a
0-d tensor): ``sum(x)`` is ``a+ b+ -> 1``, whose parts are 0-d partial sums. A 0-d input
is ``1`` too and is taken whole.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nnscaler.ops.builtin._common import SPLITTABLE_SIZES, idents, is_tensor, norm_dim, randint
from nnscaler.ops.builtin.family_helpers import (
    Gen,
    broadcast_text,
    randn,
    register_all,
    shape,
    spellings,
)
from nnscaler.ops.registry import OpRegistry

T = torch.Tensor


def _reduced(x: Any, dim: Any) -> set[int]:
    """The dims ``dim`` reduces: ``None`` or an empty sequence means every dim."""
    nd = x.dim()
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return set(range(nd))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return {norm_dim(int(d), nd) for d in dims}


def reduction_text(x: Any, dim: Any, keepdim: bool, mark: str, n_outputs: int = 1) -> str:
    """``x``'s dims with ``mark`` on the reduced ones -> the kept dims (``1`` if keepdim)."""
    if not is_tensor(x) or x.dim() == 0:
        return "1 -> " + ", ".join(["1"] * n_outputs)
    reduced = _reduced(x, dim)
    names = idents(x.dim())
    ins = " ".join(n + mark if i in reduced else n for i, n in enumerate(names))
    kept = [("1" if keepdim else "") if i in reduced else n for i, n in enumerate(names)]
    out = " ".join(k for k in kept if k) or "1"
    return f"{ins} -> {', '.join([out] * n_outputs)}"


def along_text(x: Any, dim: int, n_outputs: int = 1, size: int | None = None) -> str:
    """An op along ``dim`` (a scan, a sort): that dim ``^`` (of size ``size`` in the
    outputs, when given), the others split."""
    if not is_tensor(x) or x.dim() == 0:
        return "1 -> " + ", ".join(["1"] * n_outputs)
    d = norm_dim(dim, x.dim())
    names = idents(x.dim())
    ins = " ".join(n + "^" if i == d else n for i, n in enumerate(names))
    out = ins if size is None else " ".join(
        str(size) if i == d else n for i, n in enumerate(names))
    return f"{ins} -> {', '.join([out] * n_outputs)}"


# -- annotations (their signatures are the ops' documented ones) ------------------------


def _sum(input, dim=None, keepdim=False, *, dtype=None) -> str:
    return reduction_text(input, dim, keepdim, "+")


def _count_nonzero(input, dim=None) -> str:
    return reduction_text(input, dim, False, "+")


def _mean(input, dim=None, keepdim=False, *, dtype=None) -> str:
    return reduction_text(input, dim, keepdim, "^")


def _prod(input, dim=None, keepdim=False, *, dtype=None) -> str:
    return reduction_text(input, dim, keepdim, "^")


def _amax(input, dim=(), keepdim=False) -> str:
    return reduction_text(input, dim, keepdim, "^")


def _argmax(input, dim=None, keepdim=False) -> str:
    return reduction_text(input, dim, keepdim, "^")


def _all(input, dim=None, keepdim=False) -> str:
    return reduction_text(input, dim, keepdim, "^")


def _max(input, dim=None, keepdim=False) -> str:
    if is_tensor(dim):  # max(input, other): the elementwise maximum
        return broadcast_text([input, dim])
    # max(input) is one value; max(input, dim) gives (values, indices)
    return reduction_text(input, dim, keepdim, "^", 1 if dim is None else 2)


def _aminmax(input, *, dim=None, keepdim=False) -> str:
    return reduction_text(input, dim, keepdim, "^", 2)


def _median(input, dim=None, keepdim=False) -> str:
    return reduction_text(input, dim, keepdim, "^", 1 if dim is None else 2)


def _mode(input, dim=-1, keepdim=False) -> str:
    return reduction_text(input, dim, keepdim, "^", 2)


def _kthvalue(input, k, dim=-1, keepdim=False) -> str:
    return reduction_text(input, dim, keepdim, "^", 2)


def _norm(input, p="fro", dim=None, keepdim=False, out=None, dtype=None) -> str:
    return reduction_text(input, dim, keepdim, "^")


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None) -> str:
    return reduction_text(x, dim, keepdim, "^")


def _std_dim(dim: Any) -> Any:
    return None if isinstance(dim, bool) else dim  # std(input, unbiased)


def _std(input, dim=None, unbiased=True, keepdim=False, *, correction=None) -> str:
    return reduction_text(input, _std_dim(dim), keepdim, "^")


def _std_mean(input, dim=None, unbiased=True, keepdim=False, *, correction=None) -> str:
    return reduction_text(input, _std_dim(dim), keepdim, "^", 2)


def _logsumexp(input, dim, keepdim=False) -> str:
    return reduction_text(input, dim, keepdim, "^")


def _scan(input, dim, *, dtype=None) -> str:
    return along_text(input, dim)


def _scan_(self, dim, *, dtype=None) -> str:
    return along_text(self, dim)


def _logcumsumexp(input, dim) -> str:
    return along_text(input, dim)


def _cummax(input, dim) -> str:
    return along_text(input, dim, 2)


# sort(input, dim=-1, descending=False) or sort(input, *, stable, dim=-1, descending=False):
# with ``stable``, torch takes dim and descending by keyword only, so the signature keeps
# positional ones apart (``*args``) and the call is replayed as it was written.
def _sort(input, *args, dim=-1, descending=False, stable=None) -> str:
    return along_text(input, args[0] if args else dim, 2)


def _argsort(input, *args, dim=-1, descending=False, stable=None) -> str:
    return along_text(input, args[0] if args else dim)


def _topk(input, k, dim=-1, largest=True, sorted=True) -> str:
    return along_text(input, dim, 2, size=int(k))


# -- input generators -------------------------------------------------------------------


def _tensor(rng: random.Random, min_ndim: int, kind: str) -> torch.Tensor:
    # std/var need two values per reduced dim ("pos"); the others see size-1 dims too
    sizes = SPLITTABLE_SIZES if kind == "pos" or rng.random() < 0.7 else (1, 2, 3, 4, 6)
    s = shape(rng, min_ndim, 4, sizes)
    if kind == "bool":
        return randint(rng, 0, 2, *s) > 0 if rng.random() < 0.7 else randint(rng, -1, 2, *s)
    if kind == "float64":  # sums of parts: exact enough for the comparison at any size
        return randn(rng, *s, dtype=torch.float64)
    if kind == "int":
        return randint(rng, -3, 4, *s)
    if kind == "pos":
        return randn(rng, *s).abs() + 0.5
    return randn(rng, *s)


def _dim_arg(rng: random.Random, x: torch.Tensor, many: bool) -> Any:
    """One dim (maybe negative) or, when ``many``, sometimes a tuple or list of them."""
    nd = max(x.dim(), 1)
    d = rng.randrange(nd)
    d = rng.choice([d, d - nd])
    if many and rng.random() < 0.4 and x.dim() > 1:
        picked = rng.sample(range(nd), rng.randint(1, nd))
        return rng.choice([tuple(picked), [p - nd for p in picked]])
    return d


def reduction_gen(
    kind: str = "float",
    *,
    many: bool = True,
    optional: bool = True,
    keepdim: bool = True,
    extra: Callable[[random.Random], dict[str, Any]] | None = None,
    min_ndim: int = 0,
    positional: bool = True,
) -> Gen:
    """``(x, [dim], [keepdim])`` with ``dim`` optional, positional (when ``positional``)
    or keyword."""

    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = _tensor(rng, min_ndim, kind)
        kw = extra(rng) if extra else {}
        if optional and rng.random() < 0.3:
            return (x,), kw
        dim = _dim_arg(rng, x, many)
        if keepdim and rng.random() < 0.4:
            kw["keepdim"] = rng.random() < 0.5
        if positional and rng.random() < 0.5:
            return (x, dim), kw
        return (x,), {"dim": dim, **kw}

    return gen


def _gen_max(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _tensor(rng, 0, "float")
    how = rng.randrange(4)
    if how == 0:
        return (x,), {}
    if how == 1:  # the elementwise maximum of two tensors
        return (x, randn(rng, *x.shape)), {}
    dim = _dim_arg(rng, x, False)
    return ((x, dim, True), {}) if how == 2 else ((x,), {"dim": dim})


def _gen_median(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _tensor(rng, 0, "float")
    if rng.random() < 0.3:
        return (x,), {}
    return (x, _dim_arg(rng, x, False)), rng.choice([{}, {"keepdim": True}])


def _gen_kthvalue(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _tensor(rng, 1, "float")
    dim = _dim_arg(rng, x, False)
    k = rng.randint(1, x.shape[dim])
    return (x, k, dim), rng.choice([{}, {"keepdim": True}])


def _gen_norm(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kw = reduction_gen(positional=False)(rng)
    if isinstance(kw.get("dim"), (tuple, list)):
        kw["dim"] = kw["dim"][:2]  # torch.norm takes at most two dims
    elif rng.random() < 0.5:
        kw["p"] = rng.choice([1, 2, 3.0, float("inf")])  # over two dims: matrix norms
    return args, kw


def _gen_vector_norm(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kw = reduction_gen(positional=False)(rng)
    if rng.random() < 0.5:
        kw["ord"] = rng.choice([1, 2, 3.0, float("inf"), 0])
    return args, kw


def _gen_std(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _tensor(rng, 1, "pos")
    how = rng.randrange(5)
    if how == 0:
        return (x,), {}
    if how == 1:
        return (x, rng.random() < 0.5), {}  # std(input, unbiased)
    dim = _dim_arg(rng, x, True)
    if how == 2:
        return (x, dim, True, True), {}
    if how == 3:
        return (x,), {"dim": dim, "correction": rng.choice([0, 1]), "keepdim": rng.random() < 0.5}
    return (x, dim), {"unbiased": False}


def _gen_along(kind: str = "float", dim_required: bool = True,
               extra: Callable[[random.Random], dict[str, Any]] | None = None) -> Gen:
    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = _tensor(rng, 0, kind)
        kw = extra(rng) if extra else {}
        if not dim_required and rng.random() < 0.3:
            return (x,), kw
        dim = _dim_arg(rng, x, False)
        if rng.random() < 0.5 and "stable" not in kw:  # stable=: dim by keyword only
            return (x, dim), kw
        return (x,), {"dim": dim, **kw}

    return gen


def _gen_topk(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _tensor(rng, 1, "float")
    dim = _dim_arg(rng, x, False)
    k = rng.randint(0, x.shape[dim])
    if rng.random() < 0.4 and dim in (-1, x.dim() - 1):
        return (x, k), rng.choice([{}, {"largest": False}])
    return (x, k, dim), rng.choice([{}, {"largest": False}, {"sorted": True}])


def _sort_kw(rng: random.Random) -> dict[str, Any]:
    return rng.choice([{}, {"descending": True}, {"stable": True}])


def dtype_kw(rng: random.Random) -> dict[str, Any]:
    return rng.choice([{}, {"dtype": torch.float64}])


# -- registration -----------------------------------------------------------------------


def register(registry: OpRegistry) -> None:
    def reg(name: str, annotation: Callable[..., str], gen: Gen, *extra: Any,
            fns: Sequence[Any] | None = None) -> None:
        register_all(registry, fns or spellings(name, *extra), annotation, name=f"torch.{name}",
                     gen=gen)

    reg("sum", _sum, reduction_gen("float64"))
    reg("nansum", _sum, reduction_gen("float64"))
    reg("count_nonzero", _count_nonzero, reduction_gen("int", keepdim=False))
    reg("mean", _mean, reduction_gen(extra=dtype_kw))
    reg("nanmean", _mean, reduction_gen())
    reg("prod", _prod, reduction_gen(many=False, extra=dtype_kw))
    reg("amax", _amax, reduction_gen())
    reg("amin", _amax, reduction_gen())
    reg("argmax", _argmax, reduction_gen(many=False))
    reg("argmin", _argmax, reduction_gen(many=False))
    reg("all", _all, reduction_gen("bool"))
    reg("any", _all, reduction_gen("bool"))
    reg("max", _max, _gen_max)
    reg("min", _max, _gen_max)
    reg("aminmax", _aminmax, reduction_gen(many=False, positional=False))
    reg("median", _median, _gen_median)
    reg("nanmedian", _median, _gen_median)
    reg("mode", _mode, _gen_along("int", dim_required=False))
    reg("kthvalue", _kthvalue, _gen_kthvalue)
    reg("norm", _norm, _gen_norm, T.norm)
    register_all(registry, (torch.linalg.vector_norm,), _vector_norm,
                 name="torch.linalg.vector_norm", gen=_gen_vector_norm)
    for name in ("std", "var"):
        reg(name, _std, _gen_std)
        reg(f"{name}_mean", _std_mean, _gen_std)
    reg("logsumexp", _logsumexp, reduction_gen(optional=False), torch.special.logsumexp)
    for name in ("cumsum", "cumprod"):
        reg(name, _scan, _gen_along(extra=dtype_kw))
        register_all(registry, (getattr(T, f"{name}_"),), _scan_, name=f"torch.Tensor.{name}_",
                     gen=_gen_along())
    reg("logcumsumexp", _logcumsumexp, _gen_along())
    reg("cummax", _cummax, _gen_along())
    reg("cummin", _cummax, _gen_along())
    reg("sort", _sort, _gen_along(dim_required=False, extra=_sort_kw))
    reg("argsort", _argsort, _gen_along(dim_required=False, extra=_sort_kw))
    reg("topk", _topk, _gen_topk)
