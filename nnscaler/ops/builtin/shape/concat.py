"""Lists of tensors: cat / stack / hstack / vstack.

The calling convention gives one annotation entry per parameter, and a list is one
parameter. These ops are registered with a `TensorListSignature` that binds
``torch.cat([x, y], dim=1)`` as ``cat(x, y, dim=1)``: one annotated input per element. The
op's ``fn`` is then a small function of this module taking the tensors as separate
arguments (``cat(*tensors, dim=0)``); ``torch.cat`` and its spellings are aliases that the
tracer looks up.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nnscaler.ops.builtin._common import (
    idents,
    is_tensor,
    join_anno,
    norm_dim,
)
from nnscaler.ops.builtin.shape.common import (
    rand_tensor,
    small_shape,
)
from nnscaler.ops.registry import OpRegistry


class TensorListSignature(inspect.Signature):
    """Binds ``f(tensors, <rest>)`` as ``f(t0, t1, ..., <rest>)``.

    The registry's calling convention annotates the first parameters of a signature, one
    entry each; a list of tensors is one parameter. This signature's parameters are
    ``t0 ... t{max_len-1}`` (positional-only) followed by the rest of the op's parameters
    (keyword-only), and its `bind` spreads the list over them, so that the
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
    return join_anno(ins, [out])


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
    return join_anno([names] * len(tensors), [out])


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
    return join_anno(ins, [[str(total)] + base[1:]])


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


def _gen_cat(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    shape = list(small_shape(rng, 1, 3))
    d = rng.randrange(len(shape))
    tensors = []
    for _ in range(rng.randint(1, 3)):
        shape[d] = rng.choice((1, 2, 3, 4))
        tensors.append(rand_tensor(rng, shape))
    seq = tensors if rng.random() < 0.5 else tuple(tensors)
    dim = d - len(shape) if rng.random() < 0.3 else d
    if rng.random() < 0.5:
        return (seq,), {"dim": dim}
    return (seq, dim), {}


def _gen_stack(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    shape = small_shape(rng, 1, 3)
    tensors = [rand_tensor(rng, shape) for _ in range(rng.randint(1, 3))]
    d = rng.randrange(len(shape) + 1)
    return (tensors,), {"dim": d}


def _gen_hstack(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    shape = list(small_shape(rng, 1, 3))
    tensors = []
    for _ in range(rng.randint(1, 3)):
        if len(shape) == 1:
            shape[0] = rng.choice((1, 2, 3))
        else:
            shape[1] = rng.choice((1, 2, 3))
        tensors.append(rand_tensor(rng, shape))
    return (tensors,), {}


def _gen_vstack(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    shape = list(small_shape(rng, 1, 3))
    tensors = []
    for _ in range(rng.randint(1, 3)):
        if len(shape) == 1:
            tensors.append(rand_tensor(rng, shape) if rng.random() < 0.5 else rand_tensor(rng, [rng.choice((1, 2)), shape[0]]))
        else:
            shape[0] = rng.choice((1, 2, 3))
            tensors.append(rand_tensor(rng, shape))
    return (tensors,), {}


def register(registry: OpRegistry) -> None:
    """Register the ops on lists of tensors (cat, stack, hstack, vstack)."""
    reg = registry.register
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
