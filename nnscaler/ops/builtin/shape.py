"""Shape ops: view/reshape, transposes, split/cat, expand/repeat, squeeze, flips, ...

How the annotations are built:

- **view / reshape** relate input and output dims segment by segment: walking both shapes
  (size-1 dims left out: they are the number ``1`` on either side) gives the shortest runs of
  input dims and output dims with equal products. A run of one input dim and one output dim
  keeps its identifier. In a longer run only the *leading* dims can be split, and only by
  the divisors of ``g = gcd(first input dim, first output dim)``: the leading input dim is
  ``(a n)`` with ``n`` its size over ``g`` (or just ``a`` when ``g`` is its size), the
  leading output dim likewise; the other input dims of the run are ``^`` and the other
  output dims are numbers. ``x.view(b, s, 8, 64)`` on ``(b, s, 512)`` gives
  ``a b (c 64) -> a b c 64`` (``c``, the heads, may be split), a merge gives
  ``a b c d^ -> a b (c 64)``, and a view that reshuffles ``(6, 4) -> (4, 6)`` gives
  ``(a 3) b^ -> (a 2) 6``. Size arguments are rewritten per part by ``update_kwargs``
  (the split output dim is divided by the number of parts; ``-1`` stays ``-1``).
- **Lists of tensors** (``cat``, ``stack``, ...): the calling convention gives one
  annotation entry per parameter, and a list is one parameter. These ops are registered
  with a :class:`TensorListSignature` that binds ``torch.cat([x, y], dim=1)`` as
  ``cat(x, y, dim=1)``: one annotated input per element. The op's ``fn`` is then a small
  function of this module taking the tensors as separate arguments (``cat(*tensors,
  dim=0)``); ``torch.cat`` and its spellings are aliases that the tracer looks up.
- Dims whose output size is not a share of an input dim (split outputs, expanded and
  repeated dims, new dims) are numbers; the input dim they come from is ``^``.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nnscaler.anno import Split
from nnscaler.ops.builtin._common import (
    SPLITTABLE_SIZES,
    idents,
    is_tensor,
    norm_dim,
    rand_shape,
    randn,
    tensor_str,
)
from nnscaler.ops.registry import OpRegistry

__all__ = [
    "TensorListSignature",
    "cat",
    "hstack",
    "register",
    "reshape_dims",
    "stack",
    "vstack",
]


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def _anno(inputs: Sequence[Sequence[str] | str], outputs: Sequence[Sequence[str] | str]) -> str:
    """Join per-tensor dim lists (or ready strings such as ``'?'``) into an annotation."""

    def one(t: Sequence[str] | str) -> str:
        return t if isinstance(t, str) else tensor_str(t)

    return f"{', '.join(map(one, inputs))} -> {', '.join(map(one, outputs))}"


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _sizes_arg(size: Sequence[Any]) -> tuple[Any, ...]:
    """A var-positional size argument (``view(2, 3)`` or ``view((2, 3))``) as one tuple."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        return tuple(size[0])
    return tuple(size)


def _dims_arg(dims: Any) -> tuple[int, ...]:
    """An int-or-sequence dims argument as a tuple."""
    if dims is None:
        return ()
    if isinstance(dims, (tuple, list, torch.Size)):
        return tuple(int(d) for d in dims)
    return (int(dims),)


def _infer_shape(numel: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """``sizes`` with its one ``-1`` resolved for ``numel`` elements."""
    sizes = [int(s) for s in sizes]
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = numel // known if known else 0
    return tuple(sizes)


def _out_split_dim(transform: Any, k: int = 0) -> int | None:
    layouts = transform.outputs
    layout = layouts[k] if k < len(layouts) else None
    return layout.dim if isinstance(layout, Split) else None


def _divide_at(sizes: Sequence[Any], pos: int, num: int) -> list[Any]:
    """``sizes`` with entry ``pos`` divided by ``num`` (``-1`` stays ``-1``)."""
    out = list(sizes)
    if 0 <= pos < len(out) and int(out[pos]) != -1:
        out[pos] = int(out[pos]) // num
    return out


def _rewrap(original: Sequence[Any], values: list[Any]) -> tuple[Any, ...]:
    """``values`` in the structure of a var-positional ``original`` (flat or one sequence)."""
    if len(original) == 1 and isinstance(original[0], (tuple, list, torch.Size)):
        inner = original[0]
        return (list(values),) if isinstance(inner, list) else (tuple(values),)
    return tuple(values)


def _rewrap_seq(original: Any, values: list[Any]) -> Any:
    if isinstance(original, list):
        return list(values)
    return tuple(values)


def reshape_dims(
    in_shape: Sequence[int], out_shape: Sequence[int], names: Sequence[str] | None = None
) -> tuple[list[str], list[str]]:
    """The dim annotations of a row-major reshape from ``in_shape`` to ``out_shape``.

    See the module docstring. ``names`` are the input identifiers (default a, b, c, ...).
    """
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    names = list(names) if names is not None else idents(len(in_shape))
    ins: list[str] = [f"{n}^" for n in names]
    outs: list[str] = [str(s) for s in out_shape]
    if math.prod(in_shape) != math.prod(out_shape) or 0 in in_shape or 0 in out_shape:
        return ins, outs
    for k, s in enumerate(in_shape):
        if s == 1:
            ins[k] = "1"
    nz_in = [(k, s) for k, s in enumerate(in_shape) if s != 1]
    nz_out = [(k, s) for k, s in enumerate(out_shape) if s != 1]
    i = j = 0
    while i < len(nz_in) and j < len(nz_out):
        seg_in, seg_out = [nz_in[i]], [nz_out[j]]
        p_in, p_out = nz_in[i][1], nz_out[j][1]
        i, j = i + 1, j + 1
        while p_in != p_out:
            if p_in < p_out:
                seg_in.append(nz_in[i])
                p_in *= nz_in[i][1]
                i += 1
            else:
                seg_out.append(nz_out[j])
                p_out *= nz_out[j][1]
                j += 1
        (k0, s0), (o0, t0) = seg_in[0], seg_out[0]
        name = names[k0]
        if len(seg_in) == 1 and len(seg_out) == 1:
            ins[k0], outs[o0] = name, name
            continue
        g = math.gcd(s0, t0)
        if g == 1:
            continue  # nothing lines up: the run keeps its '^' and numbers
        ins[k0] = name if g == s0 else f"({name} {s0 // g})"
        outs[o0] = name if g == t0 else f"({name} {t0 // g})"
    return ins, outs


# ---------------------------------------------------------------------------------------
# view / reshape / flatten / unflatten
# ---------------------------------------------------------------------------------------


def _reshape_to(x: torch.Tensor, sizes: Sequence[int]) -> str:
    out_shape = _infer_shape(x.numel(), sizes)
    ins, outs = reshape_dims(_shape(x), out_shape)
    return _anno([ins], [outs])


def _view_anno(self: torch.Tensor, *size: Any) -> str:
    sizes = _sizes_arg(size)
    if len(sizes) == 1 and isinstance(sizes[0], torch.dtype):  # x.view(torch.int32)
        old, new = self.element_size(), sizes[0].itemsize
        names = idents(self.dim())
        if old == new or self.dim() == 0:
            return _anno([names], [names])
        last = self.shape[-1] * old // new
        return _anno([names[:-1] + [names[-1] + "^"]], [names[:-1] + [str(last)]])
    return _reshape_to(self, sizes)


def _update_sizes(param: str) -> Callable[..., dict[str, Any]]:
    """``update_kwargs`` for an op whose var-positional ``param`` is the output shape."""

    def update(kwargs: dict[str, Any], transform: Any, part: int) -> dict[str, Any]:
        pos = _out_split_dim(transform)
        if pos is None or param not in kwargs:
            return kwargs
        original = tuple(kwargs[param])
        sizes = _sizes_arg(original)
        if any(isinstance(s, torch.dtype) for s in sizes):
            return kwargs
        kwargs[param] = _rewrap(original, _divide_at(sizes, pos, transform.num))
        return kwargs

    return update


def _update_shape_seq(param: str) -> Callable[..., dict[str, Any]]:
    """``update_kwargs`` for an op whose plain sequence argument ``param`` is the output shape."""

    def update(kwargs: dict[str, Any], transform: Any, part: int) -> dict[str, Any]:
        pos = _out_split_dim(transform)
        if pos is None or param not in kwargs:
            return kwargs
        original = kwargs[param]
        kwargs[param] = _rewrap_seq(original, _divide_at(tuple(original), pos, transform.num))
        return kwargs

    return update


def _reshape_method_anno(self: torch.Tensor, *shape: Any) -> str:
    return _reshape_to(self, _sizes_arg(shape))


def _reshape_fn_anno(input: torch.Tensor, shape: Sequence[int]) -> str:
    return _reshape_to(input, tuple(shape))


def _as_anno(self: torch.Tensor, other: torch.Tensor) -> str:
    ins, outs = reshape_dims(_shape(self), _shape(other))
    return _anno([ins, outs], [outs])


def _flatten_anno(input: torch.Tensor, start_dim: int = 0, end_dim: int = -1) -> str:
    shape = _shape(input)
    if not shape:
        return _anno([[]], [["1"]])
    s, e = norm_dim(start_dim, len(shape)), norm_dim(end_dim, len(shape))
    out = shape[:s] + (math.prod(shape[s:e + 1]),) + shape[e + 1:]
    return _anno(*([d] for d in reshape_dims(shape, out)))


def _ravel_anno(input: torch.Tensor) -> str:
    return _flatten_anno(input)


def _unflatten_shape(shape: tuple[int, ...], dim: int, sizes: Sequence[int]) -> tuple[int, ...]:
    d = norm_dim(dim, len(shape))
    inner = _infer_shape(shape[d], sizes)
    return shape[:d] + inner + shape[d + 1:]


#: the identifier of the dim that ``unflatten`` splits up (no other identifier is spelled so)
_UNFLAT = "unflat"


def _unflatten_anno(input: torch.Tensor, dim: int, sizes: Sequence[int]) -> str:
    shape = _shape(input)
    out = _unflatten_shape(shape, dim, sizes)
    names = idents(len(shape))
    if shape:
        names[norm_dim(dim, len(shape))] = _UNFLAT
    return _anno(*([d] for d in reshape_dims(shape, out, names)))


def _unflatten_method_anno(self: torch.Tensor, dim: int, sizes: Sequence[int]) -> str:
    return _unflatten_anno(self, dim, sizes)


def _update_unflatten(kwargs: dict[str, Any], transform: Any, part: int) -> dict[str, Any]:
    """Splitting the unflattened dim (input dim ``q``) splits output dim ``p``: ``sizes[p - q]``."""
    pos = _out_split_dim(transform)
    if transform.ident != _UNFLAT or "sizes" not in kwargs or pos is None:
        return kwargs
    sizes = tuple(kwargs["sizes"])
    kwargs["sizes"] = _rewrap_seq(kwargs["sizes"], _divide_at(sizes, pos - transform.dim, transform.num))
    return kwargs


# ---------------------------------------------------------------------------------------
# transposes and permutations
# ---------------------------------------------------------------------------------------


def _perm(ndim: int, perm: Sequence[int]) -> str:
    """Output dim ``i`` is input dim ``perm[i]``."""
    names = idents(ndim)
    return _anno([names], [[names[p] for p in perm]])


def _swap(input: torch.Tensor, d0: int, d1: int) -> str:
    n = input.dim()
    perm = list(range(n))
    if n:
        a, b = norm_dim(d0, n), norm_dim(d1, n)
        perm[a], perm[b] = perm[b], perm[a]
    return _perm(n, perm)


def _transpose_anno(input: torch.Tensor, dim0: int, dim1: int) -> str:
    return _swap(input, dim0, dim1)


def _swapaxes_anno(input: torch.Tensor, axis0: int, axis1: int) -> str:
    return _swap(input, axis0, axis1)


def _swapdims_anno(input: torch.Tensor, dim0: int, dim1: int) -> str:
    return _swap(input, dim0, dim1)


def _t_anno(input: torch.Tensor) -> str:
    return _swap(input, 0, 1) if input.dim() == 2 else _perm(input.dim(), range(input.dim()))


def _reverse_anno(instance: torch.Tensor, owner: Any = None) -> str:
    n = instance.dim()
    return _perm(n, list(reversed(range(n))))


def _matrix_t_anno(instance: torch.Tensor, owner: Any = None) -> str:
    return _swap(instance, -2, -1)


def _adjoint_anno(input: torch.Tensor) -> str:
    return _swap(input, -2, -1)


def _permute_fn_anno(input: torch.Tensor, dims: Sequence[int]) -> str:
    n = input.dim()
    return _perm(n, [norm_dim(d, n) for d in dims])


def _permute_method_anno(self: torch.Tensor, *dims: Any) -> str:
    return _permute_fn_anno(self, _sizes_arg(dims))


def _movedim_anno(input: torch.Tensor, source: Any, destination: Any) -> str:
    n = input.dim()
    src = [norm_dim(d, n) for d in _dims_arg(source)]
    dst = [norm_dim(d, n) for d in _dims_arg(destination)]
    order: list[int | None] = [None] * n
    for s, d in zip(src, dst, strict=True):
        order[d] = s
    rest = iter(k for k in range(n) if k not in src)
    perm = [o if o is not None else next(rest) for o in order]
    return _perm(n, perm)


# ---------------------------------------------------------------------------------------
# split / chunk / unbind / tensor_split
# ---------------------------------------------------------------------------------------


def _pieces(input: torch.Tensor, dim: int, sizes: Sequence[int], keep: bool = True) -> str:
    """Input split along ``dim`` into pieces of ``sizes`` (dim dropped when not ``keep``)."""
    n = input.dim()
    d = norm_dim(dim, n)
    names = idents(n)
    ins = list(names)
    ins[d] += "^"
    outs = []
    for s in sizes:
        dims = list(names)
        if keep:
            dims[d] = str(s)
        else:
            del dims[d]
        outs.append(dims)
    return _anno([ins], outs)


def _split_sizes(length: int, split: Any) -> list[int]:
    if isinstance(split, (list, tuple, torch.Size)):
        return [int(s) for s in split]
    step = int(split)
    if length == 0:
        return [0]
    return [min(step, length - start) for start in range(0, length, step)]


def _split_fn_anno(tensor: torch.Tensor, split_size_or_sections: Any, dim: int = 0) -> str:
    d = norm_dim(dim, tensor.dim())
    return _pieces(tensor, d, _split_sizes(tensor.shape[d], split_size_or_sections))


def _split_method_anno(self: torch.Tensor, split_size: Any, dim: int = 0) -> str:
    return _split_fn_anno(self, split_size, dim)


def _chunk_anno(input: torch.Tensor, chunks: int, dim: int = 0) -> str:
    d = norm_dim(dim, input.dim())
    length = input.shape[d]
    step = -(-length // int(chunks)) if length else 0
    sizes = _split_sizes(length, step) if step else [0] * int(chunks)
    return _pieces(input, d, sizes)


def _unbind_anno(input: torch.Tensor, dim: int = 0) -> str:
    d = norm_dim(dim, input.dim())
    return _pieces(input, d, [1] * input.shape[d], keep=False)


def _tensor_split_anno(input: torch.Tensor, indices_or_sections: Any, dim: int = 0) -> str:
    d = norm_dim(dim, input.dim())
    length = input.shape[d]
    ios = indices_or_sections
    if is_tensor(ios):
        ios = int(ios) if ios.dim() == 0 else [int(v) for v in ios.tolist()]
    if isinstance(ios, int):
        q, r = divmod(length, ios)
        sizes = [q + 1] * r + [q] * (ios - r)
    else:
        bounds = [0] + [min(max(int(i) if i >= 0 else int(i) + length, 0), length) for i in ios] + [length]
        sizes = [max(b - a, 0) for a, b in zip(bounds, bounds[1:], strict=False)]
    return _pieces(input, d, sizes)


# ---------------------------------------------------------------------------------------
# lists of tensors: cat / stack / hstack / vstack
# ---------------------------------------------------------------------------------------


class TensorListSignature(inspect.Signature):
    """Binds ``f(tensors, <rest>)`` as ``f(t0, t1, ..., <rest>)``.

    The registry's calling convention annotates the first parameters of a signature, one
    entry each; a list of tensors is one parameter. This signature's parameters are
    ``t0 ... t{max_len-1}`` (positional-only) followed by the rest of the op's parameters
    (keyword-only), and its :meth:`bind` spreads the list over them, so that the
    annotation can have one entry per tensor of the list. The op's ``fn`` takes the
    tensors as separate arguments.
    """

    __slots__ = ("_call", "_list_param")

    def __init__(self, call_signature: inspect.Signature, list_param: str, max_len: int = 1024):
        P = inspect.Parameter
        params = [P(f"t{i}", P.POSITIONAL_ONLY, default=None) for i in range(max_len)]
        params += [
            p.replace(kind=P.KEYWORD_ONLY)
            for p in call_signature.parameters.values()
            if p.name != list_param
        ]
        super().__init__(params)
        self._call = call_signature
        self._list_param = list_param

    def bind(self, *args: Any, **kwargs: Any) -> inspect.BoundArguments:  # type: ignore[override]
        bound = self._call.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        tensors = arguments.pop(self._list_param)
        if is_tensor(tensors) or not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{self._list_param} must be a list or tuple of tensors")
        n_max = sum(p.kind is p.POSITIONAL_ONLY for p in self.parameters.values())
        if len(tensors) > n_max:
            raise TypeError(f"at most {n_max} tensors are supported, got {len(tensors)}")
        spread: dict[str, Any] = {f"t{i}": t for i, t in enumerate(tensors)}
        spread.update(arguments)
        return inspect.BoundArguments(self, spread)  # type: ignore[arg-type]


def _tensors_and(args: tuple[Any, ...], kwargs: Mapping[str, Any], param: str) -> tuple[list[Any], Any]:
    """The tensor list of a list-op annotation call, in list form or spread form."""
    if param in kwargs:
        return list(kwargs[param]), args
    if args and isinstance(args[0], (list, tuple)):
        return list(args[0]), args[1:]
    tensors = [a for a in args if is_tensor(a)]
    return tensors, args[len(tensors):]


def _cat_dims(tensors: Sequence[Any], dim: int) -> str:
    shaped = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0)]  # legacy empties
    n = max(t.dim() for t in shaped) if shaped else 1
    d = norm_dim(dim, n)
    names = idents(n + len(tensors))
    base, extra = names[:n], names[n:]
    ins: list[Any] = []
    total = 0
    for k, t in enumerate(tensors):
        if t.dim() == 1 and t.shape[0] == 0 and n != 1:
            ins.append("?")
            continue
        dims = list(base)
        dims[d] = extra[k] + "^"
        total += t.shape[d]
        ins.append(dims)
    out = list(base)
    out[d] = str(total)
    return _anno(ins, [out])


def _cat_anno(*args: Any, **kwargs: Any) -> str:
    tensors, rest = _tensors_and(args, kwargs, "tensors")
    dim = kwargs.get("dim", rest[0] if rest else 0)
    return _cat_dims(tensors, dim)


def _stack_anno(*args: Any, **kwargs: Any) -> str:
    tensors, rest = _tensors_and(args, kwargs, "tensors")
    dim = kwargs.get("dim", rest[0] if rest else 0)
    n = tensors[0].dim()
    d = norm_dim(dim, n + 1)
    names = idents(n)
    out = names[:d] + [str(len(tensors))] + names[d:]
    return _anno([names] * len(tensors), [out])


def _hstack_anno(*args: Any, **kwargs: Any) -> str:
    tensors, _ = _tensors_and(args, kwargs, "tensors")
    tensors = [t.reshape(1) if t.dim() == 0 else t for t in tensors]
    if all(t.dim() == 1 for t in tensors):
        return _cat_dims(tensors, 0)
    return _cat_dims(tensors, 1)


def _vstack_anno(*args: Any, **kwargs: Any) -> str:
    tensors, _ = _tensors_and(args, kwargs, "tensors")
    n = max(2, max(t.dim() for t in tensors))
    names = idents(n + len(tensors))
    base, extra = names[:n], names[n:]
    ins: list[Any] = []
    total = 0
    for k, t in enumerate(tensors):
        if t.dim() <= 1:
            ins.append(base[1:2] if t.dim() == 1 else [])
            total += 1
        else:
            ins.append([extra[k] + "^"] + base[1:])
            total += t.shape[0]
    return _anno(ins, [[str(total)] + base[1:]])


def cat(*tensors: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``torch.cat`` with the tensors as separate arguments (the op's calling convention)."""
    return torch.cat(tensors, dim=dim)


def stack(*tensors: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``torch.stack`` with the tensors as separate arguments."""
    return torch.stack(tensors, dim=dim)


def hstack(*tensors: torch.Tensor) -> torch.Tensor:
    """``torch.hstack`` with the tensors as separate arguments."""
    return torch.hstack(tensors)


def vstack(*tensors: torch.Tensor) -> torch.Tensor:
    """``torch.vstack`` with the tensors as separate arguments."""
    return torch.vstack(tensors)


def _list_signature(param: str, *rest: inspect.Parameter) -> TensorListSignature:
    P = inspect.Parameter
    call = inspect.Signature([P(param, P.POSITIONAL_OR_KEYWORD), *rest])
    return TensorListSignature(call, param)


# ---------------------------------------------------------------------------------------
# expand / repeat / tile / repeat_interleave
# ---------------------------------------------------------------------------------------


def _expand_to(input: torch.Tensor, sizes: Sequence[int]) -> str:
    shape = _shape(input)
    names = idents(len(shape))
    lead = len(sizes) - len(shape)
    ins, outs = list(names), [str(int(s)) for s in sizes[:lead]]
    for k, (s, t) in enumerate(zip(shape, sizes[lead:], strict=True)):
        t = int(t)
        if t == -1 or t == s:
            outs.append(names[k])
        else:  # s == 1 expanded to t
            ins[k] = "1"
            outs.append(str(t))
    return _anno([ins], [outs])


def _expand_anno(self: torch.Tensor, *sizes: Any) -> str:
    return _expand_to(self, _sizes_arg(sizes))


def _broadcast_to_anno(input: torch.Tensor, size: Sequence[int]) -> str:
    return _expand_to(input, tuple(size))


def _expand_as_anno(self: torch.Tensor, other: torch.Tensor) -> str:
    shape, target = _shape(self), _shape(other)
    names = idents(len(target))
    lead = len(target) - len(shape)
    ins = [names[lead + k] if s == target[lead + k] else "1" for k, s in enumerate(shape)]
    return _anno([ins, names], [names])


def _repeat_to(input: torch.Tensor, reps: Sequence[int]) -> str:
    shape = _shape(input)
    reps = [int(r) for r in reps]
    if len(reps) < len(shape):  # tile pads the repeats with ones
        reps = [1] * (len(shape) - len(reps)) + reps
    names = idents(len(shape))
    lead = len(reps) - len(shape)
    ins, outs = list(names), [str(r) for r in reps[:lead]]
    for k, (s, r) in enumerate(zip(shape, reps[lead:], strict=True)):
        if r == 1:
            outs.append(names[k])
        else:
            ins[k] = names[k] + "^"
            outs.append(str(s * r))
    return _anno([ins], [outs])


def _repeat_anno(self: torch.Tensor, *sizes: Any) -> str:
    return _repeat_to(self, _sizes_arg(sizes))


def _tile_fn_anno(input: torch.Tensor, dims: Sequence[int]) -> str:
    return _repeat_to(input, tuple(dims))


def _tile_method_anno(self: torch.Tensor, *dims: Any) -> str:
    return _repeat_to(self, _sizes_arg(dims))


#: the identifier of the dim that ``repeat_interleave(dim=...)`` repeats
_REPEATED = "rep"


def _repeat_interleave_anno(
    input: torch.Tensor, repeats: Any = None, dim: int | None = None, *, output_size: int | None = None
) -> str:
    shape = _shape(input)
    names = idents(len(shape))
    if repeats is None:  # torch.repeat_interleave(repeats): indices repeated
        total = int(input.sum()) if input.numel() else 0
        return _anno([[n + "^" for n in names]], [[str(total)]])
    r: int | None = None
    if is_tensor(repeats):
        if repeats.numel() == 1 and repeats.device.type != "meta":
            r = int(repeats.reshape(()))
        total = int(output_size) if output_size is not None else int(repeats.sum())
    else:
        r = int(repeats)
    if dim is None:
        numel = math.prod(shape)
        if r is None:
            return _anno([[n + "^" for n in names], "?"], [[str(total)]])
        if not shape or r == 0:
            return _anno([[n + "^" for n in names], "?"], [[str(numel * r)]])
        ins = [names[0]] + [n + "^" for n in names[1:]]
        members = [names[0]] + [n + "^" for n in names[1:]] + ([str(r)] if r != 1 else [])
        out = members[0] if len(members) == 1 else f"({' '.join(members)})"
        return _anno([ins, "?"], [[out]])
    d = norm_dim(dim, len(shape))
    names[d] = _REPEATED
    ins, outs = list(names), list(names)
    if r is None:
        ins[d] += "^"
        outs[d] = str(total)
    elif r == 0:
        ins[d] += "^"
        outs[d] = "0"
    elif r != 1:
        outs[d] = f"({names[d]} {r})"
    return _anno([ins, "?"], [outs])


def _update_output_size(kwargs: dict[str, Any], transform: Any, part: int) -> dict[str, Any]:
    """``output_size`` is the size of the repeated dim (of the output without ``dim``)."""
    if kwargs.get("output_size") is None or _out_split_dim(transform) is None:
        return kwargs
    if kwargs.get("dim") is None or transform.ident == _REPEATED:
        kwargs["output_size"] = int(kwargs["output_size"]) // transform.num
    return kwargs


# ---------------------------------------------------------------------------------------
# squeeze / unsqueeze
# ---------------------------------------------------------------------------------------


def _squeeze_anno(input: torch.Tensor, dim: Any = None) -> str:
    shape = _shape(input)
    names = idents(len(shape))
    # A part whose share of a dim is 1 would lose that dim too, so the dims that squeeze
    # looks at but keeps (all of them without ``dim``) are '^'.
    if dim is None:
        looked = set(range(len(shape)))
    else:
        looked = {norm_dim(d, len(shape)) for d in _dims_arg(dim)} if shape else set()
    drop = {k for k in looked if shape[k] == 1}
    dims = [n + "^" if k in looked else n for k, n in enumerate(names)]
    ins = ["1" if k in drop else d for k, d in enumerate(dims)]
    outs = [d for k, d in enumerate(dims) if k not in drop]
    return _anno([ins], [outs])


def _unsqueeze_anno(input: torch.Tensor, dim: int) -> str:
    names = idents(input.dim())
    d = dim if dim >= 0 else dim + input.dim() + 1
    return _anno([names], [names[:d] + ["1"] + names[d:]])


# ---------------------------------------------------------------------------------------
# narrow / select / roll / flip / unfold / diagonal
# ---------------------------------------------------------------------------------------


def _narrow_anno(input: torch.Tensor, dim: int, start: Any, length: int) -> str:
    names = idents(input.dim())
    d = norm_dim(dim, input.dim())
    ins, outs = list(names), list(names)
    ins[d] += "^"
    outs[d] = str(int(length))
    return _anno([ins], [outs])


def _select_anno(input: torch.Tensor, dim: int, index: Any) -> str:
    names = idents(input.dim())
    d = norm_dim(dim, input.dim())
    ins = list(names)
    ins[d] += "^"
    return _anno([ins], [names[:d] + names[d + 1:]])


def _frozen_dims(input: torch.Tensor, dims: Sequence[int]) -> str:
    names = idents(input.dim())
    frozen = {norm_dim(d, input.dim()) for d in dims}
    dims_ = [n + "^" if k in frozen else n for k, n in enumerate(names)]
    return _anno([dims_], [dims_])


def _roll_anno(input: torch.Tensor, shifts: Any, dims: Any = None) -> str:
    if dims is None or _dims_arg(dims) == ():
        return _frozen_dims(input, range(input.dim()))  # rolls the flattened tensor
    return _frozen_dims(input, _dims_arg(dims))


def _flip_fn_anno(input: torch.Tensor, dims: Any) -> str:
    return _frozen_dims(input, _dims_arg(dims))


def _flip_method_anno(self: torch.Tensor, *dims: Any) -> str:
    return _frozen_dims(self, _sizes_arg(dims))


def _fliplr_anno(input: torch.Tensor) -> str:
    return _frozen_dims(input, [1])


def _flipud_anno(input: torch.Tensor) -> str:
    return _frozen_dims(input, [0])


def _unfold_anno(self: torch.Tensor, dimension: int, size: int, step: int) -> str:
    n = self.dim()
    names = idents(n)
    if n == 0:
        return _anno([[]], [[str(size)]])
    d = norm_dim(dimension, n)
    ins, outs = list(names), list(names)
    ins[d] += "^"
    outs[d] = str((self.shape[d] - size) // step + 1)
    return _anno([ins], [outs + [str(size)]])


def _diagonal_anno(input: torch.Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1) -> str:
    n = input.dim()
    names = idents(n)
    a, b = norm_dim(dim1, n), norm_dim(dim2, n)
    ins = [x + "^" if k in (a, b) else x for k, x in enumerate(names)]
    length = torch.empty(_shape(input), device="meta").diagonal(offset, a, b).shape[-1]
    outs = [x for k, x in enumerate(names) if k not in (a, b)] + [str(length)]
    return _anno([ins], [outs])


# ---------------------------------------------------------------------------------------
# input generators
# ---------------------------------------------------------------------------------------


def _t(rng: random.Random, shape: Sequence[int]) -> torch.Tensor:
    if not shape:
        return randn(rng, 1).reshape(())
    return randn(rng, *shape)


def _sshape(rng: random.Random, lo: int = 1, hi: int = 4) -> tuple[int, ...]:
    shape = list(rand_shape(rng, lo, hi, sizes=SPLITTABLE_SIZES + (1, 3)))
    while math.prod(shape) > 1000:  # small tensors keep the promise test fast
        k = shape.index(max(shape))
        shape[k] = rng.choice((2, 4, 6))
    return tuple(shape)


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def _random_reshape(rng: random.Random, shape: Sequence[int]) -> list[int]:
    """A random target shape with the same number of elements (merges, splits, shuffles)."""
    factors = [f for s in shape for f in _prime_factors(s)]
    if rng.random() < 0.2:
        rng.shuffle(factors)
    out: list[int] = []
    k = 0
    while k < len(factors):
        take = rng.randint(1, 3)
        out.append(math.prod(factors[k:k + take]))
        k += take
    if rng.random() < 0.3:
        out.insert(rng.randint(0, len(out)), 1)
    if not out:
        out = [1]
    if rng.random() < 0.4:
        out[rng.randrange(len(out))] = -1
    return out


def _gen_view(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _t(rng, _sshape(rng, 1, 4))
    if rng.random() < 0.1:
        return (x, torch.int32 if rng.random() < 0.5 else torch.float32), {}
    target = _random_reshape(rng, x.shape)
    if rng.random() < 0.3:
        return (x, tuple(target)), {}
    return (x, *target), {}


def _gen_reshape_method(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _t(rng, _sshape(rng, 1, 4))
    if rng.random() < 0.3:
        x = x.transpose(0, -1)  # reshape copes with non-contiguous tensors
    target = _random_reshape(rng, x.shape)
    if rng.random() < 0.3:
        return (x, torch.Size(target) if -1 not in target else tuple(target)), {}
    return (x, *target), {}


def _gen_reshape_fn(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _t(rng, _sshape(rng, 1, 4))
    target = _random_reshape(rng, x.shape)
    if rng.random() < 0.5:
        return (x,), {"shape": target}
    return (x, tuple(target)), {}


def _gen_as(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _t(rng, _sshape(rng, 1, 4))
    target = _infer_shape(x.numel(), _random_reshape(rng, x.shape))
    return (x, _t(rng, target)), {}


def _gen_flatten(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _t(rng, _sshape(rng, 0 if rng.random() < 0.1 else 1, 4))
    n = max(x.dim(), 1)
    kw: dict[str, Any] = {}
    if rng.random() < 0.7:
        s = rng.randrange(n)
        e = rng.randrange(s, n)
        kw["start_dim"] = s - n if rng.random() < 0.3 else s
        kw["end_dim"] = e - n if rng.random() < 0.5 else e
    return (x,), kw


def _gen_ravel(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_t(rng, _sshape(rng, 1, 4)),), {}


def _gen_unflatten(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    shape = _sshape(rng, 1, 3)
    x = _t(rng, shape)
    d = rng.randrange(len(shape))
    sizes = [s for s in _random_reshape(rng, [shape[d]])]
    dim = d - len(shape) if rng.random() < 0.3 else d
    return (x, dim, tuple(sizes) if rng.random() < 0.5 else sizes), {}


def _gen_ndim(rng: random.Random, lo: int = 1, hi: int = 4) -> torch.Tensor:
    return _t(rng, _sshape(rng, lo, hi))


def _rdim(rng: random.Random, n: int) -> int:
    d = rng.randrange(n)
    return d - n if rng.random() < 0.3 else d


def _gen_transpose(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 4)
    return (x, _rdim(rng, x.dim()), _rdim(rng, x.dim())), {}


def _gen_t(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_gen_ndim(rng, 1, 2),), {}


def _gen_2d(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_gen_ndim(rng, 2, 2),), {}


def _gen_matrices(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (_gen_ndim(rng, 2, 4),), {}


def _rand_perm(rng: random.Random, n: int) -> list[int]:
    perm = list(range(n))
    rng.shuffle(perm)
    return [p - n if rng.random() < 0.2 else p for p in perm]


def _gen_permute_fn(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 4)
    return (x, tuple(_rand_perm(rng, x.dim()))), {}


def _gen_permute_method(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 4)
    perm = _rand_perm(rng, x.dim())
    return ((x, perm) if rng.random() < 0.3 else (x, *perm)), {}


def _gen_movedim(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 4)
    n = x.dim()
    k = rng.randint(1, n)
    src = rng.sample(range(n), k)
    dst = rng.sample(range(n), k)
    if k == 1 and rng.random() < 0.5:
        return (x, src[0], dst[0] - n), {}
    return (x, tuple(src), tuple(dst)), {}


def _gen_split_fn(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 3)
    d = rng.randrange(x.dim())
    length = x.shape[d]
    if rng.random() < 0.5:
        arg: Any = rng.randint(1, length)
    else:
        cuts = sorted(rng.sample(range(1, length + 1), rng.randint(0, min(2, length - 1))) + [length])
        arg = [b - a for a, b in zip([0] + cuts, cuts, strict=False) if b > a]
    dim = d - x.dim() if rng.random() < 0.3 else d
    return (x, arg), {"dim": dim}


def _gen_split_method(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (x, arg), kw = _gen_split_fn(rng)
    return (x, arg, kw["dim"]), {}


def _gen_chunk(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 3)
    d = rng.randrange(x.dim())
    chunks = rng.randint(1, x.shape[d] + 1)
    if rng.random() < 0.5:
        return (x, chunks), {"dim": d - x.dim() if rng.random() < 0.5 else d}
    return (x, chunks, d), {}


def _gen_unbind(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _t(rng, rand_shape(rng, 1, 3, sizes=(1, 2, 3, 4)))
    return (x, _rdim(rng, x.dim())), {}


def _gen_tensor_split(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 3)
    d = rng.randrange(x.dim())
    if rng.random() < 0.5:
        ios: Any = rng.randint(1, x.shape[d] + 1)
    else:
        ios = sorted(rng.randint(0, x.shape[d]) for _ in range(rng.randint(1, 3)))
    return (x, ios), {"dim": d}


def _gen_cat(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    shape = list(_sshape(rng, 1, 3))
    d = rng.randrange(len(shape))
    tensors = []
    for _ in range(rng.randint(1, 3)):
        shape[d] = rng.choice((1, 2, 3, 4))
        tensors.append(_t(rng, shape))
    seq = tensors if rng.random() < 0.5 else tuple(tensors)
    dim = d - len(shape) if rng.random() < 0.3 else d
    if rng.random() < 0.5:
        return (seq,), {"dim": dim}
    return (seq, dim), {}


def _gen_stack(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    shape = _sshape(rng, 1, 3)
    tensors = [_t(rng, shape) for _ in range(rng.randint(1, 3))]
    d = rng.randrange(len(shape) + 1)
    return (tensors,), {"dim": d}


def _gen_hstack(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    shape = list(_sshape(rng, 1, 3))
    tensors = []
    for _ in range(rng.randint(1, 3)):
        if len(shape) == 1:
            shape[0] = rng.choice((1, 2, 3))
        else:
            shape[1] = rng.choice((1, 2, 3))
        tensors.append(_t(rng, shape))
    return (tensors,), {}


def _gen_vstack(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    shape = list(_sshape(rng, 1, 3))
    tensors = []
    for _ in range(rng.randint(1, 3)):
        if len(shape) == 1:
            tensors.append(_t(rng, shape) if rng.random() < 0.5 else _t(rng, [rng.choice((1, 2)), shape[0]]))
        else:
            shape[0] = rng.choice((1, 2, 3))
            tensors.append(_t(rng, shape))
    return (tensors,), {}


def _expand_target(rng: random.Random, shape: Sequence[int]) -> list[int]:
    target = [rng.choice((1, 2, 3)) for _ in range(rng.randint(0, 2))]
    for s in shape:
        if s == 1 and rng.random() < 0.7:
            target.append(rng.choice((2, 3, 4)))
        else:
            target.append(-1 if rng.random() < 0.4 else s)
    return target


def _shape_with_ones(rng: random.Random) -> tuple[int, ...]:
    return tuple(1 if rng.random() < 0.4 else s for s in _sshape(rng, 1, 3))


def _gen_expand(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _t(rng, _shape_with_ones(rng))
    target = _expand_target(rng, x.shape)
    return ((x, tuple(target)) if rng.random() < 0.3 else (x, *target)), {}


def _gen_broadcast_to(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _t(rng, _shape_with_ones(rng))
    return (x, tuple(_expand_target(rng, x.shape))), {}


def _gen_expand_as(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _t(rng, _shape_with_ones(rng))
    out = [rng.choice((2, 3)) for _ in range(rng.randint(0, 2))]
    out += [rng.choice((2, 4)) if s == 1 and rng.random() < 0.7 else s for s in x.shape]
    return (x, _t(rng, out)), {}


def _gen_repeat(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 3)
    reps = [rng.choice((1, 2)) for _ in range(rng.randint(0, 1))]
    reps += [1 if rng.random() < 0.6 else rng.choice((2, 3)) for _ in range(x.dim())]
    return ((x, tuple(reps)) if rng.random() < 0.3 else (x, *reps)), {}


def _gen_tile_fn(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 3)
    reps = [1 if rng.random() < 0.6 else rng.choice((2, 3)) for _ in range(rng.randint(1, x.dim() + 1))]
    return (x, tuple(reps)), {}


def _gen_tile_method(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (x, reps), _ = _gen_tile_fn(rng)
    return (x, *reps), {}


def _gen_repeat_interleave(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 3)
    kind = rng.random()
    kw: dict[str, Any] = {}
    if kind < 0.5:
        reps: Any = rng.choice((1, 2, 3))
        if rng.random() < 0.3:
            reps = torch.tensor(reps)
    else:
        d = rng.randrange(x.dim())
        reps = torch.randint(0, 3, (x.shape[d],), generator=torch.Generator().manual_seed(rng.getrandbits(32)))
        kw["dim"] = d
    if "dim" not in kw and rng.random() < 0.7:
        kw["dim"] = _rdim(rng, x.dim())
    if isinstance(reps, int) and rng.random() < 0.3:
        kw["output_size"] = (x.shape[kw["dim"]] if "dim" in kw else x.numel()) * reps
    return (x, reps), kw


def _gen_squeeze(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _t(rng, _shape_with_ones(rng))
    r = rng.random()
    if r < 0.3:
        return (x,), {}
    if r < 0.7:
        return (x, _rdim(rng, x.dim())), {}
    return (x, tuple(rng.sample(range(x.dim()), rng.randint(1, x.dim())))), {}


def _gen_unsqueeze(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 0 if rng.random() < 0.1 else 1, 3)
    n = x.dim() + 1
    return (x, rng.randrange(-n, n)), {}


def _gen_narrow(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 3)
    d = rng.randrange(x.dim())
    start = rng.randrange(x.shape[d])
    length = rng.randint(0, x.shape[d] - start)
    return (x, d - x.dim() if rng.random() < 0.3 else d, start, length), {}


def _gen_select(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 3)
    d = rng.randrange(x.dim())
    return (x, d - x.dim() if rng.random() < 0.3 else d, rng.randrange(-x.shape[d], x.shape[d])), {}


def _gen_roll(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 3)
    if rng.random() < 0.3:
        return (x, rng.randint(-3, 3)), {}
    dims = rng.sample(range(x.dim()), rng.randint(1, x.dim()))
    shifts = [rng.randint(-3, 3) for _ in dims]
    if len(dims) == 1 and rng.random() < 0.5:
        return (x, shifts[0], dims[0]), {}
    return (x, tuple(shifts), tuple(dims)), {}


def _gen_flip_fn(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 3)
    return (x, tuple(rng.sample(range(x.dim()), rng.randint(0, x.dim())))), {}


def _gen_flip_method(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (x, dims), _ = _gen_flip_fn(rng)
    return ((x, dims) if rng.random() < 0.3 or not dims else (x, *dims)), {}


def _gen_unfold(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 1, 3)
    d = rng.randrange(x.dim())
    size = rng.randint(1, x.shape[d])
    return (x, d, size, rng.randint(1, 3)), {}


def _gen_diagonal(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = _gen_ndim(rng, 2, 4)
    a, b = rng.sample(range(x.dim()), 2)
    return (x,), {"offset": rng.randint(-2, 2), "dim1": a, "dim2": b - x.dim()}


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------


def register(registry: OpRegistry) -> None:
    T = torch.Tensor
    reg = registry.register

    # view / reshape
    reg(T.view, _view_anno, name="torch.Tensor.view", input_gen_fn=_gen_view,
        update_kwargs=_update_sizes("size"))
    reg(T.reshape, _reshape_method_anno, name="torch.Tensor.reshape", input_gen_fn=_gen_reshape_method,
        update_kwargs=_update_sizes("shape"))
    reg(torch.reshape, _reshape_fn_anno, name="torch.reshape", input_gen_fn=_gen_reshape_fn,
        update_kwargs=_update_shape_seq("shape"))
    reg(T.view_as, _as_anno, name="torch.Tensor.view_as", input_gen_fn=_gen_as)
    reg(T.reshape_as, _as_anno, name="torch.Tensor.reshape_as", input_gen_fn=_gen_as)
    reg(torch.flatten, _flatten_anno, name="torch.flatten", aliases=(T.flatten,), input_gen_fn=_gen_flatten)
    reg(torch.ravel, _ravel_anno, name="torch.ravel", aliases=(T.ravel,), input_gen_fn=_gen_ravel)
    reg(torch.unflatten, _unflatten_anno, name="torch.unflatten", input_gen_fn=_gen_unflatten,
        update_kwargs=_update_unflatten)
    reg(T.unflatten, _unflatten_method_anno, name="torch.Tensor.unflatten", input_gen_fn=_gen_unflatten,
        update_kwargs=_update_unflatten)

    # transposes and permutations
    reg(torch.transpose, _transpose_anno, name="torch.transpose", aliases=(T.transpose,),
        input_gen_fn=_gen_transpose)
    reg(T.transpose_, _transpose_anno, name="torch.Tensor.transpose_", input_gen_fn=_gen_transpose)
    reg(torch.swapaxes, _swapaxes_anno, name="torch.swapaxes", aliases=(T.swapaxes,),
        input_gen_fn=_gen_transpose)
    reg(torch.swapdims, _swapdims_anno, name="torch.swapdims", aliases=(T.swapdims,),
        input_gen_fn=_gen_transpose)
    reg(torch.t, _t_anno, name="torch.t", aliases=(T.t,), input_gen_fn=_gen_t)
    reg(T.t_, _t_anno, name="torch.Tensor.t_", input_gen_fn=_gen_t)
    reg(T.T.__get__, _reverse_anno, name="torch.Tensor.T", input_gen_fn=_gen_2d)
    reg(T.H.__get__, _reverse_anno, name="torch.Tensor.H", input_gen_fn=_gen_2d)
    reg(T.mT.__get__, _matrix_t_anno, name="torch.Tensor.mT", input_gen_fn=_gen_matrices)
    reg(T.mH.__get__, _matrix_t_anno, name="torch.Tensor.mH", input_gen_fn=_gen_matrices)
    reg(torch.adjoint, _adjoint_anno, name="torch.adjoint", aliases=(T.adjoint,), input_gen_fn=_gen_matrices)
    reg(torch.permute, _permute_fn_anno, name="torch.permute", input_gen_fn=_gen_permute_fn)
    reg(T.permute, _permute_method_anno, name="torch.Tensor.permute", input_gen_fn=_gen_permute_method)
    reg(torch.movedim, _movedim_anno, name="torch.movedim",
        aliases=(T.movedim, torch.moveaxis, T.moveaxis), input_gen_fn=_gen_movedim)

    # split / chunk / unbind
    reg(torch.split, _split_fn_anno, name="torch.split", input_gen_fn=_gen_split_fn)
    reg(T.split, _split_method_anno, name="torch.Tensor.split", input_gen_fn=_gen_split_method)
    reg(torch.chunk, _chunk_anno, name="torch.chunk", aliases=(T.chunk,), input_gen_fn=_gen_chunk)
    reg(torch.unbind, _unbind_anno, name="torch.unbind", aliases=(T.unbind,), input_gen_fn=_gen_unbind)
    reg(torch.tensor_split, _tensor_split_anno, name="torch.tensor_split", aliases=(T.tensor_split,),
        input_gen_fn=_gen_tensor_split)

    # lists of tensors
    P = inspect.Parameter
    dim0 = P("dim", P.POSITIONAL_OR_KEYWORD, default=0)
    reg(cat, _cat_anno, name="torch.cat", aliases=(torch.cat, torch.concat, torch.concatenate),
        signature=_list_signature("tensors", dim0), input_gen_fn=_gen_cat)
    reg(stack, _stack_anno, name="torch.stack", aliases=(torch.stack,),
        signature=_list_signature("tensors", dim0), input_gen_fn=_gen_stack)
    reg(hstack, _hstack_anno, name="torch.hstack", aliases=(torch.hstack,),
        signature=_list_signature("tensors"), input_gen_fn=_gen_hstack)
    reg(vstack, _vstack_anno, name="torch.vstack", aliases=(torch.vstack, torch.row_stack),
        signature=_list_signature("tensors"), input_gen_fn=_gen_vstack)

    # expand / repeat
    reg(T.expand, _expand_anno, name="torch.Tensor.expand", input_gen_fn=_gen_expand,
        update_kwargs=_update_sizes("sizes"))
    reg(torch.broadcast_to, _broadcast_to_anno, name="torch.broadcast_to", aliases=(T.broadcast_to,),
        input_gen_fn=_gen_broadcast_to, update_kwargs=_update_shape_seq("size"))
    reg(T.expand_as, _expand_as_anno, name="torch.Tensor.expand_as", input_gen_fn=_gen_expand_as)
    reg(T.repeat, _repeat_anno, name="torch.Tensor.repeat", input_gen_fn=_gen_repeat)
    reg(torch.tile, _tile_fn_anno, name="torch.tile", input_gen_fn=_gen_tile_fn)
    reg(T.tile, _tile_method_anno, name="torch.Tensor.tile", input_gen_fn=_gen_tile_method)
    reg(torch.repeat_interleave, _repeat_interleave_anno, name="torch.repeat_interleave",
        aliases=(T.repeat_interleave,), input_gen_fn=_gen_repeat_interleave,
        update_kwargs=_update_output_size)

    # squeeze / unsqueeze
    reg(torch.squeeze, _squeeze_anno, name="torch.squeeze", aliases=(T.squeeze,), input_gen_fn=_gen_squeeze)
    reg(T.squeeze_, _squeeze_anno, name="torch.Tensor.squeeze_", input_gen_fn=_gen_squeeze)
    reg(torch.unsqueeze, _unsqueeze_anno, name="torch.unsqueeze", aliases=(T.unsqueeze,),
        input_gen_fn=_gen_unsqueeze)
    reg(T.unsqueeze_, _unsqueeze_anno, name="torch.Tensor.unsqueeze_", input_gen_fn=_gen_unsqueeze)

    # narrow / select / roll / flip / unfold / diagonal
    reg(torch.narrow, _narrow_anno, name="torch.narrow", aliases=(T.narrow,), input_gen_fn=_gen_narrow)
    reg(torch.select, _select_anno, name="torch.select", aliases=(T.select,), input_gen_fn=_gen_select)
    reg(torch.roll, _roll_anno, name="torch.roll", aliases=(T.roll,), input_gen_fn=_gen_roll)
    reg(torch.flip, _flip_fn_anno, name="torch.flip", input_gen_fn=_gen_flip_fn)
    reg(T.flip, _flip_method_anno, name="torch.Tensor.flip", input_gen_fn=_gen_flip_method)
    reg(torch.fliplr, _fliplr_anno, name="torch.fliplr", aliases=(T.fliplr,), input_gen_fn=_gen_2d)
    reg(torch.flipud, _flipud_anno, name="torch.flipud", aliases=(T.flipud,), input_gen_fn=_gen_t)
    reg(T.unfold, _unfold_anno, name="torch.Tensor.unfold", input_gen_fn=_gen_unfold)
    reg(torch.diagonal, _diagonal_anno, name="torch.diagonal", aliases=(T.diagonal,),
        input_gen_fn=_gen_diagonal)
