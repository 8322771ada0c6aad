"""Dim annotations (``'a k+, n k+ -> a n'``) parsed into frozen values.

Grammar. Spaces between tokens are free, except that two dims need a space between them::

    annotation := inputs '->' outputs
    inputs     := [tensor (',' tensor)*]         empty for an op without inputs
    outputs    := [tensor (',' tensor)*]         empty (nnScaler's '? ->'): the op returns
                                                 None, read as one '?'
    tensor     := '?' | dim (' ' dim)*            '?': not a tensor, or taken whole
    dim        := ident | group | '*'            '*': any number of dims, maybe none
    group      := '(' ident (' ' ident)+ ')'      one dim, the product of the idents
    ident      := (name | number) mark?
    name       := a Python identifier
    number     := decimal digits                  a fixed size, never split
    mark       := '+' | '^'                       none: split; '+': split, outputs sum; '^': never

Rules checked once the structure is read, each failing with an `AnnotationError`
whose caret points at the offending token:

- an identifier has one mark wherever it appears (numbers are exempt: ``4`` and ``4^``
  may both appear) and a number takes no mark but ``^``;
- an output identifier appears in some input; numbers may appear anywhere;
- ``*`` appears at most once per tensor, takes no mark, is never inside a group, and is
  in an output only if some input has one;
- groups do not nest and have two or more members: ``(a)`` is rejected, write ``a``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs

from nnscaler.anno.errors import AnnotationError

if TYPE_CHECKING:
    from nnscaler.anno.infer import BoundAnno

__all__ = ["Reduce", "Ident", "DimAnno", "Star", "STAR", "TensorAnno", "OpAnno", "parse"]


class Reduce(enum.Enum):
    """How a dimension may be split: its mark in the annotation."""

    SPATIAL = ""
    SUM = "+"
    FROZEN = "^"


def _is_number(name: str) -> bool:
    return name.isascii() and name.isdigit()


def _check_name(_: object, __: attrs.Attribute, name: str) -> None:
    """Identifiers, numbers, and '*0', '*1', ...: the dims a '*' expands to when bound."""
    if not isinstance(name, str) or not (
        name.isidentifier() or _is_number(name) or (name[:1] == "*" and _is_number(name[1:]))
    ):
        raise ValueError(f"{name!r} is neither an identifier nor a number")


@attrs.frozen
class Ident:
    """One identifier with its mark: ``k+``. ``pos`` is its offset in the parsed text."""

    name: str = attrs.field(validator=_check_name)
    reduce: Reduce = attrs.field(default=Reduce.SPATIAL, validator=attrs.validators.instance_of(Reduce))
    pos: int | None = attrs.field(default=None, eq=False, repr=False, kw_only=True)

    @property
    def is_number(self) -> bool:
        return _is_number(self.name)

    def __str__(self) -> str:
        return self.name + self.reduce.value


def _non_empty(_: object, attribute: attrs.Attribute, value: tuple[Any, ...]) -> None:
    if not value:
        raise ValueError(f"{attribute.name} must not be empty")


@attrs.frozen
class DimAnno:
    """One tensor dimension: ``h``, or a hidden group ``(h d)`` when several idents."""

    idents: tuple[Ident, ...] = attrs.field(converter=tuple, validator=_non_empty)

    def __str__(self) -> str:
        text = " ".join(map(str, self.idents))
        return text if len(self.idents) == 1 else f"({text})"


@attrs.frozen
class Star:
    """The ``*`` dim; use the singleton `STAR`."""

    def __str__(self) -> str:
        return "*"


STAR = Star()


def _tuple_or_none(value: Sequence[Any] | None) -> tuple[Any, ...] | None:
    return None if value is None else tuple(value)


@attrs.frozen
class TensorAnno:
    """One input or output; ``dims is None`` is ``?``. ``positions``: offset of each dim.

    ``dims == ()`` (a 0-d tensor) only arises in a bound annotation, where a ``*`` stood
    for no dims; the notation writes a 0-d tensor as ``1``.
    """

    dims: tuple[DimAnno | Star, ...] | None = attrs.field(converter=_tuple_or_none)
    positions: tuple[int, ...] = attrs.field(default=(), eq=False, repr=False, kw_only=True)

    @property
    def is_tensor(self) -> bool:
        return self.dims is not None

    @property
    def has_star(self) -> bool:
        return self.dims is not None and STAR in self.dims

    @property
    def idents(self) -> tuple[Ident, ...]:
        """Every identifier, in order (none for ``?``)."""
        return tuple(x for dim in self.dims or () if isinstance(dim, DimAnno) for x in dim.idents)

    def __str__(self) -> str:
        return "?" if self.dims is None else " ".join(map(str, self.dims))


@attrs.frozen
class OpAnno:
    """A whole annotation. ``source`` is the text it was parsed from (for error carets)."""

    inputs: tuple[TensorAnno, ...] = attrs.field(converter=tuple)
    outputs: tuple[TensorAnno, ...] = attrs.field(converter=tuple, validator=_non_empty)
    source: str = attrs.field(default="", eq=False, repr=False, kw_only=True)

    def __str__(self) -> str:
        inputs, outputs = ", ".join(map(str, self.inputs)), ", ".join(map(str, self.outputs))
        return f"{inputs} -> {outputs}" if inputs else f"-> {outputs}"

    def bind(
        self, input_shapes: Sequence[Sequence[int] | None], kwargs: Mapping[str, Any] | None = None
    ) -> BoundAnno:
        """Bind to concrete input shapes; see `nnscaler.anno.infer.bind`."""
        from nnscaler.anno.infer import bind

        return bind(self, input_shapes, kwargs)

    def infer_shapes(
        self, input_shapes: Sequence[Sequence[int] | None], kwargs: Mapping[str, Any] | None = None
    ) -> tuple[tuple[int, ...] | None, ...]:
        """The output shapes (``None`` for ``?`` outputs) for these input shapes."""
        return self.bind(input_shapes, kwargs).output_shapes


# -- scanner --------------------------------------------------------------------------------


class _Token(NamedTuple):
    kind: str  # 'word', 'mark', '->', or the character itself: ( ) , * ?
    text: str
    pos: int

    @property
    def end(self) -> int:
        return self.pos + len(self.text)


def _scan(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch.isalnum() or ch == "_":
            j = i
            while j < len(text) and (text[j].isalnum() or text[j] == "_"):
                j += 1
            word = text[i:j]
            if not (word.isidentifier() or _is_number(word)):
                raise AnnotationError(
                    f"{word!r} is neither an identifier nor a number", annotation=text, position=i
                )
            tokens.append(_Token("word", word, i))
            i = j
        elif text.startswith("->", i):
            tokens.append(_Token("->", "->", i))
            i += 2
        elif ch in "(),*?+^":
            tokens.append(_Token("mark" if ch in "+^" else ch, ch, i))
            i += 1
        else:
            reason = "'-' must be part of '->'" if ch == "-" else f"unexpected character {ch!r}"
            raise AnnotationError(reason, annotation=text, position=i)
    return tokens


# -- parser ---------------------------------------------------------------------------------


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _scan(text)
        self.i = 0

    def error(self, reason: str, position: int | None) -> AnnotationError:
        return AnnotationError(reason, annotation=self.text, position=position)

    def peek(self) -> _Token | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> _Token:
        self.i += 1
        return self.tokens[self.i - 1]

    def adjacent_mark(self, after: _Token) -> _Token | None:
        """The mark written directly after ``after`` (consumed), if any."""
        tok = self.peek()
        if tok is not None and tok.kind == "mark" and tok.pos == after.end:
            return self.take()
        return None

    def annotation(self) -> OpAnno:
        arrows = [tok for tok in self.tokens if tok.kind == "->"]
        if not arrows:
            raise self.error("an annotation needs '->' between its inputs and its outputs", None)
        if len(arrows) > 1:
            raise self.error("an annotation has exactly one '->'", arrows[1].pos)
        inputs = self.side() if self.peek() != arrows[0] else ()
        self.take()  # the arrow: side() stops only there
        # no outputs: an op called for its effect, returning None (one non-tensor)
        outputs = self.side() if self.peek() is not None else (TensorAnno(None),)
        self.check(inputs, outputs)
        return OpAnno(inputs, outputs, source=self.text)

    def side(self) -> tuple[TensorAnno, ...]:
        tensors = [self.tensor()]
        while (tok := self.peek()) is not None and tok.kind == ",":
            self.take()
            tensors.append(self.tensor())
        return tuple(tensors)

    def tensor(self) -> TensorAnno:
        dims: list[DimAnno | Star] = []
        positions: list[int] = []
        question: _Token | None = None
        while (tok := self.peek()) is not None and tok.kind not in (",", "->"):
            if tok.kind == "mark":
                raise self.error(f"the mark {tok.text!r} must directly follow an identifier", tok.pos)
            if tok.kind == ")":
                raise self.error("')' has no matching '('", tok.pos)
            if dims and tok.pos == self.tokens[self.i - 1].end:
                raise self.error("dims must be separated by a space", tok.pos)
            if tok.kind == "?" or question is not None:
                bad = tok if tok.kind == "?" else question
                if dims or question is not None:
                    raise self.error("'?' stands for a whole argument: it cannot be mixed with dims", bad.pos)
                question = self.take()
                self.no_mark(question, "'?'")
                continue
            if tok.kind == "*":
                if STAR in dims:
                    raise self.error("a tensor has at most one '*'", tok.pos)
                self.no_mark(self.take(), "'*'")
                dims.append(STAR)
            elif tok.kind == "(":
                dims.append(self.group())
            else:
                dims.append(DimAnno((self.ident(),)))
            positions.append(tok.pos)
        if question is not None:
            return TensorAnno(None)
        if not dims:
            where = tok.pos if tok is not None else len(self.text)
            raise self.error("empty tensor entry: write its dims, or '?' for a non-tensor", where)
        return TensorAnno(tuple(dims), positions=tuple(positions))

    def no_mark(self, tok: _Token, what: str) -> None:
        if (mark := self.adjacent_mark(tok)) is not None:
            raise self.error(f"{what} takes no mark", mark.pos)

    def ident(self) -> Ident:
        tok = self.take()
        mark = self.adjacent_mark(tok)
        reduce = Reduce(mark.text) if mark is not None else Reduce.SPATIAL
        if mark is not None and reduce is Reduce.SUM and _is_number(tok.text):
            raise self.error(
                f"the number {tok.text} cannot be marked '+': a fixed size is never split "
                "(use '^' or no mark)",
                mark.pos,
            )
        return Ident(tok.text, reduce, pos=tok.pos)

    def group(self) -> DimAnno:
        opening = self.take()
        idents: list[Ident] = []
        while (tok := self.peek()) is None or tok.kind != ")":
            if tok is None or tok.kind in (",", "->"):
                raise self.error("'(' is never closed", opening.pos)
            if tok.kind == "(":
                raise self.error("brackets cannot nest", tok.pos)
            if tok.kind in ("*", "?"):
                raise self.error(f"{tok.text!r} cannot be inside a group", tok.pos)
            if tok.kind == "mark":
                raise self.error(f"the mark {tok.text!r} must directly follow an identifier", tok.pos)
            if idents and tok.pos == self.tokens[self.i - 1].end:
                raise self.error("dims must be separated by a space", tok.pos)
            idents.append(self.ident())
        if not idents:
            raise self.error("empty group '()'", opening.pos)
        if len(idents) == 1:
            raise self.error(
                f"a group needs two or more identifiers: write {idents[0]} for ({idents[0]})",
                opening.pos,
            )
        if (mark := self.adjacent_mark(self.take())) is not None:
            raise self.error("mark the identifiers inside the group, not the group", mark.pos)
        return DimAnno(tuple(idents))

    def check(self, inputs: tuple[TensorAnno, ...], outputs: tuple[TensorAnno, ...]) -> None:
        """The rules that span tensors: marks agree, outputs use what inputs define."""
        defined = {ident.name for tensor in inputs for ident in tensor.idents}
        input_star = any(tensor.has_star for tensor in inputs)
        first: dict[str, Ident] = {}
        for is_output, tensors in ((False, inputs), (True, outputs)):
            for tensor in tensors:
                for dim, pos in zip(tensor.dims or (), tensor.positions, strict=True):
                    if isinstance(dim, Star):
                        if is_output and not input_star:
                            raise self.error("an output has '*' but no input has one", pos)
                        continue
                    for ident in dim.idents:
                        if ident.is_number:
                            continue
                        if is_output and ident.name not in defined:
                            raise self.error(
                                f"output identifier {ident.name!r} appears in no input "
                                "(outputs may use input identifiers and numbers)",
                                ident.pos,
                            )
                        seen = first.setdefault(ident.name, ident)
                        if seen.reduce is not ident.reduce:
                            raise self.error(
                                f"{ident.name!r} has {_mark_name(ident.reduce)} here but "
                                f"{_mark_name(seen.reduce)} before; an identifier has one mark "
                                "wherever it appears",
                                ident.pos,
                            )


def _mark_name(reduce: Reduce) -> str:
    return f"'{reduce.value}'" if reduce.value else "no mark"


@functools.lru_cache(maxsize=1024)
def parse(text: str) -> OpAnno:
    """Parse an annotation; raise `AnnotationError` with a caret when it is malformed."""
    if not isinstance(text, str):
        raise TypeError(f"an annotation is a string, got {type(text).__name__}")
    return _Parser(text).annotation()
