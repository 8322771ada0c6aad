"""Dim annotations: the notation, shape inference, the transform space, the promise check.

``parse('a k+, n k+ -> a n')`` reads an annotation; ``OpAnno.bind(shapes, kwargs)`` binds
it to a call; ``BoundAnno.transform_space()`` lists the legal splits; ``check_promise``
verifies that an annotation tells the truth about its function. See docs/annotations.md.
"""

from nnscaler.anno.errors import AnnotationError, PromiseBrokenError
from nnscaler.anno.infer import BoundAnno, bind
from nnscaler.anno.parser import STAR, DimAnno, Ident, OpAnno, Reduce, Star, TensorAnno, parse
from nnscaler.anno.transform import (
    FrozenKwargs,
    Placement,
    Replicate,
    Split,
    Transform,
    TransformRule,
    ValuePartial,
)
from nnscaler.anno.verify import check_promise

__all__ = [
    "STAR",
    "AnnotationError",
    "BoundAnno",
    "DimAnno",
    "FrozenKwargs",
    "Ident",
    "OpAnno",
    "Placement",
    "PromiseBrokenError",
    "Reduce",
    "Replicate",
    "Split",
    "Star",
    "TensorAnno",
    "Transform",
    "TransformRule",
    "ValuePartial",
    "bind",
    "check_promise",
    "parse",
]
