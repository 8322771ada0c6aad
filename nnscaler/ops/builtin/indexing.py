"""Indexing ops: ``x[...]``, ``x[...] = v``, gather/scatter, index_*, masked_*, histc, ...

``Tensor.__getitem__``: a dim taken whole by ``:`` keeps its identifier and may be split; a
stepped slice ``::s`` over a dim that ``s`` divides (start below ``s``) is the group
``(a s)`` whose first member is split (``x[::2]`` on 8 rows: ``(a 2) -> a``); ints and
partial slices make the dim ``^`` (an output dim of a partial slice is a number). Advanced
indices (integer or boolean tensors, lists) follow PyTorch's placement rule (ints are
applied first; the broadcast index dims replace the indexed dims when those are adjacent,
else they lead): the indexed dims are ``^``, the index dims of the result are numbers and
the key is ``?``. A key that is one integer tensor is itself annotated, so the index may
be split: ``x[idx]`` on ``n d`` with ``idx`` of shape ``i j`` is ``a^ b, c d -> c d b``.

``Tensor.__setitem__`` returns ``None`` in Python; the op registered for it is
:func:`setitem`, which performs the assignment and returns the mutated tensor, so that the
op's output is the new value of ``self`` (like an in-place ``add_``). Its annotation is
``self, ?, value -> self`` with the value's dims sharing the identifiers of the dims of
``self[key]`` that they fill (a broadcast value dim is ``1``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch

from nnscaler.ops.builtin._common import (
    SPLITTABLE_SIZES,
    broadcast_anno,
    idents,
    is_tensor,
    norm_dim,
    rand_shape,
    randbool,
    randint,
    randn,
    tensor_str,
)
from nnscaler.ops.builtin.shape import reshape_dims
from nnscaler.ops.registry import OpRegistry

__all__ = ["register", "setitem"]


def _anno(inputs: Sequence[Sequence[str] | str], outputs: Sequence[Sequence[str] | str]) -> str:
    def one(t: Sequence[str] | str) -> str:
        return t if isinstance(t, str) else tensor_str(t)

    return f"{', '.join(map(one, inputs))} -> {', '.join(map(one, outputs))}"


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _frozen(names: Sequence[str]) -> list[str]:
    return [n + "^" for n in names]


# ---------------------------------------------------------------------------------------
# the index key of x[key]
# ---------------------------------------------------------------------------------------


class _Unsupported(Exception):
    """A key whose result the plan does not model; the caller falls back to '^' everywhere."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_index_tensor(v: Any) -> bool:
    return is_tensor(v) and not (v.dtype == torch.bool or v.dtype == torch.uint8) and not (
        v.is_floating_point() or v.is_complex()
    )


def _is_mask(v: Any) -> bool:
    return is_tensor(v) and (v.dtype == torch.bool or v.dtype == torch.uint8)


def _seq_as_tuple(seq: Sequence[Any]) -> bool:
    """PyTorch's rule for a list key: a tuple of indices when it holds slices, tensors, ..."""
    if len(seq) >= 32:
        return False
    return any(
        is_tensor(i) or isinstance(i, (list, tuple, slice)) or i is None or i is Ellipsis for i in seq
    )


def _key_items(key: Any) -> tuple[Any, ...]:
    if isinstance(key, tuple):
        return key
    if isinstance(key, list) and _seq_as_tuple(key):
        return tuple(key)
    return (key,)


def _normalize(item: Any) -> Any:
    if isinstance(item, (list, tuple)):
        return torch.tensor(item)
    if is_tensor(item) and item.dim() == 0:
        if _is_index_tensor(item):
            return 0  # acts as an int (its value does not matter, and may be on 'meta')
        if _is_mask(item):
            if item.device.type == "meta":
                raise _Unsupported("a 0-d mask on 'meta'")
            return bool(item)
    return item


def _slice_kind(slc: slice, size: int) -> str:
    """'full': every part takes all of its share; 'strided': ``::s`` with ``s | size``."""
    start = None if slc.start is None else int(slc.start)
    stop = None if slc.stop is None else int(slc.stop)
    step = 1 if slc.step is None else int(slc.step)
    whole_stop = stop is None or stop >= size
    if step == 1 and (start is None or start == 0 or start <= -size) and whole_stop:
        return "full"
    if step > 1 and size > 0 and size % step == 0 and (start is None or 0 <= start < step) and whole_stop:
        return "strided"
    return "partial"


class _Plan:
    """``self[key]``: annotation of ``self``'s dims and of the result's dims (with sizes)."""

    def __init__(self, x: torch.Tensor, key: Any) -> None:
        shape = _shape(x)
        self.names = idents(len(shape))
        self.self_dims = _frozen(self.names)
        items = [_normalize(i) for i in _key_items(key)]
        used = 0
        for item in items:
            if item is None or item is Ellipsis or isinstance(item, bool):
                continue
            used += item.dim() if _is_mask(item) else 1
        entries: list[tuple[str, int] | None] = []  # None: where advanced indices go
        adv_shapes: list[tuple[int, ...]] = []
        has_bool = False
        k = 0
        seen_ellipsis = False
        for item in items:
            if item is Ellipsis:
                if seen_ellipsis:
                    raise _Unsupported("two ellipses")
                seen_ellipsis = True
                for _ in range(len(shape) - used):
                    entries.append((self.names[k], shape[k]))
                    self.self_dims[k] = self.names[k]
                    k += 1
            elif item is None:
                entries.append(("1", 1))
            elif isinstance(item, bool):
                has_bool = True
                entries.append(("1", 1) if item else ("0", 0))
            elif _is_int(item):
                k += 1
            elif isinstance(item, slice):
                size = shape[k]
                kind = _slice_kind(item, size)
                if kind == "full":
                    self.self_dims[k] = self.names[k]
                    entries.append((self.names[k], size))
                elif kind == "strided":
                    step = int(item.step)
                    self.self_dims[k] = f"({self.names[k]} {step})"
                    entries.append((self.names[k], size // step))
                else:
                    n = len(range(*item.indices(size)))
                    entries.append((str(n), n))
                k += 1
            elif _is_mask(item):
                m = item.dim()
                if tuple(item.shape) != shape[k:k + m]:
                    raise _Unsupported("mask shape")
                adv_shapes.append((int(item.count_nonzero()),))
                entries.append(None)
                k += m
            elif _is_index_tensor(item):
                adv_shapes.append(_shape(item))
                entries.append(None)
                k += 1
            else:
                raise _Unsupported(f"index {type(item).__name__}")
            if k > len(shape):
                raise _Unsupported("too many indices")
        while k < len(shape):
            entries.append((self.names[k], shape[k]))
            self.self_dims[k] = self.names[k]
            k += 1
        if adv_shapes:
            if has_bool:
                raise _Unsupported("bool scalar with advanced indices")
            bshape = torch.broadcast_shapes(*adv_shapes)
            adv = [(str(s), int(s)) for s in bshape]
            at = [i for i, e in enumerate(entries) if e is None]
            if at == list(range(at[0], at[-1] + 1)):
                out = entries[:at[0]] + adv + entries[at[-1] + 1:]  # type: ignore[operator]
            else:
                out = adv + [e for e in entries if e is not None]
            self.out: list[tuple[str, int]] = out  # type: ignore[assignment]
        else:
            self.out = entries  # type: ignore[assignment]

    @property
    def out_dims(self) -> list[str]:
        return [d for d, _ in self.out]

    def value_dims(self, value: Any) -> str:
        """The annotation of a value assigned to ``self[key]`` (broadcast to the result)."""
        if not is_tensor(value) or value.dim() == 0:
            return "?"
        vshape = _shape(value)
        out = self.out
        dims: list[str] = []
        lead = len(vshape) - len(out)
        for j, vs in enumerate(vshape):
            o = j - lead
            if o < 0:
                dims.append(str(vs))
                continue
            name, size = out[o]
            if vs == size:
                dims.append(name)
            else:
                dims.append(str(vs))  # a broadcast 1
        return tensor_str(dims)


def _fallback_getitem(self: torch.Tensor, key: Any) -> str:
    out = _shape(self[key])
    return _anno([_frozen(idents(self.dim())), "?"], [[str(s) for s in out]])


def _getitem_anno(self: torch.Tensor, key: Any) -> str:
    if _is_index_tensor(key) and key.dim() > 0:
        names = idents(self.dim() + key.dim())
        mine, theirs = names[:self.dim()], names[self.dim():]
        return _anno([[mine[0] + "^"] + mine[1:], theirs], [theirs + mine[1:]])
    try:
        plan = _Plan(self, key)
    except _Unsupported:
        return _fallback_getitem(self, key)
    if _is_mask(key) and key.dim() > 0:
        key_anno = tensor_str(plan.self_dims[:key.dim()])
    else:
        key_anno = "?"
    return _anno([plan.self_dims, key_anno], [plan.out_dims])


def setitem(self: torch.Tensor, key: Any, value: Any) -> torch.Tensor:
    """``self[key] = value``, returning the mutated ``self`` (the op's output)."""
    self[key] = value
    return self


def _setitem_anno(self: torch.Tensor, key: Any, value: Any) -> str:
    try:
        plan = _Plan(self, key)
    except _Unsupported:
        frozen = _frozen(idents(self.dim()))
        value_anno = "?" if not is_tensor(value) or value.dim() == 0 else tensor_str(
            [str(s) for s in value.shape])
        return _anno([frozen, "?", value_anno], [frozen])
    return _anno([plan.self_dims, "?", plan.value_dims(value)], [plan.self_dims])


def _index_put_key(indices: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(slice(None) if i is None else i for i in indices)


def _index_put_anno(
    input: torch.Tensor, indices: Sequence[Any], values: Any, accumulate: bool = False
) -> str:
    return _setitem_anno(input, _index_put_key(indices), values)


# ---------------------------------------------------------------------------------------
# gather / take_along_dim / take
# ---------------------------------------------------------------------------------------


def _gather_anno(input: torch.Tensor, dim: int, index: torch.Tensor, *, sparse_grad: bool = False) -> str:
    n = input.dim()
    if n == 0:
        return "1, ?, 1 -> 1"
    d = norm_dim(dim, n)
    names = idents(2 * n)
    mine, fresh = names[:n], names[n:]
    ins, idx = list(mine), list(fresh)
    for k in range(n):
        if k == d:
            ins[k] = mine[k] + "^"  # the index dim is split with input replicated
        elif index.shape[k] == input.shape[k]:
            idx[k] = mine[k]
        else:
            ins[k], idx[k] = mine[k] + "^", fresh[k] + "^"
    return _anno([ins, "?", idx], [idx])


def _take_along_dim_anno(input: torch.Tensor, indices: torch.Tensor, dim: int | None = None) -> str:
    if dim is None:
        ishape = _shape(indices)
        names = idents(input.dim() + indices.dim())
        theirs = names[input.dim():]
        idx, out = reshape_dims(ishape, (math.prod(ishape),), theirs)
        return _anno([_frozen(names[:input.dim()]), idx], [out])
    n = input.dim()
    d = norm_dim(dim, n)
    names = idents(n)
    ins, idx, out = list(names), list(names), list(names)
    for k in range(n):
        si, sj = input.shape[k], indices.shape[k]
        if k == d:
            ins[k] = names[k] + "^"
            idx[k] = out[k] = "z" + names[k]  # the index dim: split with input replicated
        elif si != sj and si == 1:
            ins[k] = "1"
        elif si != sj and sj == 1:
            idx[k] = "1"
    return _anno([ins, idx], [out])


def _take_shape_anno(input: torch.Tensor, index: torch.Tensor) -> str:
    names = idents(input.dim() + index.dim())
    theirs = names[input.dim():]
    return _anno([_frozen(names[:input.dim()]), theirs], [theirs])


# ---------------------------------------------------------------------------------------
# scatter / index_add / index_copy / index_fill / index_select
# ---------------------------------------------------------------------------------------


def _scatter_dims(input: torch.Tensor, dim: int, index: torch.Tensor, src: Any) -> str:
    n = input.dim()
    if n == 0:
        return _anno(["1", "?", "1", "1" if is_tensor(src) else "?"], ["1"])
    d = norm_dim(dim, n)
    names = idents(3 * n)
    mine, fresh_i, fresh_s = names[:n], names[n:2 * n], names[2 * n:]
    src_t = is_tensor(src) and src.dim() == n
    ins, idx, srcd = list(mine), list(fresh_i), list(fresh_s)
    for k in range(n):
        same = index.shape[k] == input.shape[k] and (not src_t or src.shape[k] == index.shape[k])
        if k != d and same:
            idx[k] = srcd[k] = mine[k]
        else:
            ins[k], idx[k], srcd[k] = mine[k] + "^", fresh_i[k] + "^", fresh_s[k] + "^"
    return _anno([ins, "?", idx, srcd if src_t else "?"], [ins])


def _scatter_anno(
    input: torch.Tensor, dim: int, index: torch.Tensor, src: Any = None, *, value: Any = None,
    reduce: str | None = None,
) -> str:
    text = _scatter_dims(input, dim, index, src)
    if src is None:  # scatter(input, dim, index, value=...): three annotated inputs
        ins, outs = text.split(" -> ")
        text = f"{ins.rsplit(', ', 1)[0]} -> {outs}"
    return text


def _scatter_add_anno(input: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> str:
    return _scatter_dims(input, dim, index, src)


def _scatter_reduce_anno(
    input: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, reduce: str, *,
    include_self: bool = True,
) -> str:
    return _scatter_dims(input, dim, index, src)


def _index_into(input: torch.Tensor, dim: int, index: torch.Tensor, source: Any) -> str:
    """``index_add``/``index_copy``/``index_fill``: rows ``index`` of ``input`` along ``dim``."""
    n = input.dim()
    if n == 0:
        idx0 = tensor_str([str(s) for s in index.shape])
        src0 = tensor_str([str(s) for s in source.shape]) if is_tensor(source) else "?"
        return _anno(["1", "?", idx0, src0], ["1"])
    d = norm_dim(dim, n)
    names = idents(n + 1)
    mine, m = names[:n], names[n] + "^"
    ins = list(mine)
    ins[d] += "^"
    idx = [m] if index.dim() == 1 else ["1"]
    if is_tensor(source) and source.dim() == n:
        src = list(mine)
        src[d] = m if index.dim() == 1 else "1"
        src_anno: Any = src
    else:
        src_anno = "?"
    return _anno([ins, "?", idx, src_anno], [ins])


def _index_add_anno(
    input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *, alpha: Any = 1
) -> str:
    return _index_into(input, dim, index, source)


def _index_copy_anno(input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> str:
    return _index_into(input, dim, index, source)


def _index_fill_anno(input: torch.Tensor, dim: int, index: torch.Tensor, value: Any) -> str:
    return _index_into(input, dim, index, value)


def _index_select_anno(input: torch.Tensor, dim: int, index: torch.Tensor) -> str:
    n = input.dim()
    if n == 0:
        return "1, ?, 1 -> 1"
    d = norm_dim(dim, n)
    names = idents(n + 1)
    mine, m = names[:n], names[n]
    ins, out = list(mine), list(mine)
    ins[d] += "^"
    idx = [m] if index.dim() == 1 else ["1"]
    out[d] = idx[0]
    return _anno([ins, "?", idx], [out])


# ---------------------------------------------------------------------------------------
# masked_select / masked_scatter
# ---------------------------------------------------------------------------------------


def _masked_select_anno(input: torch.Tensor, mask: torch.Tensor) -> str:
    ins, _ = broadcast_anno([input, mask], out_mark="^")
    nnz = int(torch.broadcast_to(mask, torch.broadcast_shapes(input.shape, mask.shape)).count_nonzero())
    return _anno(ins, [[str(nnz)]])


def _masked_scatter_anno(input: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> str:
    ins, out = broadcast_anno([input, mask], out_mark="^")
    n = max(input.dim(), mask.dim())
    src = _frozen(idents(n + source.dim())[n:])
    return _anno([*ins, src], [out])


# ---------------------------------------------------------------------------------------
# histc / bincount / searchsorted / bucketize / nonzero
# ---------------------------------------------------------------------------------------


def _histc_anno(input: torch.Tensor, bins: int = 100, min: Any = 0, max: Any = 0) -> str:
    names = idents(input.dim())
    # fixed bounds: the counts of the parts add up; bounds 0, 0 mean "the data's range",
    # which differs between parts
    mark = "+" if float(min) != float(max) else "^"
    return _anno([[n + mark for n in names]], [[str(int(bins))]])


def _bincount_anno(input: torch.Tensor, weights: Any = None, minlength: int = 0) -> str:
    # the output length is max(input) + 1: it depends on the data of each part
    length = max(int(input.max()) + 1 if input.numel() else 0, int(minlength))
    if is_tensor(weights):
        return _anno(["a^", "a^"], [[str(length)]])
    return _anno(["a^"], [[str(length)]])


def _searchsorted_anno(
    sorted_sequence: torch.Tensor, input: Any, *, out_int32: bool = False, right: bool = False,
    side: str | None = None, sorter: Any = None,
) -> str:
    s = sorted_sequence.dim()
    if not is_tensor(input):
        return _anno([_frozen(idents(s)), "?"], ["1"])
    n = input.dim()
    names = idents(n + 1)
    mine, last = names[:n], names[n] + "^"
    if s == 1:
        return _anno([[last], mine], [mine])
    lead = mine[:-1]
    if is_tensor(sorter):
        lead = _frozen(lead)  # the sorter is taken whole
    inp = lead + [mine[-1]]
    return _anno([lead + [last], inp], [inp])


def _bucketize_anno(input: Any, boundaries: torch.Tensor, *, out_int32: bool = False, right: bool = False) -> str:
    if not is_tensor(input):
        return _anno(["?", "z^"], ["1"])
    names = idents(input.dim())
    return _anno([names or "1", "z^"], [names or "1"])


def _nonzero_anno(input: torch.Tensor, *, out: Any = None, as_tuple: bool = False) -> str:
    nnz = int(input.count_nonzero())
    dims = _frozen(idents(input.dim())) or "1"
    if as_tuple:
        return _anno([dims], [[str(nnz)]] * max(input.dim(), 1))
    return _anno([dims], [[str(nnz), str(input.dim())]])


def _argwhere_anno(input: torch.Tensor) -> str:
    return _nonzero_anno(input)


# ---------------------------------------------------------------------------------------
# input generators
# ---------------------------------------------------------------------------------------

Call = tuple[tuple[Any, ...], dict[str, Any]]


def _shp(rng: random.Random, lo: int = 1, hi: int = 3) -> tuple[int, ...]:
    return rand_shape(rng, lo, hi, sizes=SPLITTABLE_SIZES + (1, 3))


def _x(rng: random.Random, shape: Sequence[int]) -> torch.Tensor:
    return randn(rng, *shape) if shape else randn(rng, 1).reshape(())


def _rand_slice(rng: random.Random, size: int) -> slice:
    r = rng.random()
    if r < 0.35:
        return slice(None)
    if r < 0.5:
        step = rng.choice([s for s in (2, 3, 4) if size % s == 0] or [2])
        return slice(rng.choice((None, 0, step - 1)), None, step)
    if r < 0.6:
        return slice(-size if rng.random() < 0.5 else 0, size + rng.randint(0, 2))
    start = rng.randint(-size, size)
    stop = rng.choice((None, rng.randint(-size, size)))
    return slice(start, stop, rng.choice((None, 1, 2)))


def _rand_key(rng: random.Random, shape: Sequence[int], *, allow_adv: bool = True) -> Any:
    items: list[Any] = []
    k = 0
    ellipsis = False
    n_adv = 0
    adv_shape = rand_shape(rng, 1, 2, sizes=(1, 2, 3))
    while k < len(shape):
        r = rng.random()
        size = shape[k]
        if r < 0.1:
            items.append(None)
            continue
        if r < 0.18 and not ellipsis:
            items.append(Ellipsis)
            ellipsis = True
            k = len(shape) - rng.randint(0, len(shape) - k)
            continue
        if r < 0.3:
            items.append(rng.randrange(-size, size))
        elif r < 0.42 and allow_adv and n_adv < 2:
            if n_adv == 0 and rng.random() < 0.3:  # a mask: the only advanced index
                n_adv = 2
                m = rng.randint(1, min(2, len(shape) - k))
                items.append(randbool(rng, *shape[k:k + m]))
                k += m
                continue
            n_adv += 1
            ishape = [1 if rng.random() < 0.3 else s for s in adv_shape]
            items.append(randint(rng, -size, size, *ishape))
            if rng.random() < 0.2:
                items[-1] = items[-1].tolist()
        else:
            items.append(_rand_slice(rng, size))
        k += 1
        if not ellipsis and rng.random() < 0.2:
            break  # trailing dims are implicit ':'
    if len(items) == 1 and not isinstance(items[0], list) and rng.random() < 0.5:
        return items[0]
    return tuple(items)


def _gen_getitem(rng: random.Random) -> Call:
    x = _x(rng, _shp(rng, 1, 4))
    r = rng.random()
    if r < 0.2:
        return (x, randint(rng, -x.shape[0], x.shape[0], *rand_shape(rng, 1, 2, sizes=(1, 2, 4)))), {}
    if r < 0.3:
        m = rng.randint(1, x.dim())
        return (x, randbool(rng, *x.shape[:m])), {}
    return (x, _rand_key(rng, x.shape)), {}


def _result_shape(x: torch.Tensor, key: Any) -> tuple[int, ...]:
    return _shape(x[key])


def _gen_setitem(rng: random.Random) -> Call:
    x = _x(rng, _shp(rng, 1, 4))
    r = rng.random()
    if r < 0.15:  # inv_perm[perm] = arange(...) (Mixtral)
        x = _x(rng, (rng.choice(SPLITTABLE_SIZES),))
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(rng.getrandbits(32)))
        return (x, perm, randn(rng, x.shape[0])), {}
    key = _rand_key(rng, x.shape, allow_adv=rng.random() < 0.3)
    if isinstance(key, tuple):  # integer indices may repeat a position: the last write is racy
        key = tuple(i if _is_mask(i) or not (is_tensor(i) or isinstance(i, list)) else slice(None)
                    for i in key)
    elif is_tensor(key) and not _is_mask(key):
        key = slice(None)
    out = _result_shape(x, key)
    v = rng.random()
    if v < 0.2:
        return (x, key, rng.uniform(-1, 1)), {}
    vshape = [1 if rng.random() < 0.25 else s for s in out]
    if vshape and rng.random() < 0.3:
        vshape = vshape[rng.randint(0, len(vshape)):]
    return (x, key, _x(rng, vshape)), {}


def _gen_index_put(rng: random.Random) -> Call:
    x = _x(rng, _shp(rng, 1, 3))
    m = rng.randint(1, x.dim())
    accumulate = rng.random() < 0.5
    if rng.random() < 0.3:
        mask = randbool(rng, *x.shape[:m])
        vals = _x(rng, (1,) + x.shape[m:])
        return (x, (mask,), vals), {"accumulate": accumulate}
    n = rng.choice((1, 2, 3))
    if accumulate:
        idx = tuple(randint(rng, 0, x.shape[k], n) for k in range(m))
    else:  # distinct positions: assignment order of duplicates is unspecified
        flat = torch.randperm(math.prod(x.shape[:m]), generator=torch.Generator().manual_seed(rng.getrandbits(32)))
        pos = flat[:n]
        idx = tuple(torch.unravel_index(pos, x.shape[:m]))
        n = len(pos)
    return (x, idx, _x(rng, (len(idx[0]),) + x.shape[m:])), {"accumulate": accumulate}


def _gen_gather(rng: random.Random) -> Call:
    shape = _shp(rng, 1, 3)
    x = _x(rng, shape)
    d = rng.randrange(len(shape))
    ishape = [s if rng.random() < 0.7 else rng.randint(1, s) for s in shape]
    ishape[d] = rng.choice((1, 2, 4, 6))
    index = randint(rng, 0, shape[d], *ishape)
    dim = d - len(shape) if rng.random() < 0.3 else d
    return (x, dim, index), {}


def _gen_take_along_dim(rng: random.Random) -> Call:
    shape = _shp(rng, 1, 3)
    x = _x(rng, shape)
    if rng.random() < 0.3:
        return (x, randint(rng, 0, x.numel(), *_shp(rng, 1, 2))), {}
    d = rng.randrange(len(shape))
    ishape = [s if rng.random() < 0.7 else 1 for s in shape]
    ishape[d] = rng.choice((1, 2, 4))
    xs = [1 if (k != d and rng.random() < 0.2) else s for k, s in enumerate(shape)]
    x = _x(rng, xs)
    return (x, randint(rng, 0, xs[d], *ishape)), {"dim": d}


def _gen_take(rng: random.Random) -> Call:
    x = _x(rng, _shp(rng, 1, 3))
    return (x, randint(rng, -x.numel(), x.numel(), *_shp(rng, 1, 2))), {}


def _scatter_parts(rng: random.Random, *, unique: bool) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    shape = _shp(rng, 1, 3)
    x = _x(rng, shape)
    d = rng.randrange(len(shape))
    ishape = [s if rng.random() < 0.7 else rng.randint(1, s) for s in shape]
    if unique:  # each position written at most once: the result does not depend on the order
        ishape[d] = rng.randint(1, shape[d])
        cols = math.prod(ishape) // ishape[d]
        g = torch.Generator().manual_seed(rng.getrandbits(32))
        perms = torch.stack([torch.randperm(shape[d], generator=g)[:ishape[d]] for _ in range(cols)], -1)
        index = perms.reshape(ishape[d], *[s for k, s in enumerate(ishape) if k != d]).movedim(0, d)
        index = index.contiguous()
    else:
        ishape[d] = rng.choice((1, 2, 4, 6))
        index = randint(rng, 0, shape[d], *ishape)
    sshape = [s + (1 if rng.random() < 0.2 else 0) for s in ishape]
    return x, d, index, _x(rng, sshape)


def _gen_scatter(rng: random.Random) -> Call:
    x, d, index, src = _scatter_parts(rng, unique=True)
    if rng.random() < 0.4:
        kw: dict[str, Any] = {"value": rng.uniform(-1, 1)}
        if rng.random() < 0.5:  # ``reduce`` is deprecated with a tensor ``src``, not with a value
            kw["reduce"] = rng.choice(("add", "multiply"))
        return (x, d, index), kw
    return (x, d, index, src), {}


def _gen_scatter_add(rng: random.Random) -> Call:
    x, d, index, src = _scatter_parts(rng, unique=False)
    if rng.random() < 0.3:  # the MoE pattern: 1-d counts
        n = rng.choice((4, 8))
        idx = randint(rng, 0, n, rng.choice((6, 12)))
        return (torch.zeros(n), 0, idx, randn(rng, idx.shape[0])), {}
    return (x, d, index, src), {}


def _gen_scatter_reduce(rng: random.Random) -> Call:
    x, d, index, src = _scatter_parts(rng, unique=False)
    kw = {"include_self": rng.random() < 0.5}
    return (x, d, index, src, rng.choice(("sum", "amax", "amin"))), kw


def _gen_index_select(rng: random.Random) -> Call:
    x = _x(rng, _shp(rng, 1, 3))
    d = rng.randrange(x.dim())
    index = randint(rng, 0, x.shape[d], *rng.choice(((), (rng.choice((1, 2, 4, 6)),))))
    return (x, d - x.dim() if rng.random() < 0.3 else d, index), {}


def _index_rows(rng: random.Random, *, unique: bool) -> Call:
    x = _x(rng, _shp(rng, 1, 3))
    d = rng.randrange(x.dim())
    if unique:
        n = rng.randint(1, x.shape[d])
        index = torch.randperm(x.shape[d], generator=torch.Generator().manual_seed(rng.getrandbits(32)))[:n]
    else:
        n = rng.choice((1, 2, 4))
        index = randint(rng, 0, x.shape[d], n)
    sshape = list(x.shape)
    sshape[d] = n
    return (x, d - x.dim() if rng.random() < 0.3 else d, index, _x(rng, sshape)), {}


def _gen_index_add(rng: random.Random) -> Call:
    args, kw = _index_rows(rng, unique=False)
    if rng.random() < 0.3:
        kw["alpha"] = 0.5
    return args, kw


def _gen_index_copy(rng: random.Random) -> Call:
    return _index_rows(rng, unique=True)


def _gen_index_fill(rng: random.Random) -> Call:
    (x, d, index, _), _ = _index_rows(rng, unique=False)
    return (x, d, index, rng.uniform(-1, 1)), {}


def _gen_masked_select(rng: random.Random) -> Call:
    shape = _shp(rng, 1, 3)
    mshape = [1 if rng.random() < 0.3 else s for s in shape][rng.randint(0, len(shape) - 1):]
    return (_x(rng, shape), randbool(rng, *mshape)), {}


def _gen_masked_scatter(rng: random.Random) -> Call:
    shape = _shp(rng, 1, 3)
    mshape = [1 if rng.random() < 0.3 else s for s in shape][rng.randint(0, len(shape) - 1):]
    mask = randbool(rng, *mshape)
    return (_x(rng, shape), mask, _x(rng, (math.prod(shape) + rng.randint(0, 3),))), {}


def _gen_masked_scatter_(rng: random.Random) -> Call:
    shape = _shp(rng, 1, 3)
    mshape = [1 if rng.random() < 0.3 else s for s in shape][rng.randint(0, len(shape) - 1):]
    return (_x(rng, shape), randbool(rng, *mshape), _x(rng, (math.prod(shape),))), {}


def _gen_histc(rng: random.Random) -> Call:
    shape = _shp(rng, 1, 3)
    bins = rng.choice((3, 4, 8))
    if rng.random() < 0.6:  # the MoE pattern: expert ids counted in fixed bins
        x = randint(rng, 0, bins, *shape).float()
        return (x,), {"bins": bins, "min": 0, "max": bins - rng.choice((0, 1))}
    x = _x(rng, shape)
    if rng.random() < 0.3:
        return (x, bins), {}
    return (x, bins, -1.0, 1.0), {}


def _gen_bincount(rng: random.Random) -> Call:
    x = randint(rng, 0, 6, rng.choice((4, 6, 8)))
    kw: dict[str, Any] = {}
    if rng.random() < 0.5:
        kw["minlength"] = rng.randint(0, 8)
    if rng.random() < 0.5:
        return (x, randn(rng, x.shape[0], dtype=torch.float64)), kw
    return (x,), kw


def _sorted(rng: random.Random, *shape: int) -> torch.Tensor:
    return randn(rng, *shape).sort(-1).values


def _gen_searchsorted(rng: random.Random) -> Call:
    kw: dict[str, Any] = {}
    if rng.random() < 0.3:
        kw["right"] = True
    if rng.random() < 0.5:
        seq = _sorted(rng, rng.choice((3, 5)))
        if rng.random() < 0.15:
            return (seq, rng.uniform(-2, 2)), kw
        return (seq, _x(rng, _shp(rng, 1, 3))), kw
    lead = _shp(rng, 1, 2)
    seq = _sorted(rng, *lead, rng.choice((3, 5)))
    if rng.random() < 0.3:
        shuffled = randn(rng, *seq.shape)
        kw["sorter"] = shuffled.argsort(-1)
        seq = shuffled
    return (seq, _x(rng, (*lead, rng.choice((2, 4, 6))))), kw


def _gen_bucketize(rng: random.Random) -> Call:
    b = _sorted(rng, rng.choice((3, 5)))
    if rng.random() < 0.1:
        return (rng.uniform(-2, 2), b), {}
    return (_x(rng, _shp(rng, 1, 3)), b), {"right": rng.random() < 0.5}


def _gen_nonzero(rng: random.Random) -> Call:
    x = randbool(rng, *_shp(rng, 1, 3)).float()
    return (x,), ({"as_tuple": True} if rng.random() < 0.4 else {})


def _gen_argwhere(rng: random.Random) -> Call:
    return (randbool(rng, *_shp(rng, 1, 3)).float(),), {}


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------


def register(registry: OpRegistry) -> None:
    T = torch.Tensor
    reg = registry.register

    reg(T.__getitem__, _getitem_anno, name="torch.Tensor.__getitem__", input_gen_fn=_gen_getitem)
    reg(setitem, _setitem_anno, name="torch.Tensor.__setitem__", aliases=(T.__setitem__,),
        input_gen_fn=_gen_setitem)
    reg(torch.index_put, _index_put_anno, name="torch.index_put", aliases=(T.index_put,),
        input_gen_fn=_gen_index_put)
    reg(T.index_put_, _index_put_anno, name="torch.Tensor.index_put_", aliases=(torch.index_put_,),
        input_gen_fn=_gen_index_put)

    reg(torch.gather, _gather_anno, name="torch.gather", aliases=(T.gather,), input_gen_fn=_gen_gather)
    reg(torch.take_along_dim, _take_along_dim_anno, name="torch.take_along_dim", aliases=(T.take_along_dim,),
        input_gen_fn=_gen_take_along_dim)
    reg(torch.take, _take_shape_anno, name="torch.take", aliases=(T.take,), input_gen_fn=_gen_take)

    reg(torch.scatter, _scatter_anno, name="torch.scatter", aliases=(T.scatter,), input_gen_fn=_gen_scatter)
    reg(T.scatter_, _scatter_anno, name="torch.Tensor.scatter_", input_gen_fn=_gen_scatter)
    reg(torch.scatter_add, _scatter_add_anno, name="torch.scatter_add", aliases=(T.scatter_add,),
        input_gen_fn=_gen_scatter_add)
    reg(T.scatter_add_, _scatter_add_anno, name="torch.Tensor.scatter_add_", input_gen_fn=_gen_scatter_add)
    reg(torch.scatter_reduce, _scatter_reduce_anno, name="torch.scatter_reduce", aliases=(T.scatter_reduce,),
        input_gen_fn=_gen_scatter_reduce)
    reg(T.scatter_reduce_, _scatter_reduce_anno, name="torch.Tensor.scatter_reduce_",
        input_gen_fn=_gen_scatter_reduce)

    reg(torch.index_select, _index_select_anno, name="torch.index_select", aliases=(T.index_select,),
        input_gen_fn=_gen_index_select)
    reg(torch.index_add, _index_add_anno, name="torch.index_add", aliases=(T.index_add,),
        input_gen_fn=_gen_index_add)
    reg(T.index_add_, _index_add_anno, name="torch.Tensor.index_add_", input_gen_fn=_gen_index_add)
    reg(torch.index_copy, _index_copy_anno, name="torch.index_copy", aliases=(T.index_copy,),
        input_gen_fn=_gen_index_copy)
    reg(T.index_copy_, _index_copy_anno, name="torch.Tensor.index_copy_", input_gen_fn=_gen_index_copy)
    reg(torch.index_fill, _index_fill_anno, name="torch.index_fill", aliases=(T.index_fill,),
        input_gen_fn=_gen_index_fill)
    reg(T.index_fill_, _index_fill_anno, name="torch.Tensor.index_fill_", input_gen_fn=_gen_index_fill)

    reg(torch.masked_select, _masked_select_anno, name="torch.masked_select", aliases=(T.masked_select,),
        input_gen_fn=_gen_masked_select)
    reg(torch.masked_scatter, _masked_scatter_anno, name="torch.masked_scatter", aliases=(T.masked_scatter,),
        input_gen_fn=_gen_masked_scatter)

    reg(T.masked_scatter_, _masked_scatter_anno, name="torch.Tensor.masked_scatter_",
        input_gen_fn=_gen_masked_scatter_)

    reg(torch.histc, _histc_anno, name="torch.histc", aliases=(T.histc,), input_gen_fn=_gen_histc)
    reg(torch.bincount, _bincount_anno, name="torch.bincount", aliases=(T.bincount,),
        input_gen_fn=_gen_bincount)
    reg(torch.searchsorted, _searchsorted_anno, name="torch.searchsorted", input_gen_fn=_gen_searchsorted)
    reg(torch.bucketize, _bucketize_anno, name="torch.bucketize", input_gen_fn=_gen_bucketize)
    reg(torch.nonzero, _nonzero_anno, name="torch.nonzero", aliases=(T.nonzero,), input_gen_fn=_gen_nonzero)
    reg(torch.argwhere, _argwhere_anno, name="torch.argwhere", aliases=(T.argwhere,),
        input_gen_fn=_gen_argwhere)
