"""The transform space of a bound annotation: every legal way to split an op in parts.

A `Transform` splits input ``idx`` along dim ``dim`` in ``num`` parts and says, for
every input and output, the placement each part holds: `Split` along a dim,
`ValuePartial` (the parts sum to the whole) or `Replicate`. The default
derivation reads the placements off the annotation; a [`TransformRule`][nnscaler.TransformRule]
replaces it for the requests it matches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import attrs
import torch

from nnscaler.anno.errors import AnnotationError
from nnscaler.anno.parser import DimAnno, Ident, Reduce, TensorAnno

if TYPE_CHECKING:
    from nnscaler.anno.infer import BoundAnno

__all__ = [
    "Split", "ValuePartial", "Replicate", "Placement", "Transform", "TransformRule",
    "transform_space", "split",
]


@attrs.frozen
class Split:
    """Each part holds a contiguous slice along ``dim``; the parts concatenate."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"

    def chunk(self, tensor: torch.Tensor, num: int, part: int) -> torch.Tensor:
        return torch.tensor_split(tensor, num, self.dim)[part]

    def combine(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts), self.dim)


@attrs.frozen
class ValuePartial:
    """Each part holds a full-shape tensor; the true value is the sum of the parts."""

    def __str__(self) -> str:
        return "V"

    def chunk(self, tensor: torch.Tensor, num: int, part: int) -> torch.Tensor:
        return tensor if part == 0 else torch.zeros_like(tensor)

    def combine(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total


@attrs.frozen
class Replicate:
    """Each part holds the whole tensor."""

    def __str__(self) -> str:
        return "R"

    def chunk(self, tensor: torch.Tensor, num: int, part: int) -> torch.Tensor:
        return tensor

    def combine(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return parts[0]


Placement = Union[Split, ValuePartial, Replicate]

#: ``modifier(kwargs, idx, dim, num, part) -> kwargs`` of part ``part``
Modifier = Callable[[dict[str, Any], int, int, int, int], dict[str, Any]]


class FrozenKwargs(Mapping[str, int]):
    """A read-only, hashable ``name -> value`` map (a transform's keyword updates)."""

    def __init__(self, items: Mapping[str, int] | Sequence[tuple[str, int]] = ()) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> int:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


def _placements(value: Sequence[Placement | None]) -> tuple[Placement | None, ...]:
    return tuple(value)


@attrs.frozen
class TransformRule:
    """An op author's own split, replacing the default derivation where it applies.

    The rule applies to a request ``(idx, dim, num)`` when ``inputs[idx] == Split(dim)``;
    the transform then has the rule's placements, even for a dim the annotation marks ``^``.
    ``modifier(kwargs, idx, dim, num, part)`` returns the keyword arguments of part
    ``part`` (as nnScaler's ``TransformRule``); without one the keywords stay unchanged.

    ``part_op`` names a registered op that each part calls instead of the op itself, with
    the same arguments and the modifier's keywords: a split that needs other code than
    the whole op (a lookup into a slice of a table masks the rows it does not hold). When
    that op is registered ``collective=True`` its parts also talk to each other: each
    receives ``group``, a `PartGroup` of the parts of the
    split (a cross-entropy over classes split in parts exchanges its normalizers).

    A *value rule* has no ``Split`` input, only ``ValuePartial`` ones (and ``Replicate``
    or ``None``): the op is linear in those inputs, so parts given value parts of them
    return value parts of the result (``a + b`` of value-partial ``a`` and ``b``). It is
    the transform with ``dim=None`` (``partition(op, idx=k, dim=None, num=n)``), legal for
    every ``num >= 2``.
    """

    inputs: tuple[Placement | None, ...] = attrs.field(converter=_placements)
    outputs: tuple[Placement | None, ...] = attrs.field(converter=_placements)
    modifier: Modifier | None = None
    part_op: str | None = None

    def __attrs_post_init__(self) -> None:
        if not any(isinstance(x, (Split, ValuePartial)) for x in self.inputs):
            raise ValueError(
                f"TransformRule{tuple(self.inputs)}: a rule splits some input: give one input "
                f"Split(dim) (the rule answers requests to split that dim), or ValuePartial() "
                f"for a value rule (an op linear in its inputs: value parts in, value parts "
                f"out)"
            )

    @property
    def is_value_rule(self) -> bool:
        """No input is split along a dim: the rule splits values (``dim=None``)."""
        return not any(isinstance(x, Split) for x in self.inputs)


def _str_placements(placements: Sequence[Placement | None]) -> str:
    return ", ".join("?" if placement is None else str(placement) for placement in placements)


@attrs.frozen
class Transform:
    """Input ``idx`` split along ``dim`` (identifier ``ident``) in ``num`` parts.

    ``inputs``/``outputs`` hold each part's placement (``None`` where the entry is ``?``);
    ``kwarg_updates`` are the keyword arguments each part gets instead (a hidden dim's size
    divided by ``num``); ``modifier`` comes from a [`TransformRule`][nnscaler.TransformRule].
    """

    idx: int
    dim: int | None
    num: int
    ident: str
    inputs: tuple[Placement | None, ...] = attrs.field(converter=_placements)
    outputs: tuple[Placement | None, ...] = attrs.field(converter=_placements)
    kwarg_updates: FrozenKwargs = attrs.field(factory=FrozenKwargs, converter=FrozenKwargs)
    modifier: Modifier | None = None
    part_op: str | None = None

    def part_kwargs(self, kwargs: Mapping[str, Any], part: int) -> dict[str, Any]:
        """The keyword arguments of part ``part``: the updates, then the rule's modifier."""
        out = {**kwargs, **self.kwarg_updates}
        if self.modifier is not None:
            out = self.modifier(out, self.idx, self.dim, self.num, part)
        return out

    def __str__(self) -> str:
        what = (f"the values of input {self.idx}" if self.dim is None
                else f"input {self.idx} dim {self.dim} ({self.ident!r})")
        text = (f"split {what} in {self.num}: "
                f"{_str_placements(self.inputs)} -> {_str_placements(self.outputs)}")
        updates = ", ".join(f"{k}={v}" for k, v in self.kwarg_updates.items())
        text = f"{text} [{updates}]" if updates else text
        return text if self.part_op is None else f"{text} via {self.part_op}"


# -- the space ------------------------------------------------------------------------------


def _divisors(size: int) -> list[int]:
    """Every ``n >= 2`` that divides ``size``, in increasing order."""
    small = [n for n in range(2, int(size**0.5) + 1) if size % n == 0]
    large = [size // n for n in reversed(small) if size // n != n]
    return small + large + ([size] if size >= 2 else [])


def _dims(tensor: TensorAnno) -> list[tuple[Ident, ...]]:
    """The identifiers of each dim of an expanded tensor (one without '*')."""
    return [d.idents for d in tensor.dims or () if isinstance(d, DimAnno)]


def _position(tensor: TensorAnno, name: str) -> int | None:
    """The dim of ``tensor`` whose first identifier is ``name``."""
    return next((p for p, idents in enumerate(_dims(tensor)) if idents[0].name == name), None)


def _examine(
    bound: BoundAnno, idx: int, dim: int, rules: Sequence[TransformRule]
) -> tuple[str, int, TransformRule | None] | str:
    """``(identifier, size to divide, rule)`` when the dim may be split, else why not."""
    inputs = bound.expanded.inputs
    if not 0 <= idx < len(inputs):
        return f"the op has {len(inputs)} inputs"
    tensor, shape = inputs[idx], bound.input_shapes[idx]
    if tensor.dims is None or shape is None:
        return f"input {idx} is annotated '?'"
    if not 0 <= dim < len(tensor.dims):
        return f"input {idx} has {len(tensor.dims)} dims"
    ident = _dims(tensor)[dim][0]
    for rule in rules:
        if rule.inputs[idx] == Split(dim):
            return ident.name, shape[dim], rule
    if ident.is_number:
        return f"dim {dim} of input {idx} is the fixed size {ident.name}"
    if ident.reduce is Reduce.FROZEN:
        return f"{ident.name!r} is marked '^' (never split)"
    for t in (*bound.expanded.inputs, *bound.expanded.outputs):
        dims = _dims(t)
        if any(x.name == ident.name for d in dims for x in d[1:]):
            return (f"{ident.name!r} is not the first identifier of a group in {t}, so its "
                    "parts would not be contiguous")
        if sum(d[0].name == ident.name for d in dims) > 1:
            return f"{ident.name!r} names two dims of {t}"
    return ident.name, bound.sizes[ident.name], None


def _check_rules(bound: BoundAnno, rules: Sequence[TransformRule]) -> None:
    n_in, n_out = len(bound.anno.inputs), len(bound.anno.outputs)
    for rule in rules:
        if len(rule.inputs) != n_in or len(rule.outputs) != n_out:
            raise AnnotationError(
                f"{rule} has {len(rule.inputs)} input and {len(rule.outputs)} output "
                f"placements but the annotation has {n_in} inputs and {n_out} outputs",
                annotation=bound.anno.source or str(bound.anno),
            )


def _make(
    bound: BoundAnno, idx: int, dim: int, num: int, name: str, rule: TransformRule | None
) -> Transform:
    if rule is not None:
        return Transform(idx, dim, num, name, rule.inputs, rule.outputs, modifier=rule.modifier,
                         part_op=rule.part_op)
    reduce = _dims(bound.expanded.inputs[idx])[dim][0].reduce

    def placement(tensor: TensorAnno, taken: bool, missing: Placement) -> Placement | None:
        if not tensor.is_tensor:
            return Replicate() if taken else None
        p = _position(tensor, name)
        return missing if p is None else Split(p)

    inputs = [placement(t, s is not None, Replicate())
              for t, s in zip(bound.expanded.inputs, bound.input_shapes, strict=True)]
    partial = ValuePartial() if reduce is Reduce.SUM else Replicate()
    outputs = [placement(t, False, partial) for t in bound.expanded.outputs]
    updates = {name: bound.sizes[name] // num} if name in bound.kwarg_idents else {}
    return Transform(idx, dim, num, name, inputs, outputs, updates)


def transform_space(
    bound: BoundAnno, num: int | None = None, *, rules: Sequence[TransformRule] = ()
) -> list[Transform]:
    """Every legal split of ``bound`` in ``num`` parts (every divisor >= 2 when ``None``).

    A dim may be split when a rule matches it, or when its first identifier is neither a
    number nor marked ``^``, is never a later member of a group, and names one dim per
    tensor; ``num`` must divide that identifier's size. Ordered by (idx, dim, num).
    """
    _check_rules(bound, rules)
    space = []
    for idx, tensor in enumerate(bound.expanded.inputs):
        for dim in range(len(tensor.dims or ())):
            found = _examine(bound, idx, dim, rules)
            if isinstance(found, str):
                continue
            name, size, rule = found
            nums = _divisors(size) if num is None else [num] if num >= 2 and size % num == 0 else []
            space.extend(_make(bound, idx, dim, n, name, rule) for n in nums)
    for rule in rules:
        if rule.is_value_rule:
            nums = list(VALUE_NUMS) if num is None else [num] if num >= 2 else []
            space.extend(_value_transform(rule, n) for n in nums)
    return space


#: The numbers of parts a value split is listed with when no ``num`` is asked for (any
#: ``num >= 2`` is legal).
VALUE_NUMS = (2, 3, 4)


def _value_transform(rule: TransformRule, num: int, idx: int | None = None) -> Transform:
    if idx is None:
        idx = next(i for i, x in enumerate(rule.inputs) if isinstance(x, ValuePartial))
    return Transform(idx, None, num, "+", rule.inputs, rule.outputs, modifier=rule.modifier,
                     part_op=rule.part_op)


def split(
    bound: BoundAnno, idx: int, dim: int | None, num: int, *,
    rules: Sequence[TransformRule] = (),
) -> Transform:
    """The transform splitting input ``idx`` along ``dim`` in ``num`` parts; ``dim=None``
    splits the values of input ``idx`` (a value rule of ``rules``).

    Raises `AnnotationError` saying why the split is illegal and listing the legal
    ``(idx, dim, num)`` choices.
    """
    _check_rules(bound, rules)
    if dim is None:
        value = [r for r in rules if r.is_value_rule and 0 <= idx < len(r.inputs)
                 and isinstance(r.inputs[idx], ValuePartial)]
        if value and num >= 2:
            return _value_transform(value[0], num, idx)
        found = ("num must be at least 2" if value else
                 f"no value rule of the op takes input {idx} value-partial")
    else:
        found = _examine(bound, idx, dim, rules)
    if not isinstance(found, str):
        name, size, rule = found
        if num >= 2 and size % num == 0:
            return _make(bound, idx, dim, num, name, rule)  # type: ignore[arg-type]
        found = f"{name!r} has size {size}; num must be a divisor of it, at least 2"
    tensors = bound.expanded.inputs
    valid = (dim is not None and 0 <= idx < len(tensors)
             and 0 <= dim < len(tensors[idx].dims or ()))
    position = tensors[idx].positions[dim] if valid else None
    choices: dict[tuple[int, int, str], list[int]] = {}
    for t in transform_space(bound, rules=rules):
        choices.setdefault((t.idx, t.dim, t.ident), []).append(t.num)
    legal = "\n".join(f"  idx={i}, dim={d} ({name!r}): num in {nums}" if d is not None
                      else f"  idx={i}, dim=None (its values): any num >= 2"
                      for (i, d, name), nums in choices.items())
    what = f"the values of input {idx}" if dim is None else f"input {idx} dim {dim}"
    raise AnnotationError(
        f"cannot split {what} in {num}: {found}\n"
        + (f"legal choices (idx, dim, num):\n{legal}" if legal else "no split is legal: replicate the op"),
        annotation=bound.anno.source or str(bound.anno),
        position=position,
    )
