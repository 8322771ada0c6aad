"""``x[key]``, ``x[key] = v`` and index_put.

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
`setitem`, which performs the assignment and returns the mutated tensor, so that the
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

from nnscaler.errors import NNScalerError
from nnscaler.ops.builtin._common import (
    SPLITTABLE_SIZES,
    idents,
    is_tensor,
    join_anno,
    rand_shape,
    randbool,
    randint,
    randn,
    shape_of,
    tensor_str,
)
from nnscaler.ops.builtin.indexing.common import (
    Call,
    frozen_dims,
    rand_tensor,
    small_shape,
)
from nnscaler.ops.registry import OpRegistry


class _Unsupported(NNScalerError, ValueError):
    """A key whose result the plan does not model; the caller falls back to '^' everywhere.
    (Caught in this module: it never reaches the user.)"""


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


class KeyPlan:
    """``self[key]``: annotation of ``self``'s dims and of the result's dims (with sizes)."""

    def __init__(self, x: torch.Tensor, key: Any) -> None:
        shape = shape_of(x)
        self.names = idents(len(shape))
        self.self_dims = frozen_dims(self.names)
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
                adv_shapes.append(shape_of(item))
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
        vshape = shape_of(value)
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
    out = shape_of(self[key])
    return join_anno([frozen_dims(idents(self.dim())), "?"], [[str(s) for s in out]])


def _getitem_anno(self: torch.Tensor, key: Any) -> str:
    if _is_index_tensor(key) and key.dim() > 0:
        names = idents(self.dim() + key.dim())
        mine, theirs = names[:self.dim()], names[self.dim():]
        return join_anno([[mine[0] + "^"] + mine[1:], theirs], [theirs + mine[1:]])
    try:
        plan = KeyPlan(self, key)
    except _Unsupported:
        return _fallback_getitem(self, key)
    if _is_mask(key) and key.dim() > 0:
        key_anno = tensor_str(plan.self_dims[:key.dim()])
    else:
        key_anno = "?"
    return join_anno([plan.self_dims, key_anno], [plan.out_dims])


def setitem(self: torch.Tensor, key: Any, value: Any) -> torch.Tensor:
    """``self[key] = value``, returning the mutated ``self`` (the op's output)."""
    self[key] = value
    return self


def _setitem_anno(self: torch.Tensor, key: Any, value: Any) -> str:
    try:
        plan = KeyPlan(self, key)
    except _Unsupported:
        frozen = frozen_dims(idents(self.dim()))
        value_anno = "?" if not is_tensor(value) or value.dim() == 0 else tensor_str(
            [str(s) for s in value.shape])
        return join_anno([frozen, "?", value_anno], [frozen])
    return join_anno([plan.self_dims, "?", plan.value_dims(value)], [plan.self_dims])


def _index_put_key(indices: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(slice(None) if i is None else i for i in indices)


def _index_put_anno(
    input: torch.Tensor, indices: Sequence[Any], values: Any, accumulate: bool = False
) -> str:
    return _setitem_anno(input, _index_put_key(indices), values)


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
    x = rand_tensor(rng, small_shape(rng, 1, 4))
    r = rng.random()
    if r < 0.2:
        return (x, randint(rng, -x.shape[0], x.shape[0], *rand_shape(rng, 1, 2, sizes=(1, 2, 4)))), {}
    if r < 0.3:
        m = rng.randint(1, x.dim())
        return (x, randbool(rng, *x.shape[:m])), {}
    return (x, _rand_key(rng, x.shape)), {}


def _result_shape(x: torch.Tensor, key: Any) -> tuple[int, ...]:
    return shape_of(x[key])


def _gen_setitem(rng: random.Random) -> Call:
    x = rand_tensor(rng, small_shape(rng, 1, 4))
    r = rng.random()
    if r < 0.15:  # inv_perm[perm] = arange(...) (Mixtral)
        x = rand_tensor(rng, (rng.choice(SPLITTABLE_SIZES),))
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
    return (x, key, rand_tensor(rng, vshape)), {}


def _gen_index_put(rng: random.Random) -> Call:
    x = rand_tensor(rng, small_shape(rng, 1, 3))
    m = rng.randint(1, x.dim())
    accumulate = rng.random() < 0.5
    if rng.random() < 0.3:
        mask = randbool(rng, *x.shape[:m])
        vals = rand_tensor(rng, (1,) + x.shape[m:])
        return (x, (mask,), vals), {"accumulate": accumulate}
    n = rng.choice((1, 2, 3))
    if accumulate:
        idx = tuple(randint(rng, 0, x.shape[k], n) for k in range(m))
    else:  # distinct positions: assignment order of duplicates is unspecified
        flat = torch.randperm(math.prod(x.shape[:m]), generator=torch.Generator().manual_seed(rng.getrandbits(32)))
        pos = flat[:n]
        idx = tuple(torch.unravel_index(pos, x.shape[:m]))
        n = len(pos)
    return (x, idx, rand_tensor(rng, (len(idx[0]),) + x.shape[m:])), {"accumulate": accumulate}


def register(registry: OpRegistry) -> None:
    """Register the subscript ops (``x[key]``, ``x[key] = v``, index_put)."""
    T = torch.Tensor
    reg = registry.register

    reg(T.__getitem__, _getitem_anno, name="torch.Tensor.__getitem__", input_gen_fn=_gen_getitem)
    reg(setitem, _setitem_anno, name="torch.Tensor.__setitem__", aliases=(T.__setitem__,),
        input_gen_fn=_gen_setitem)
    reg(torch.index_put, _index_put_anno, name="torch.index_put", aliases=(T.index_put,),
        input_gen_fn=_gen_index_put)
    reg(T.index_put_, _index_put_anno, name="torch.Tensor.index_put_", aliases=(torch.index_put_,),
        input_gen_fn=_gen_index_put)
