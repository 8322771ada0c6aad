"""Bind an annotation to concrete input shapes: sizes of every identifier, output shapes.

Binding expands ``*`` into as many dims as the inputs give it (named ``*0``, ``*1``, ...),
takes each identifier's size from the first tensor dim that holds it alone or from a
keyword argument of the same name, infers the sizes of hidden-group members by division
(to a fixpoint), and checks that every occurrence agrees. A 0-d tensor matches the
annotation ``1`` (nnScaler's convention for scalars).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs

from nnscaler.anno.errors import AnnotationError
from nnscaler.anno.parser import DimAnno, Ident, OpAnno, Star, TensorAnno, parse

if TYPE_CHECKING:
    from nnscaler.anno.transform import Transform, TransformRule

__all__ = ["BoundAnno", "bind"]

Shape = tuple[int, ...]
_Group = tuple[DimAnno, int, int, int, int]  # the dim, its size, input index, dim index, offset


@attrs.frozen
class BoundAnno:
    """An annotation bound to the shapes of one call.

    ``anno`` equals the annotation that was bound (and carries its source text);
    ``expanded`` is the annotation with each ``*`` replaced by the spatial dims ``*0``,
    ``*1``, ...; ``sizes`` holds every identifier's size (numbers excluded);
    ``kwarg_idents`` are the identifiers that a keyword argument of the call also gives,
    so splitting one divides that keyword argument.
    """

    anno: OpAnno
    expanded: OpAnno
    sizes: dict[str, int]
    input_shapes: tuple[Shape | None, ...]
    output_shapes: tuple[Shape | None, ...]
    kwarg_idents: frozenset[str] = frozenset()

    def __str__(self) -> str:
        return str(self.expanded)

    def transform_space(
        self, num: int | None = None, *, rules: Sequence[TransformRule] = ()
    ) -> list[Transform]:
        """Every legal split; see `nnscaler.anno.transform.transform_space`."""
        from nnscaler.anno.transform import transform_space

        return transform_space(self, num, rules=rules)

    def split(
        self, idx: int, dim: int | None, num: int, *, rules: Sequence[TransformRule] = ()
    ) -> Transform:
        """The transform that splits input ``idx`` along ``dim`` in ``num`` parts."""
        from nnscaler.anno.transform import split

        return split(self, idx, dim, num, rules=rules)


def _expand(tensor: TensorAnno, star: Shape) -> TensorAnno:
    """``tensor`` with its ``*`` replaced by ``len(star)`` spatial dims ``*0``, ``*1``, ..."""
    if not tensor.has_star:
        return tensor
    dims: list[DimAnno | Star] = []
    positions: list[int] = []
    for dim, pos in zip(tensor.dims or (), tensor.positions, strict=True):
        extra = [DimAnno((Ident(f"*{k}", pos=pos),)) for k in range(len(star))]
        dims.extend(extra if isinstance(dim, Star) else [dim])
        positions.extend([pos] * len(extra) if isinstance(dim, Star) else [pos])
    return TensorAnno(tuple(dims), positions=tuple(positions))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bind(
    anno: OpAnno,
    input_shapes: Sequence[Sequence[int] | None],
    kwargs: Mapping[str, Any] | None = None,
) -> BoundAnno:
    """Bind ``anno`` to the shapes of one call (``None`` for a non-tensor argument).

    Raises `AnnotationError` naming the input, the identifier and both sizes when the
    shapes disagree with the annotation.
    """
    if not anno.source:  # built by hand: check it, and get positions for error carets
        anno = parse(str(anno))
    kwargs = kwargs or {}
    text = anno.source

    def fail(reason: str, position: int | None = None) -> AnnotationError:
        return AnnotationError(reason, annotation=text, position=position)

    if len(input_shapes) != len(anno.inputs):
        raise fail(f"the annotation has {len(anno.inputs)} inputs but {len(input_shapes)} were given")
    given = tuple(None if s is None else tuple(int(n) for n in s) for s in input_shapes)

    # 1. shapes against the dims, and what '*' stands for
    shapes, star = _match_inputs(anno, given, fail)
    expanded = OpAnno(
        tuple(_expand(t, star) for t in anno.inputs),
        tuple(_expand(t, star) for t in anno.outputs),
        source=text,
    )

    # 2. sizes: keyword arguments, then dims that hold one identifier, then groups
    names = {x.name for t in expanded.inputs for x in t.idents if not x.is_number}
    kwarg_idents = frozenset(n for n in names if _is_int(kwargs.get(n)))
    sizes: dict[str, int] = {n: kwargs[n] for n in sorted(kwarg_idents)}
    origin = {n: f"keyword argument {n}={kwargs[n]}" for n in kwarg_idents}

    def assign(ident: Ident, size: int, where: str) -> None:
        if sizes.setdefault(ident.name, size) != size:
            raise fail(f"dimension {ident.name!r} is {sizes[ident.name]} in {origin[ident.name]} "
                       f"but {size} in {where}", ident.pos)
        origin.setdefault(ident.name, where)

    groups: list[_Group] = []
    for i, (tensor, shape) in enumerate(zip(expanded.inputs, shapes, strict=True)):
        for p, (dim, size) in enumerate(zip(tensor.dims or (), shape or (), strict=True)):
            dim = cast(DimAnno, dim)  # every '*' is expanded
            ident = dim.idents[0]
            if len(dim.idents) > 1:
                groups.append((dim, size, i, p, tensor.positions[p]))
            elif ident.is_number and int(ident.name) != size:
                raise fail(f"dim {p} of input {i} is annotated {ident.name} but has size {size}",
                           ident.pos)
            elif not ident.is_number:
                assign(ident, size, f"input {i}")
    _solve_groups(groups, sizes, assign, fail)

    def size_of(x: Ident) -> int:
        return int(x.name) if x.is_number else sizes[x.name]

    outputs = tuple(
        None if t.dims is None
        else tuple(math.prod(map(size_of, cast(DimAnno, d).idents)) for d in t.dims)
        for t in expanded.outputs
    )
    return BoundAnno(anno, expanded, sizes, given, outputs, kwarg_idents)


def _match_inputs(
    anno: OpAnno, given: tuple[Shape | None, ...], fail: Callable[..., AnnotationError]
) -> tuple[list[Shape | None], Shape]:
    """Each input's shape checked against its dims (a 0-d tensor is ``(1,)`` where it is
    annotated ``1``), and the dims ``*`` stands for (the same in every input)."""
    shapes: list[Shape | None] = []
    star: Shape | None = None
    star_where = ""
    for i, (tensor, shape) in enumerate(zip(anno.inputs, given, strict=True)):
        if not tensor.is_tensor or shape is None:
            if tensor.is_tensor:
                raise fail(f"input {i} is annotated {str(tensor)!r} but is not a tensor "
                           "(annotate it '?')", tensor.positions[0])
            shapes.append(None)
            continue
        dims = tensor.dims or ()
        fixed = len(dims) - tensor.has_star
        if shape == () and str(tensor).rstrip("^") == "1":
            shape = (1,)  # a 0-d tensor is annotated '1'
        if len(shape) != fixed and not (tensor.has_star and len(shape) > fixed):
            least = "at least " if tensor.has_star else ""
            raise fail(f"input {i} has {len(shape)} dims {list(shape)} but its annotation "
                       f"{str(tensor)!r} has {least}{fixed}", tensor.positions[0])
        if tensor.has_star:
            at = dims.index(Star())
            here = shape[at: at + len(shape) - fixed]
            if star is None:
                star, star_where = here, f"input {i}"
            elif here != star:
                raise fail(f"'*' stands for dims {list(star)} in {star_where} but {list(here)} "
                           f"in input {i}; every '*' stands for the same dims",
                           tensor.positions[at])
        shapes.append(shape)
    return shapes, star or ()


def _solve_groups(
    groups: list[_Group],
    sizes: dict[str, int],
    assign: Callable[[Ident, int, str], None],
    fail: Callable[[str, int | None], AnnotationError],
) -> None:
    """Infer group members by division until nothing changes; check every product."""
    while groups:
        pending = []
        for dim, size, i, p, pos in groups:
            unknown = [x for x in dim.idents if not x.is_number and x.name not in sizes]
            factors = [int(x.name) if x.is_number else sizes.get(x.name, 1) for x in dim.idents]
            known = math.prod(factors)
            if not unknown and known != size:
                raise fail(f"the group {dim} is {'*'.join(map(str, factors))} = {known} but dim "
                           f"{p} of input {i} has size {size}", pos)
            if len(unknown) == 1 and known > 0:
                if size % known:
                    raise fail(f"cannot infer {unknown[0].name!r}: dim {p} of input {i} has size "
                               f"{size}, which the rest of {dim} ({known}) does not divide", pos)
                assign(unknown[0], size // known, f"input {i} (inferred from {dim})")
            elif unknown:
                pending.append((dim, size, i, p, pos))
        if len(pending) == len(groups):
            dim, _, i, _, _ = pending[0]
            name = next(x for x in dim.idents if not x.is_number and x.name not in sizes)
            raise fail(f"cannot infer the size of {name.name!r} in {dim} of input {i}: "
                       f"pass {name.name}=... as a keyword argument", name.pos)
        groups = pending
