"""Elementwise ops: unary math, activations, broadcasting binary ops, dtype conversions.

Every output element depends on the input elements at the same (broadcast) position
only, so every dim may be split (``* -> *``, or `broadcast_anno` when inputs
broadcast). ``rrelu`` is random while training; it is annotated the same way (each part
draws its own slopes, with the same distribution) and verified with ``training=False``.
Dropout lives in the ``nn`` family.

The helpers it shares with the ``compare``, ``creation`` and ``reduce`` families
(`broadcast_op`, `register_all`, the input generators) are in
`nnscaler.ops.builtin.family_helpers`.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from nnscaler.anno import TransformRule, ValuePartial
from nnscaler.ops.builtin._common import is_tensor, randint
from nnscaler.ops.builtin.family_helpers import (
    AWAY,
    GE1,
    POS,
    PROB,
    UNIT,
    Domain,
    Gen,
    binary_gen,
    broadcast_op,
    operands,
    register_all,
    shape,
    spellings,
    unary_gen,
)
from nnscaler.ops.registry import OpRegistry

# ---------------------------------------------------------------------------------------
# signatures of C builtins (torch gives none): the documented parameters
# ---------------------------------------------------------------------------------------


def _unary(input): ...
def _method(self): ...
def _binary(input, other): ...
def _add(input, other, *, alpha=1): ...
def _div(input, other, *, rounding_mode=None): ...
def _pow(input, exponent): ...
def _round(input, *, decimals=0): ...
def _logit(input, eps=None): ...
def _nan_to_num(input, nan=0.0, posinf=None, neginf=None): ...
def _clamp(input, min=None, max=None): ...
def _clamp_min(input, min): ...
def _clamp_max(input, max): ...
def _lerp(input, end, weight): ...
def _addcmul(input, tensor1, tensor2, *, value=1): ...
def _gelu(input, *, approximate="none"): ...
def _softplus(input, beta=1.0, threshold=20.0): ...
def _shrink(input, lambd=0.5): ...
def _elu_(input, alpha=1.0): ...
def _leaky_relu_(input, negative_slope=0.01): ...
def _hardtanh_(input, min_val=-1.0, max_val=1.0): ...
def _celu(input, alpha=1.0): ...
def _threshold(input, threshold, value): ...
def _rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None): ...
def _convert(self, *, memory_format=torch.preserve_format): ...
def _type_as(self, other): ...
def _to(self, *args, **kwargs): ...
def _contiguous(self, *, memory_format=torch.contiguous_format): ...
def _clone(input, *, memory_format=torch.preserve_format): ...
def _copy_(self, src, non_blocking=False): ...


def _type_anno(self, dtype=None, non_blocking=False, **kwargs) -> str:
    # ``x.type()`` without a dtype returns the type's name, a string
    return "? -> ?" if dtype is None else "* -> *"


# ---------------------------------------------------------------------------------------
# the ops
# ---------------------------------------------------------------------------------------

#: unary math: name -> (input domain, extra aliases)
UNARY: dict[str, tuple[Domain, tuple[Any, ...]]] = {
    "abs": (None, (torch.Tensor.__abs__, torch.absolute, torch.Tensor.absolute)),
    "neg": (None, (torch.Tensor.__neg__, torch.negative, torch.Tensor.negative)),
    "positive": (None, (torch.Tensor.__pos__,)),
    "exp": (None, ()),
    "exp2": (None, (torch.special.exp2,)),
    "expm1": (None, (torch.special.expm1,)),
    "log": (POS, ()),
    "log2": (POS, ()),
    "log10": (POS, ()),
    "log1p": (POS, (torch.special.log1p,)),
    "sqrt": (POS, ()),
    "rsqrt": (POS, ()),
    "sin": (None, ()),
    "cos": (None, ()),
    "tan": (UNIT, ()),
    "asin": (UNIT, (torch.arcsin, torch.Tensor.arcsin)),
    "acos": (UNIT, (torch.arccos, torch.Tensor.arccos)),
    "atan": (None, (torch.arctan, torch.Tensor.arctan)),
    "sinh": (None, ()),
    "cosh": (None, ()),
    "asinh": (None, (torch.arcsinh, torch.Tensor.arcsinh)),
    "acosh": (GE1, (torch.arccosh, torch.Tensor.arccosh)),
    "atanh": (UNIT, (torch.arctanh, torch.Tensor.arctanh)),
    "erf": (None, (torch.special.erf,)),
    "erfc": (None, (torch.special.erfc,)),
    "erfinv": (UNIT, (torch.special.erfinv,)),
    "reciprocal": (AWAY, ()),
    "square": (None, ()),
    "sign": (None, ()),
    "sgn": (None, ()),
    "floor": (None, ()),
    "ceil": (None, ()),
    "trunc": (None, (torch.fix, torch.Tensor.fix)),
    "frac": (None, ()),
    "lgamma": (POS, ()),
    "digamma": (POS, (torch.special.digamma, torch.special.psi)),
    "i0": (None, (torch.special.i0,)),
    "sinc": (None, (torch.special.sinc,)),
    "deg2rad": (None, ()),
    "rad2deg": (None, ()),
}

#: unary math ops that take keyword arguments: name -> (signature, domain, kwargs gen)
UNARY_KW: dict[str, tuple[Callable[..., Any], Domain, Callable[[random.Random], dict[str, Any]]]] = {
    "round": (_round, None, lambda rng: rng.choice([{}, {"decimals": rng.randint(0, 2)}])),
    "logit": (_logit, PROB, lambda rng: rng.choice([{}, {"eps": 1e-3}])),
    "nan_to_num": (
        _nan_to_num, None,
        lambda rng: rng.choice([{}, {"nan": 1.0}, {"posinf": 5.0, "neginf": -5.0}]),
    ),
}


def _with_nans(x: torch.Tensor) -> torch.Tensor:
    # nan_to_num has something to do
    x = x.clone()
    flat = x.view(-1)
    if flat.numel():
        flat[:: 3] = float("nan")
        flat[1:: 5] = float("inf")
    return x


def _register_unary(registry: OpRegistry) -> None:
    for name, (domain, extra) in UNARY.items():
        gen = unary_gen(domain)
        register_all(registry, spellings(name, *extra), "* -> *", name=f"torch.{name}", gen=gen,
                     signature=_unary)
        _register_inplace(registry, name, "* -> *", gen, _method)
    for name, (signature, domain, kw) in UNARY_KW.items():
        if name == "nan_to_num":
            domain = _with_nans
        gen = unary_gen(domain, kwargs=kw)
        extra = (torch.special.round,) if name == "round" else ()
        extra += (torch.special.logit,) if name == "logit" else ()
        register_all(registry, spellings(name, *extra), "* -> *", name=f"torch.{name}", gen=gen,
                     signature=signature)
        _register_inplace(registry, name, "* -> *", gen, self_first(signature))


def _register_inplace(
    registry: OpRegistry,
    name: str,
    annotation: str | Callable[..., str],
    gen: Gen,
    signature: Callable[..., Any] | None,
    extra: Sequence[Any] = (),
) -> None:
    """``torch.Tensor.<name>_`` (and ``torch.<name>_``): the in-place variant, when it exists."""
    method = getattr(torch.Tensor, f"{name}_", None)
    if method is None:
        return
    register_all(registry, (method, getattr(torch, f"{name}_", None), *extra), annotation,
                 name=f"torch.Tensor.{name}_", gen=gen, signature=signature)


# -- activations --------------------------------------------------------------------------


def _inplace_kw(rng: random.Random) -> dict[str, Any]:
    return rng.choice([{}, {"inplace": True}, {"inplace": False}])


def _activation_gens() -> dict[str, tuple[Gen, Callable[..., Any] | None, tuple[Any, ...]]]:
    """F.<name> -> (gen, signature for C builtins, extra aliases)."""
    g = unary_gen
    return {
        "relu": (g(kwargs=_inplace_kw), None, (torch.relu, torch.Tensor.relu)),
        "relu6": (g(kwargs=_inplace_kw), None, ()),
        "gelu": (g(kwargs=lambda rng: rng.choice([{}, {"approximate": "tanh"},
                                                   {"approximate": "none"}])), _gelu, ()),
        "silu": (g(kwargs=_inplace_kw), None, ()),
        "mish": (g(kwargs=_inplace_kw), None, ()),
        "leaky_relu": (g(kwargs=lambda rng: {"negative_slope": rng.choice([0.01, 0.2]),
                                             **_inplace_kw(rng)}), None, ()),
        "elu": (g(kwargs=lambda rng: {"alpha": rng.choice([1.0, 0.5]), **_inplace_kw(rng)}),
                None, ()),
        "selu": (g(kwargs=_inplace_kw), None, (torch.selu,)),
        "celu": (g(kwargs=lambda rng: {"alpha": rng.choice([1.0, 2.0])}), None, (torch.celu,)),
        "softplus": (g(kwargs=lambda rng: rng.choice([{}, {"beta": 2.0, "threshold": 1.0}])),
                     _softplus, ()),
        "hardtanh": (g(kwargs=lambda rng: rng.choice([{}, {"min_val": -0.5, "max_val": 2.0}])),
                     None, ()),
        "logsigmoid": (g(), _unary, ()),
        "hardswish": (g(kwargs=_inplace_kw), None, ()),
        "hardsigmoid": (g(kwargs=_inplace_kw), None, ()),
        "softsign": (g(), None, ()),
        "tanhshrink": (g(), None, ()),
        "softshrink": (g(kwargs=lambda rng: rng.choice([{}, {"lambd": 0.3}])), _shrink, ()),
        "hardshrink": (g(kwargs=lambda rng: rng.choice([{}, {"lambd": 0.3}])), _shrink,
                       (torch.Tensor.hardshrink,)),
        "threshold": (g(kwargs=lambda rng: {"threshold": 0.1, "value": -1.0}), None,
                      (torch.threshold,)),
        "rrelu": (g(kwargs=lambda rng: rng.choice([{}, {"lower": 0.1, "upper": 0.2}])), None,
                  (torch.rrelu,)),
    }


#: in-place activations: F.<name>_ or torch.<name>_ -> signature
INPLACE_ACTIVATIONS: dict[str, Callable[..., Any]] = {
    "relu_": _unary,
    "elu_": _elu_,
    "leaky_relu_": _leaky_relu_,
    "hardtanh_": _hardtanh_,
    "selu_": _unary,
    "celu_": _celu,
    "threshold_": _threshold,
    "rrelu_": _rrelu,
}


def _register_activations(registry: OpRegistry) -> None:
    for name, (gen, signature, extra) in _activation_gens().items():
        fn = getattr(F, name)
        register_all(registry, (fn, *extra), "* -> *", name=f"torch.nn.functional.{name}",
                     gen=gen, signature=signature)
    for name, signature in INPLACE_ACTIVATIONS.items():
        fn = getattr(F, name, None) or getattr(torch, name)
        kw = {"threshold_": lambda rng: {"threshold": 0.1, "value": -1.0}}.get(name)
        register_all(registry, (fn, getattr(torch, name, None), getattr(torch.Tensor, name, None)),
                     "* -> *", name=f"torch.nn.functional.{name}" if hasattr(F, name)
                     else f"torch.{name}", gen=unary_gen(kwargs=kw), signature=signature)
    # sigmoid and tanh: torch.X is canonical; F.X forward to the method
    for name, extra in (("sigmoid", (F.sigmoid, torch.special.expit)), ("tanh", (F.tanh,))):
        register_all(registry, spellings(name, *extra), "* -> *", name=f"torch.{name}",
                     gen=unary_gen(), signature=_unary)
        _register_inplace(registry, name, "* -> *", unary_gen(), _method)


# -- binary -------------------------------------------------------------------------------


def _alpha_kw(rng: random.Random) -> dict[str, Any]:
    return rng.choice([{}, {"alpha": 2}, {"alpha": 0.5}])


def _rounding_kw(rng: random.Random) -> dict[str, Any]:
    return rng.choice([{}, {"rounding_mode": None}, {"rounding_mode": "trunc"},
                       {"rounding_mode": "floor"}])


def _binary_table() -> list[tuple[str, Callable[..., Any], tuple[Any, ...], Gen, Gen]]:
    """(name, signature, extra aliases, gen, in-place gen) of the broadcasting binary ops."""
    T = torch.Tensor
    b = binary_gen
    return [
        ("add", _add, (T.__add__, T.__radd__), b(kwargs=_alpha_kw, scalar_first=True),
         b(inplace=True, kwargs=_alpha_kw)),
        ("sub", _add, (torch.subtract, T.subtract, T.__sub__), b(kwargs=_alpha_kw),
         b(inplace=True, kwargs=_alpha_kw)),
        ("mul", _binary, (torch.multiply, T.multiply, T.__mul__, T.__rmul__), b(scalar_first=True),
         b(inplace=True)),
        ("div", _div, (torch.divide, T.divide, T.__truediv__, T.__div__, torch.true_divide,
                       T.true_divide), b(None, AWAY, kwargs=_rounding_kw, scalar_first=True),
         b(None, AWAY, inplace=True, kwargs=_rounding_kw)),
        ("floor_divide", _binary, (T.__floordiv__,), b(None, AWAY), b(None, AWAY, inplace=True)),
        ("remainder", _binary, (T.__mod__,), b(None, AWAY, scalar_first=True),
         b(None, AWAY, inplace=True)),
        ("fmod", _binary, (), b(None, AWAY), b(None, AWAY, inplace=True)),
        ("pow", _pow, (T.__pow__,), b(POS, None, scalar_first=True), b(POS, None, inplace=True)),
        ("float_power", _pow, (), b(POS, None),
         b(POS, None, inplace=True, dtype=torch.float64)),  # in place needs a float64 self
        ("maximum", _binary, (), b(numbers=False), b()),
        ("minimum", _binary, (), b(numbers=False), b()),
        ("fmax", _binary, (), b(numbers=False), b()),
        ("fmin", _binary, (), b(numbers=False), b()),
        ("atan2", _binary, (torch.arctan2, T.arctan2), b(numbers=False),
         b(inplace=True, numbers=False)),
        ("hypot", _binary, (), b(numbers=False), b(inplace=True, numbers=False)),
        ("copysign", _binary, (), b(), b(inplace=True)),
        ("logaddexp", _binary, (), b(numbers=False), b()),
        ("logaddexp2", _binary, (), b(numbers=False), b()),
        ("xlogy", _binary, (torch.special.xlogy,), b(None, POS), b(None, POS, inplace=True)),
    ]


#: in-place dunders: the in-place op they alias
INPLACE_DUNDERS: dict[str, tuple[Any, ...]] = {
    "add": (torch.Tensor.__iadd__,),
    "sub": (torch.Tensor.__isub__, torch.Tensor.subtract_),
    "mul": (torch.Tensor.__imul__, torch.Tensor.multiply_),
    "div": (torch.Tensor.__itruediv__, torch.Tensor.__idiv__, torch.Tensor.divide_,
            torch.Tensor.true_divide_),
    "floor_divide": (torch.Tensor.__ifloordiv__,),
    "remainder": (torch.Tensor.__imod__,),
    "pow": (torch.Tensor.__ipow__,),
    "atan2": (torch.Tensor.arctan2_,),
}


def _rsub(input, other, *, alpha=1): ...


def _reverse_table() -> list[tuple[Any, str, Gen]]:
    """Reflected operators ``other OP self``: (fn, name, gen)."""
    T = torch.Tensor
    return [
        (torch.rsub, "torch.rsub", binary_gen(kwargs=_alpha_kw)),
        (T.__rtruediv__, "torch.Tensor.__rtruediv__", binary_gen(AWAY, None)),
        (T.__rfloordiv__, "torch.Tensor.__rfloordiv__", binary_gen(AWAY, None)),
        (T.__rmod__, "torch.Tensor.__rmod__", binary_gen(AWAY, None)),
        (T.__rpow__, "torch.Tensor.__rpow__", binary_gen(None, POS)),
    ]


def sum_of_parts_rules(bound: Any) -> list[TransformRule]:
    """``add``/``sub`` of two tensors is linear in the pair: given value parts of both,
    the parts return value parts of the result (a value rule)."""
    if any(shape is None for shape in bound.input_shapes[:2]):
        return []  # a number operand would be added by every part
    return [TransformRule((ValuePartial(), ValuePartial()), (ValuePartial(),))]


def _register_binary(registry: OpRegistry) -> None:
    for name, signature, extra, gen, inplace_gen in _binary_table():
        anno = broadcast_op(signature, 2)
        register_all(registry, spellings(name, *extra), anno, name=f"torch.{name}", gen=gen,
                     signature=signature,
                     transform_rules=sum_of_parts_rules if name in ("add", "sub") else None)
        sig_ = self_first(signature)
        _register_inplace(registry, name, broadcast_op(sig_, 2), inplace_gen, sig_,
                          INPLACE_DUNDERS.get(name, ()))
    for fn, name, gen in _reverse_table():
        signature = _rsub if fn is torch.rsub else None
        template = _rsub if fn is torch.rsub else fn
        register_all(registry, (fn, *((torch.Tensor.__rsub__,) if fn is torch.rsub else ())),
                     broadcast_op(template, 2), name=name, gen=gen, signature=signature)


def self_first(template: Callable[..., Any]) -> Callable[..., Any]:
    """``template`` with its first parameter renamed ``self`` (the signature of a method)."""
    sig = inspect.signature(template)
    params = list(sig.parameters.values())
    params[0] = params[0].replace(name="self")

    def method(*args: Any, **kwargs: Any) -> None: ...

    method.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    method.__name__ = method.__qualname__ = template.__name__
    return method


# -- ternary ------------------------------------------------------------------------------


def _gen_clamp(inplace: bool) -> Gen:
    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, lo, hi = operands(rng, 3, inplace=inplace)
        lo = lo - 0.5
        hi = hi + 0.5
        which = rng.choice(["min", "max", "both"])
        if rng.random() < 0.5:  # numbers (min and max are both numbers or both tensors)
            lo, hi = -0.5, 0.7
        kw = {}
        if which in ("min", "both"):
            kw["min"] = lo
        if which in ("max", "both"):
            kw["max"] = hi
        if rng.random() < 0.5 and which == "both":
            return (x, kw["min"], kw["max"]), {}
        return (x,), kw

    return gen


def _gen_clamp_one(inplace: bool) -> Gen:
    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, bound = operands(rng, 2, inplace=inplace, scalars=(1,))
        if is_tensor(bound) and bound.dim() == 0:
            bound = float(bound)
        return (x, bound), {}

    return gen


def _gen_lerp(inplace: bool) -> Gen:
    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, end, weight = operands(rng, 3, inplace=inplace, scalars=(2,))
        if is_tensor(weight) and weight.dim() == 0 and rng.random() < 0.5:
            weight = float(weight)
        return (x, end, weight), {}

    return gen


def _gen_addc(divide: bool, inplace: bool) -> Gen:
    def gen(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, t1, t2 = operands(rng, 3, inplace=inplace, domains=(None, None, AWAY if divide else None))
        return (x, t1, t2), rng.choice([{}, {"value": 0.5}])

    return gen


def _register_ternary(registry: OpRegistry) -> None:
    clamp = broadcast_op(_clamp, 3)
    register_all(registry, spellings("clamp", torch.clip, torch.Tensor.clip), clamp,
                 name="torch.clamp", gen=_gen_clamp(False), signature=_clamp)
    sig_ = self_first(_clamp)
    _register_inplace(registry, "clamp", broadcast_op(sig_, 3), _gen_clamp(True), sig_,
                      (torch.Tensor.clip_, torch.clip_))
    for name, template in (("clamp_min", _clamp_min), ("clamp_max", _clamp_max)):
        register_all(registry, spellings(name), broadcast_op(template, 2), name=f"torch.{name}",
                     gen=_gen_clamp_one(False), signature=template)
        sig_ = self_first(template)
        _register_inplace(registry, name, broadcast_op(sig_, 2), _gen_clamp_one(True), sig_)
    register_all(registry, spellings("lerp"), broadcast_op(_lerp, 3), name="torch.lerp",
                 gen=_gen_lerp(False), signature=_lerp)
    sig_ = self_first(_lerp)
    _register_inplace(registry, "lerp", broadcast_op(sig_, 3), _gen_lerp(True), sig_)
    for name, divide in (("addcmul", False), ("addcdiv", True)):
        register_all(registry, spellings(name), broadcast_op(_addcmul, 3), name=f"torch.{name}",
                     gen=_gen_addc(divide, False), signature=_addcmul)
        sig_ = self_first(_addcmul)
        _register_inplace(registry, name, broadcast_op(sig_, 3), _gen_addc(divide, True), sig_)


# -- dtype, device and memory conversions -------------------------------------------------

CONVERSIONS = ("float", "half", "bfloat16", "double", "int", "long", "short", "bool", "cpu")


def _gen_to(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (x,), _ = unary_gen()(rng)
    choice = rng.randrange(6)
    if choice == 0:
        return (x, torch.float64), {}
    if choice == 1:
        return (x,), {"dtype": torch.float16}
    if choice == 2:
        return (x, "cpu"), {}
    if choice == 3:
        return (x, randint(rng, 0, 5, 2)), {}  # x.to(other): other's dtype and device
    if choice == 4:
        return (x, torch.device("cpu"), torch.bfloat16), {"copy": True}
    return (x,), {"device": "cpu", "dtype": torch.int32, "non_blocking": False}


def _gen_type(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (x,), _ = unary_gen()(rng)
    return rng.choice([((x, torch.float64), {}), ((x,), {"dtype": torch.int64}),
                       ((x, "torch.DoubleTensor"), {}), ((x,), {})])


def _gen_type_as(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    (x,), _ = unary_gen()(rng)
    other = randint(rng, 0, 3, *shape(rng, 0, 2))
    return (x, other), {}


def _gen_copy_(rng: random.Random) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x, src = operands(rng, 2, inplace=True)
    return (x, src), rng.choice([{}, {"non_blocking": False}])


def _register_conversions(registry: OpRegistry) -> None:
    T = torch.Tensor
    for name in CONVERSIONS:
        register_all(registry, (getattr(T, name),), "* -> *", name=f"torch.Tensor.{name}",
                     gen=unary_gen(kwargs=lambda rng: rng.choice(
                         [{}, {"memory_format": torch.preserve_format}])),
                     signature=_convert)
    register_all(registry, (T.type,), _type_anno, name="torch.Tensor.type", gen=_gen_type)
    register_all(registry, (T.type_as,), "*, ? -> *", name="torch.Tensor.type_as",
                 gen=_gen_type_as, signature=_type_as)
    register_all(registry, (T.to,), "* -> *", name="torch.Tensor.to", gen=_gen_to, signature=_to)
    register_all(registry, (T.contiguous,), "* -> *", name="torch.Tensor.contiguous",
                 gen=unary_gen(), signature=_contiguous)
    register_all(registry, spellings("detach"), "* -> *", name="torch.detach", gen=unary_gen(),
                 signature=_unary)
    register_all(registry, spellings("clone"), "* -> *", name="torch.clone",
                 gen=unary_gen(kwargs=lambda rng: rng.choice(
                     [{}, {"memory_format": torch.contiguous_format}])), signature=_clone)
    register_all(registry, (T.copy_,), broadcast_op(_copy_, 2), name="torch.Tensor.copy_",
                 gen=_gen_copy_, signature=_copy_)


def register(registry: OpRegistry) -> None:
    _register_unary(registry)
    _register_activations(registry)
    _register_binary(registry)
    _register_ternary(registry)
    _register_conversions(registry)
