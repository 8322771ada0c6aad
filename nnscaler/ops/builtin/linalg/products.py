"""The products of linear algebra: linear, matmul and its relatives (mm, bmm, the
``add*`` forms with a bias term, mv, dot, outer, inner, vecdot, bilinear), tensordot and
the grouped matmul of MoE experts, with the dim helpers they share.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nnscaler.anno import BoundAnno, Split, TransformRule, ValuePartial
from nnscaler.ops.builtin._common import is_tensor, tensor_str

# -- annotation helpers -----------------------------------------------------------------


def bcast_dims(shapes: Sequence[Sequence[int]], prefix: str) -> tuple[list[list[str]], list[str]]:
    """Dims of tensors whose shapes broadcast together (aligned on the right).

    Returns the dims of each tensor and of the broadcast result; a dim of size 1 that
    broadcasts against a larger one is the number ``1``.
    """
    out = list(torch.broadcast_shapes(*[tuple(s) for s in shapes])) if shapes else []
    names = [f"{prefix}{i}" for i in range(len(out))]
    per = []
    for s in shapes:
        off = len(out) - len(s)
        per.append(["1" if n == 1 and out[off + i] != 1 else names[off + i] for i, n in enumerate(s)])
    return per, names


def fit_entry(t: Any, out_dims: Sequence[str], out_shape: Sequence[int]) -> str:
    """A tensor that broadcasts to an output with dims ``out_dims``; ``?`` when not a tensor."""
    if not is_tensor(t):
        return "?"
    if t.dim() == 0:
        return "1"
    off = len(out_dims) - t.dim()
    dims = []
    for i, n in enumerate(t.shape):
        j = off + i
        dims.append("1" if n == 1 and out_shape[j] != 1 else out_dims[j])
    return tensor_str(dims)


def frozen_entry(entry: str) -> str:
    """A tensor entry with every identifier marked ``^``."""
    if entry == "?":
        return entry
    return re.sub(r"(\w+)[+^]?", r"\1^", entry)


# -- linear, matmul and relatives --------------------------------------------------------


def linear_anno(input, weight, bias=None) -> str:
    k = "k+" if bias is None else "k^"
    lead = [f"b{i}" for i in range(input.dim() - 1)]
    if weight.dim() == 1:  # input @ weight: no output features
        out = lead
        w = [k]
    else:
        out = [*lead, "n"]
        w = ["n", k]
    out_shape = [*input.shape[:-1], *weight.shape[:-1]]
    return f"{tensor_str([*lead, k])}, {tensor_str(w)}, {fit_entry(bias, out, out_shape)} -> {tensor_str(out)}"


def linear_rules(bound: BoundAnno) -> list[TransformRule]:
    """With a bias, the reduction dim still splits: the bias goes to part 0 only.

    Each part computes ``x_k @ w_k.T (+ b on part 0)``; the parts sum to the whole. The
    annotation cannot say "value-partial input", so this rule does.
    """
    shapes = bound.input_shapes
    if len(shapes) < 3 or shapes[2] is None or shapes[1] is None or len(shapes[1]) != 2:
        return []
    last = len(shapes[0]) - 1
    return [
        TransformRule(
            inputs=(Split(last), Split(1), ValuePartial()), outputs=(ValuePartial(),)
        )
    ]


def bias_rule(mat1_dim: int, mat2_dim: int) -> Callable[[BoundAnno], list[TransformRule]]:
    """``input + mat1 @ mat2`` (addmm, baddbmm, addmv): the contraction splits with
    ``input`` on part 0 only, as for linear's bias."""

    def rules(bound: BoundAnno) -> list[TransformRule]:
        if bound.input_shapes[0] is None:
            return []
        return [
            TransformRule(
                inputs=(ValuePartial(), Split(mat1_dim), Split(mat2_dim)),
                outputs=(ValuePartial(),),
            )
        ]

    return rules


def _matmul(a: torch.Tensor, b: torch.Tensor) -> tuple[str, str, str]:
    if a.dim() == 1 and b.dim() == 1:
        return "k+", "k+", "1"
    lead_a = list(a.shape[:-2])
    lead_b = list(b.shape[:-2])
    (da, db), out = bcast_dims([lead_a, lead_b], "b")
    ta = ["k+"] if a.dim() == 1 else [*da, "m", "k+"]
    tb = ["k+"] if b.dim() == 1 else [*db, "k+", "n"]
    to = [*out, *(["m"] if a.dim() > 1 else []), *(["n"] if b.dim() > 1 else [])]
    return tensor_str(ta), tensor_str(tb), tensor_str(to)


def matmul_anno(input, other) -> str:
    a, b, out = _matmul(input, other)
    return f"{a}, {b} -> {out}"


def rmatmul_anno(self, other) -> str:  # other @ self
    a, b, out = _matmul(other, self)
    return f"{b}, {a} -> {out}"


def mm_anno(input, mat2, out_dtype=None) -> str:
    return "m k+, k+ n -> m n"


def bmm_anno(input, mat2, out_dtype=None) -> str:
    return "b m k+, b k+ n -> b m n"


def _added(beta: Any) -> str:
    """The mark of a contraction whose product is added to ``beta * input``."""
    return "+" if isinstance(beta, (int, float)) and beta == 0 else "^"


def addmm_anno(input, mat1, mat2, out_dtype=None, *, beta=1, alpha=1) -> str:
    # beta * input + alpha * (mat1 @ mat2); with beta == 0 torch ignores input entirely
    k = "k" + _added(beta)
    out_shape = [mat1.shape[0], mat2.shape[1]]
    return f"{fit_entry(input, ['m', 'n'], out_shape)}, m {k}, {k} n -> m n"


def baddbmm_anno(input, batch1, batch2, out_dtype=None, *, beta=1, alpha=1) -> str:
    k = "k" + _added(beta)
    out_shape = [batch1.shape[0], batch1.shape[1], batch2.shape[2]]
    return f"{fit_entry(input, ['b', 'm', 'n'], out_shape)}, b m {k}, b {k} n -> b m n"


def addbmm_anno(input, batch1, batch2, *, beta=1, alpha=1) -> str:
    # beta * input + alpha * sum_b batch1[b] @ batch2[b]: b and k are both contracted
    mark = _added(beta)
    out_shape = [batch1.shape[1], batch2.shape[2]]
    return f"{fit_entry(input, ['m', 'n'], out_shape)}, b{mark} m k{mark}, b{mark} k{mark} n -> m n"


def addmv_anno(input, mat, vec, *, beta=1, alpha=1) -> str:
    k = "k" + _added(beta)
    return f"{fit_entry(input, ['n'], [mat.shape[0]])}, n {k}, {k} -> n"


def addr_anno(input, vec1, vec2, *, beta=1, alpha=1) -> str:
    out_shape = [vec1.shape[0], vec2.shape[0]]
    return f"{fit_entry(input, ['m', 'n'], out_shape)}, m, n -> m n"


def mv_anno(input, vec) -> str:
    return "n k+, k+ -> n"


def dot_anno(input, tensor) -> str:
    return "k+, k+ -> 1"


def vdot_anno(input, other) -> str:
    return "k+, k+ -> 1"


def outer_anno(input, vec2) -> str:
    return "m, n -> m n"


def inner_anno(input, other) -> str:
    if input.dim() == 0 or other.dim() == 0:  # a scalar times a tensor
        (da, db), out = bcast_dims([tuple(input.shape), tuple(other.shape)], "a")
        return f"{tensor_str(da)}, {tensor_str(db)} -> {tensor_str(out)}"
    da = [f"a{i}" for i in range(input.dim() - 1)]
    db = [f"b{i}" for i in range(other.dim() - 1)]
    return f"{tensor_str([*da, 'k+'])}, {tensor_str([*db, 'k+'])} -> {tensor_str([*da, *db])}"


def vecdot_anno(x, y, *, dim=-1) -> str:
    (dx, dy), out = bcast_dims([tuple(x.shape), tuple(y.shape)], "a")
    d = dim % len(out)
    name = out[d]
    dx = [n + "+" if n == name else n for n in dx]
    dy = [n + "+" if n == name else n for n in dy]
    rest = [n for i, n in enumerate(out) if i != d]
    return f"{tensor_str(dx)}, {tensor_str(dy)} -> {tensor_str(rest)}"


def bilinear_anno(input1, input2, weight, bias=None) -> str:
    # y[..., o] = sum_ij x1[..., i] A[o, i, j] x2[..., j] (+ b[o]): linear in i and in j
    mark = "+" if bias is None else "^"
    lead = [f"b{i}" for i in range(input1.dim() - 1)]
    out = [*lead, "o"]
    out_shape = [*input1.shape[:-1], weight.shape[0]]
    return (
        f"{tensor_str([*lead, 'i' + mark])}, {tensor_str([*lead, 'j' + mark])}, o i{mark} j{mark}, "
        f"{fit_entry(bias, out, out_shape)} -> {tensor_str(out)}"
    )


def tensordot_anno(a, b, dims=2) -> str:
    if is_tensor(dims):
        dims = dims.tolist()
    if isinstance(dims, int):
        da = list(range(a.dim() - dims, a.dim()))
        db = list(range(dims))
    else:
        da, db = ([d] if isinstance(d, int) else list(d) for d in dims)
    da = [d % a.dim() for d in da]
    db = [d % b.dim() for d in db]
    ta = [f"a{i}" for i in range(a.dim())]
    tb = [f"b{i}" for i in range(b.dim())]
    for j, (i, k) in enumerate(zip(da, db, strict=True)):
        ta[i] = tb[k] = f"c{j}+"
    out = [n for i, n in enumerate(ta) if i not in da] + [n for i, n in enumerate(tb) if i not in db]
    return f"{tensor_str(ta)}, {tensor_str(tb)} -> {tensor_str(out)}"


# -- grouped matmul (MoE experts) -----------------------------------------------------------


def grouped_mm_anno(self, mat2, offs=None, bias=None, out_dtype=None) -> str:
    """``torch._grouped_mm``: matmuls of groups of rows (or columns) delimited by ``offs``.

    ``offs`` holds absolute end offsets, so the jagged dim and the group dim are ``^``;
    the other matmul dims split as in a matmul. The kernels want every matrix stride to be
    a multiple of 16 bytes, so the contraction and the output columns split in blocks of
    16 bytes: ``(k+ 4)`` for float32. With a bias every dim is ``^``.
    """
    align = max(1, 16 // self.element_size())

    def blocks(name: str, size: int, mark: str = "") -> str:
        return f"({name}{mark} {align})" if align > 1 and size % align == 0 else name + mark

    a2, b2 = self.dim() == 2, mat2.dim() == 2
    k = blocks("k", self.shape[-1], "+")
    n = blocks("n", mat2.shape[-1])
    if a2 and not b2:  # (s, k) x (e, k, n), rows of a grouped by offs -> (s, n)
        a, b, o, out = f"s^ {k}", f"e^ {k} {n}", "e^", f"s^ {n}"
    elif not a2 and b2:  # (e, m, k) x (k, n), columns of b grouped by offs -> (m, n)
        a, b, o, out = f"e^ m {k}", f"{k} n^", "e^", "m n^"
    elif a2 and b2:  # (m, k) x (k, n), k grouped by offs -> (e, m, n)
        a, b, o, out = "m k^", f"k^ {n}", "e^", f"e^ m {n}"
    else:  # (e, m, k) x (e, k, n): a batched matmul
        a, b, o, out = f"e m {k}", f"e {k} {n}", "?", f"e m {n}"
    if offs is None:
        o = "?"
    if bias is not None:
        return f"{frozen_entry(a)}, {frozen_entry(b)}, {frozen_entry(o)}, ? -> {frozen_entry(out)}"
    return f"{a}, {b}, {o} -> {out}"
