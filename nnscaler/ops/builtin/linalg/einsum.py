"""``torch.einsum``: the annotation of one call, in the equation or the sublist form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nnscaler.ops.builtin._common import is_tensor, tensor_str
from nnscaler.ops.builtin.linalg.products import bcast_dims

# -- einsum --------------------------------------------------------------------------------

_EINSUM_SLOTS = 16


def einsum_signature(
    equation, _op0=None, _op1=None, _op2=None, _op3=None, _op4=None, _op5=None, _op6=None,
    _op7=None, _op8=None, _op9=None, _op10=None, _op11=None, _op12=None, _op13=None,
    _op14=None, _op15=None,
) -> None:
    """The calling convention of ``torch.einsum``: the equation, then one slot per operand.

    ``torch.einsum(*args)`` takes its operands variadically; the annotation needs each
    operand as a parameter of its own.
    """


def _sublist_equation(args: Sequence[Any]) -> str:
    """The equation of the sublist form ``einsum(op0, [0, 1], op1, [1, 2], [0, 2])``."""

    def letters(sub: Sequence[Any]) -> str:
        out = []
        for x in sub:
            if x is Ellipsis:
                out.append("...")
            else:
                x = int(x)
                out.append(chr(ord("A") + x) if x < 26 else chr(ord("a") + x - 26))
        return "".join(out)

    terms = [letters(args[i]) for i in range(1, len(args), 2)]
    eq = ",".join(terms)
    if len(args) % 2 == 1:
        eq += "->" + letters(args[-1])
    return eq


def einsum_terms(equation: str) -> tuple[list[list[str]], list[str] | None]:
    eq = equation.replace(" ", "")
    lhs, rhs = eq.split("->") if "->" in eq else (eq, None)

    def labels(term: str) -> list[str]:
        out = []
        i = 0
        while i < len(term):
            if term.startswith("...", i):
                out.append("...")
                i += 3
            else:
                out.append(term[i])
                i += 1
        return out

    return [labels(t) for t in lhs.split(",")], None if rhs is None else labels(rhs)


def _einsum_sizes(terms: list[list[str]], operands: list[Any]
                  ) -> tuple[list[tuple[int, ...]], dict[str, int]]:
    """The dims each operand's ellipsis stands for, and the size of each label (the
    largest seen: a label of size 1 broadcasts)."""
    ell_shapes: list[tuple[int, ...]] = []
    label_size: dict[str, int] = {}
    for term, op in zip(terms, operands, strict=True):
        n_ell = op.dim() - (len(term) - term.count("..."))
        ell_shapes.append(tuple(op.shape[term.index("...") : term.index("...") + n_ell]) if "..." in term else ())
        k = 0
        for lab in term:
            if lab == "...":
                k += n_ell
                continue
            label_size[lab] = max(label_size.get(lab, 1), int(op.shape[k]))
            k += 1
    return ell_shapes, label_size


def einsum_anno(*args) -> str:
    """The annotation of one ``torch.einsum`` call (equation or sublist form): labels
    summed over are ``+``, repeated labels (diagonals) ``^``, broadcast size-1 dims ``1``."""
    if not args:
        raise TypeError("einsum() needs an equation and operands")
    if is_tensor(args[0]):  # sublist form: operands at even positions
        operands = list(args[0::2][: len(args) // 2])
        equation = _sublist_equation(args)
        slots = ["?"] * len(args)  # rewritten below for the operands
        positions = list(range(0, 2 * len(operands), 2))
        first = ""
    else:
        equation = args[0]
        operands = list(args[1:])
        positions = list(range(len(operands)))
        slots = ["?"] * len(operands)
        first = "?, "
    # einsum(eq, [a, b]): the operands come in one list, which is taken whole
    whole = len(operands) == 1 and isinstance(operands[0], (list, tuple))
    if whole:
        operands = list(operands[0])
    terms, rhs = einsum_terms(equation)
    if len(terms) != len(operands):
        raise ValueError(f"einsum equation {equation!r} has {len(terms)} operands, got {len(operands)}")
    ell_shapes, label_size = _einsum_sizes(terms, operands)
    ell_dims, ell_out = bcast_dims(ell_shapes, "_e")
    counts: dict[str, int] = {}
    for term in terms:
        for lab in term:
            counts[lab] = counts.get(lab, 0) + 1
    if rhs is None:  # implicit output: the ellipsis, then labels seen once, sorted
        rhs = (["..."] if any("..." in t for t in terms) else []) + sorted(
            lab for lab, c in counts.items() if c == 1 and lab != "..."
        )
    diagonal = {lab for t in terms for lab in t if lab != "..." and t.count(lab) > 1}
    ell_kept = "..." in rhs

    def mark(lab: str) -> str:
        if lab in diagonal:
            return "^"
        return "" if lab in rhs else "+"

    def name(lab: str) -> str:
        return lab if lab.isascii() and lab.isalpha() else f"_l{ord(lab)}"

    entries = []
    for term, op, ell in zip(terms, operands, ell_dims, strict=True):
        dims = []
        k = 0
        for lab in term:
            if lab == "...":
                dims.extend(d if d == "1" else d + ("" if ell_kept else "+") for d in ell)
                k += len(ell)
                continue
            size = int(op.shape[k])
            dims.append("1" if size == 1 and label_size[lab] != 1 else name(lab) + mark(lab))
            k += 1
        entries.append(tensor_str(dims))
    out = []
    out_shape: list[int] = []
    for lab in rhs:
        if lab == "...":
            out.extend(ell_out)
            out_shape.extend(torch.broadcast_shapes(*ell_shapes))
        else:
            out.append(name(lab) + ("^" if lab in diagonal else ""))
            out_shape.append(label_size[lab])
    if whole:
        return f"?, ? -> {tensor_str([str(n) for n in out_shape])}"
    for pos, entry in zip(positions, entries, strict=True):
        slots[pos] = entry
    return f"{first}{', '.join(slots)} -> {tensor_str(out)}"
