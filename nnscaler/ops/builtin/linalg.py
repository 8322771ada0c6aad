"""Linear algebra: linear, matmul and its relatives, einsum, tensordot, grouped matmul.

Contracted dims are ``+`` (the parts of a split sum to the whole) unless a bias or an
``input`` term is added to the product, in which case splitting the contraction would add
that term once per part: then they are ``^``. Kept dims (rows, columns, batch dims) split.
Broadcast batch dims of size 1 are the number ``1``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nnscaler.anno import BoundAnno, Split, TransformRule, ValuePartial
from nnscaler.ops.builtin._common import SPLITTABLE_SIZES, is_tensor, randint, randn, tensor_str
from nnscaler.ops.registry import OpRegistry

# -- annotation helpers -----------------------------------------------------------------


def _bcast(shapes: Sequence[Sequence[int]], prefix: str) -> tuple[list[list[str]], list[str]]:
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


def _fit(t: Any, out_dims: Sequence[str], out_shape: Sequence[int]) -> str:
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


def _frozen(entry: str) -> str:
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
    return f"{tensor_str([*lead, k])}, {tensor_str(w)}, {_fit(bias, out, out_shape)} -> {tensor_str(out)}"


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


def _bias_rule(mat1_dim: int, mat2_dim: int) -> Callable[[BoundAnno], list[TransformRule]]:
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
    (da, db), out = _bcast([lead_a, lead_b], "b")
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
    return f"{_fit(input, ['m', 'n'], out_shape)}, m {k}, {k} n -> m n"


def baddbmm_anno(input, batch1, batch2, out_dtype=None, *, beta=1, alpha=1) -> str:
    k = "k" + _added(beta)
    out_shape = [batch1.shape[0], batch1.shape[1], batch2.shape[2]]
    return f"{_fit(input, ['b', 'm', 'n'], out_shape)}, b m {k}, b {k} n -> b m n"


def addbmm_anno(input, batch1, batch2, *, beta=1, alpha=1) -> str:
    # beta * input + alpha * sum_b batch1[b] @ batch2[b]: b and k are both contracted
    mark = _added(beta)
    out_shape = [batch1.shape[1], batch2.shape[2]]
    return f"{_fit(input, ['m', 'n'], out_shape)}, b{mark} m k{mark}, b{mark} k{mark} n -> m n"


def addmv_anno(input, mat, vec, *, beta=1, alpha=1) -> str:
    k = "k" + _added(beta)
    return f"{_fit(input, ['n'], [mat.shape[0]])}, n {k}, {k} -> n"


def addr_anno(input, vec1, vec2, *, beta=1, alpha=1) -> str:
    out_shape = [vec1.shape[0], vec2.shape[0]]
    return f"{_fit(input, ['m', 'n'], out_shape)}, m, n -> m n"


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
        (da, db), out = _bcast([tuple(input.shape), tuple(other.shape)], "a")
        return f"{tensor_str(da)}, {tensor_str(db)} -> {tensor_str(out)}"
    da = [f"a{i}" for i in range(input.dim() - 1)]
    db = [f"b{i}" for i in range(other.dim() - 1)]
    return f"{tensor_str([*da, 'k+'])}, {tensor_str([*db, 'k+'])} -> {tensor_str([*da, *db])}"


def vecdot_anno(x, y, *, dim=-1) -> str:
    (dx, dy), out = _bcast([tuple(x.shape), tuple(y.shape)], "a")
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
        f"{_fit(bias, out, out_shape)} -> {tensor_str(out)}"
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


# -- einsum --------------------------------------------------------------------------------

_EINSUM_SLOTS = 16


def _einsum_sig(
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


def _einsum_terms(equation: str) -> tuple[list[list[str]], list[str] | None]:
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
    terms, rhs = _einsum_terms(equation)
    if len(terms) != len(operands):
        raise ValueError(f"einsum equation {equation!r} has {len(terms)} operands, got {len(operands)}")
    ell_shapes, label_size = _einsum_sizes(terms, operands)
    ell_dims, ell_out = _bcast(ell_shapes, "_e")
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
        return f"{_frozen(a)}, {_frozen(b)}, {_frozen(o)}, ? -> {_frozen(out)}"
    return f"{a}, {b}, {o} -> {out}"


# -- input generators ----------------------------------------------------------------------


def _f64(rng: random.Random, *shape: int) -> torch.Tensor:
    return randn(rng, *shape, dtype=torch.float64)


def _sz(rng: random.Random) -> int:
    return rng.choice(SPLITTABLE_SIZES)


def _small(rng: random.Random) -> int:
    return rng.choice((1, 2, 3, 4, 6))


def gen_linear(rng: random.Random) -> tuple[tuple, dict]:
    lead = tuple(_small(rng) for _ in range(rng.randint(0, 2)))
    k, n = _sz(rng), _sz(rng)
    x = _f64(rng, *lead, k)
    if rng.random() < 0.1:  # a 1-d weight (torch takes no bias then)
        w = _f64(rng, k)
        bias = None
    else:
        w = _f64(rng, n, k)
        bias = rng.choice([None, None, _f64(rng, n), _f64(rng, 1)])
    if bias is None and rng.random() < 0.5:
        return (x, w), {}
    if rng.random() < 0.5:
        return (x, w, bias), {}
    return (x, w), {"bias": bias}


def _batch_shapes(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...]]:
    nd = rng.randint(0, 2)
    out = [rng.choice((2, 3, 4)) for _ in range(nd)]
    a = [n if rng.random() < 0.7 else 1 for n in out]
    b = [n if rng.random() < 0.7 else 1 for n in out]
    # drop leading dims of one of them sometimes
    if nd and rng.random() < 0.3:
        a = a[rng.randint(1, nd):]
    return tuple(a), tuple(b)


def gen_matmul(rng: random.Random) -> tuple[tuple, dict]:
    m, k, n = _sz(rng), _sz(rng), _sz(rng)
    ba, bb = _batch_shapes(rng)
    kind = rng.random()
    if kind < 0.1:
        a, b = _f64(rng, k), _f64(rng, k)
    elif kind < 0.2:
        a, b = _f64(rng, k), _f64(rng, *bb, k, n)
    elif kind < 0.3:
        a, b = _f64(rng, *ba, m, k), _f64(rng, k)
    else:
        a, b = _f64(rng, *ba, m, k), _f64(rng, *bb, k, n)
    if rng.random() < 0.2:
        return (a,), {"other": b}
    return (a, b), {}


def gen_rmatmul(rng: random.Random) -> tuple[tuple, dict]:
    (a, *rest), kw = gen_matmul(rng)
    b = rest[0] if rest else kw["other"]
    return (b, a), {}  # b.__rmatmul__(a) is a @ b


def gen_mm(rng: random.Random) -> tuple[tuple, dict]:
    m, k, n = _sz(rng), _sz(rng), _sz(rng)
    return (_f64(rng, m, k), _f64(rng, k, n)), {}


def gen_bmm(rng: random.Random) -> tuple[tuple, dict]:
    b, m, k, n = _small(rng), _sz(rng), _sz(rng), _sz(rng)
    return (_f64(rng, b, m, k), _f64(rng, b, k, n)), {}


def _beta_alpha(rng: random.Random) -> dict:
    kw: dict[str, Any] = {}
    r = rng.random()
    if r < 0.3:
        kw["beta"] = 0
    elif r < 0.5:
        kw["beta"] = 0.5
    if rng.random() < 0.3:
        kw["alpha"] = rng.choice((2, 0.25))
    return kw


def _bcast_to(rng: random.Random, shape: Sequence[int], full: bool) -> torch.Tensor:
    if full:
        return _f64(rng, *shape)
    nd = rng.randint(0, len(shape))
    sub = [n if rng.random() < 0.7 else 1 for n in shape[len(shape) - nd :]]
    return _f64(rng, *sub)


def _gen_add_product(shapes: tuple[Sequence[int], Sequence[int]], out: Sequence[int], full: bool):
    def gen(rng: random.Random) -> tuple[tuple, dict]:
        sizes: dict[str, int] = {}

        def size(name: str) -> int:
            if name not in sizes:
                sizes[name] = _small(rng) if name == "b" else _sz(rng)
            return sizes[name]

        a = _f64(rng, *(size(d) for d in shapes[0]))
        b = _f64(rng, *(size(d) for d in shapes[1]))
        inp = _bcast_to(rng, [size(d) for d in out], full)
        return (inp, a, b), _beta_alpha(rng)

    return gen


def gen_mv(rng: random.Random) -> tuple[tuple, dict]:
    n, k = _sz(rng), _sz(rng)
    return (_f64(rng, n, k), _f64(rng, k)), {}


def gen_vec2(rng: random.Random) -> tuple[tuple, dict]:
    k = _sz(rng)
    return (_f64(rng, k), _f64(rng, k)), {}


def gen_outer(rng: random.Random) -> tuple[tuple, dict]:
    return (_f64(rng, _sz(rng)), _f64(rng, _sz(rng))), {}


def gen_inner(rng: random.Random) -> tuple[tuple, dict]:
    if rng.random() < 0.15:
        return (_f64(rng), _f64(rng, _sz(rng), _small(rng))), {}
    k = _sz(rng)
    a = _f64(rng, *(_small(rng) for _ in range(rng.randint(0, 2))), k)
    b = _f64(rng, *(_small(rng) for _ in range(rng.randint(0, 2))), k)
    return (a, b), {}


def gen_vecdot(rng: random.Random) -> tuple[tuple, dict]:
    shape = [_sz(rng) for _ in range(rng.randint(1, 3))]
    d = rng.randrange(len(shape))
    # torch broadcasts the other dims, but not the one it contracts
    y_shape = [n if i == d or rng.random() < 0.8 else 1 for i, n in enumerate(shape)]
    kw = {}
    if d != len(shape) - 1 or rng.random() < 0.5:
        kw["dim"] = d - len(shape) if rng.random() < 0.5 else d
    return (_f64(rng, *shape), _f64(rng, *y_shape)), kw


def gen_bilinear(rng: random.Random) -> tuple[tuple, dict]:
    lead = tuple(_small(rng) for _ in range(rng.randint(1, 2)))
    i, j, o = _sz(rng), _sz(rng), _sz(rng)
    args: tuple = (_f64(rng, *lead, i), _f64(rng, *lead, j), _f64(rng, o, i, j))
    if rng.random() < 0.5:
        args = (*args, _f64(rng, o))
    return args, {}


def gen_tensordot(rng: random.Random) -> tuple[tuple, dict]:
    nc = rng.randint(0, 2)
    contracted = [_sz(rng) for _ in range(nc)]
    fa = [_small(rng) for _ in range(rng.randint(0, 2))]
    fb = [_small(rng) for _ in range(rng.randint(0, 2))]
    if rng.random() < 0.5:
        a = _f64(rng, *fa, *contracted)
        b = _f64(rng, *contracted, *fb)
        if rng.random() < 0.7:
            return (a, b), {"dims": nc}
        return (a, b, nc), {}
    # explicit dims lists, in shuffled positions
    sa = fa + contracted
    order_a = list(range(len(sa)))
    rng.shuffle(order_a)
    a_shape = [sa[i] for i in order_a]
    sb = contracted + fb
    order_b = list(range(len(sb)))
    rng.shuffle(order_b)
    b_shape = [sb[i] for i in order_b]
    da = [order_a.index(len(fa) + j) for j in range(nc)]
    db = [order_b.index(j) for j in range(nc)]
    if da and rng.random() < 0.5:
        da[0] -= len(a_shape)
    return (_f64(rng, *a_shape), _f64(rng, *b_shape)), {"dims": (da, db)}


_EINSUM_CASES = (
    "ij,jk->ik",
    "ij,kj->ik",
    "bij,bjk->bik",
    "bhld,bhsd->bhls",
    "i,i->",
    "i,j->ij",
    "ij->ji",
    "ii->i",
    "ii",
    "ij->",
    "ij",
    "ij,jk",
    "...ij,...jk->...ik",
    "...ij->...",
    "b...d,d->b...",
    "abc,cd,de->abe",
    "bn,anm,bm->ba",
    "ij,ij->ij",
)


def gen_einsum(rng: random.Random) -> tuple[tuple, dict]:
    eq = rng.choice(_EINSUM_CASES)
    terms, _ = _einsum_terms(eq)
    sizes: dict[str, int] = {}
    ell = tuple(rng.choice((1, 2, 3)) for _ in range(rng.randint(0, 2)))
    ops = []
    for term in terms:
        shape: list[int] = []
        for lab in term:
            if lab == "...":
                shape.extend(n if rng.random() < 0.8 else 1 for n in ell)
            else:
                shape.append(sizes.setdefault(lab, _sz(rng)))
        ops.append(_f64(rng, *shape))
    r = rng.random()
    if r < 0.1:  # the list form
        return (eq, ops), {}
    if r < 0.2 and "..." not in eq:  # the sublist form
        labels = sorted({lab for t in terms for lab in t})
        sub = {lab: i for i, lab in enumerate(labels)}
        args: list[Any] = []
        for term, op in zip(terms, ops, strict=True):
            args.extend([op, [sub[lab] for lab in term]])
        _, rhs = _einsum_terms(eq)
        if rhs is not None:
            args.append([sub[lab] for lab in rhs])
        return tuple(args), {}
    return (eq, *ops), {}


def _gmm_operand(rng: random.Random, *shape: int, transposed: bool = False) -> torch.Tensor:
    """A small-integer float32 tensor (exact sums), row-major or with its last two dims
    transposed in memory (MoE weights are often ``w.transpose(-2, -1)``)."""
    if not transposed:
        return randint(rng, -3, 4, *shape).to(torch.float32)
    t = randint(rng, -3, 4, *shape[:-2], shape[-1], shape[-2]).to(torch.float32)
    return t.transpose(-2, -1)


def _gmm_offs(rng: random.Random, e: int, total: int) -> torch.Tensor:
    cuts = sorted(rng.randint(0, total) for _ in range(e - 1))
    return torch.tensor([*cuts, total], dtype=torch.int32)


def gen_grouped_mm(rng: random.Random) -> tuple[tuple, dict]:
    four = (4, 8, 12)
    e = rng.choice((1, 2, 3, 4))
    k, n, m = rng.choice(four), rng.choice(four), rng.choice(four)
    mode = rng.random()
    tb = rng.random() < 0.5
    if mode < 0.55:  # the MoE forward: tokens sorted by expert
        a = _gmm_operand(rng, m, k, transposed=rng.random() < 0.3)  # m is a multiple of 4
        b = _gmm_operand(rng, e, k, n, transposed=tb)
        offs = _gmm_offs(rng, e, m)
    elif mode < 0.7:
        a = _gmm_operand(rng, e, m, k)
        b = _gmm_operand(rng, k, n, transposed=tb)
        offs = _gmm_offs(rng, e, n)
    elif mode < 0.85:
        a = _gmm_operand(rng, m, k)
        b = _gmm_operand(rng, k, n, transposed=tb)
        offs = _gmm_offs(rng, e, k)
    else:
        return (_gmm_operand(rng, e, m, k), _gmm_operand(rng, e, k, n, transposed=tb)), {}
    if rng.random() < 0.3:
        return (a, b, offs), {}
    return (a, b), {"offs": offs}


# -- registration --------------------------------------------------------------------------


def register(registry: OpRegistry) -> None:
    T = torch.Tensor
    r = registry.register
    r(torch.nn.functional.linear, linear_anno, name="torch.nn.functional.linear",
      transform_rules=linear_rules,
      input_gen_fn=gen_linear)
    r(torch.matmul, matmul_anno, name="torch.matmul",
      aliases=(T.matmul, T.__matmul__, torch.linalg.matmul), input_gen_fn=gen_matmul)
    r(T.__rmatmul__, rmatmul_anno, name="torch.Tensor.__rmatmul__", input_gen_fn=gen_rmatmul)
    r(torch.mm, mm_anno, name="torch.mm", aliases=(T.mm,), input_gen_fn=gen_mm)
    r(torch.bmm, bmm_anno, name="torch.bmm", aliases=(T.bmm,), input_gen_fn=gen_bmm)
    mk = ("m", "k"), ("k", "n")
    bmk = ("b", "m", "k"), ("b", "k", "n")
    r(torch.addmm, addmm_anno, name="torch.addmm", aliases=(T.addmm,),
      transform_rules=_bias_rule(1, 0),
      input_gen_fn=_gen_add_product(mk, ("m", "n"), False))
    r(T.addmm_, addmm_anno, name="torch.Tensor.addmm_",
      input_gen_fn=_gen_add_product(mk, ("m", "n"), True))
    r(torch.baddbmm, baddbmm_anno, name="torch.baddbmm", aliases=(T.baddbmm,),
      transform_rules=_bias_rule(2, 1),
      input_gen_fn=_gen_add_product(bmk, ("b", "m", "n"), False))
    r(T.baddbmm_, baddbmm_anno, name="torch.Tensor.baddbmm_",
      input_gen_fn=_gen_add_product(bmk, ("b", "m", "n"), True))
    r(torch.addbmm, addbmm_anno, name="torch.addbmm", aliases=(T.addbmm,),
      input_gen_fn=_gen_add_product(bmk, ("m", "n"), False))
    r(T.addbmm_, addbmm_anno, name="torch.Tensor.addbmm_",
      input_gen_fn=_gen_add_product(bmk, ("m", "n"), True))
    r(torch.addmv, addmv_anno, name="torch.addmv", aliases=(T.addmv,),
      transform_rules=_bias_rule(1, 0),
      input_gen_fn=_gen_add_product((("n", "k"), ("k",)), ("n",), False))
    r(T.addmv_, addmv_anno, name="torch.Tensor.addmv_",
      input_gen_fn=_gen_add_product((("n", "k"), ("k",)), ("n",), True))
    r(torch.addr, addr_anno, name="torch.addr", aliases=(T.addr,),
      input_gen_fn=_gen_add_product((("m",), ("n",)), ("m", "n"), False))
    r(T.addr_, addr_anno, name="torch.Tensor.addr_",
      input_gen_fn=_gen_add_product((("m",), ("n",)), ("m", "n"), True))
    r(torch.mv, mv_anno, name="torch.mv", aliases=(T.mv,), input_gen_fn=gen_mv)
    r(torch.dot, dot_anno, name="torch.dot", aliases=(T.dot,), input_gen_fn=gen_vec2)
    r(torch.vdot, vdot_anno, name="torch.vdot", aliases=(T.vdot,), input_gen_fn=gen_vec2)
    r(torch.outer, outer_anno, name="torch.outer",
      aliases=(T.outer, torch.ger, T.ger), input_gen_fn=gen_outer)
    r(torch.inner, inner_anno, name="torch.inner", aliases=(T.inner,), input_gen_fn=gen_inner)
    r(torch.linalg.vecdot, vecdot_anno, name="torch.linalg.vecdot", input_gen_fn=gen_vecdot)
    r(torch.bilinear, bilinear_anno, name="torch.nn.functional.bilinear",
      input_gen_fn=gen_bilinear)
    r(torch.tensordot, tensordot_anno, name="torch.tensordot", input_gen_fn=gen_tensordot)
    r(torch.einsum, einsum_anno, name="torch.einsum", signature=_einsum_sig,
      input_gen_fn=gen_einsum)
    if hasattr(torch, "_grouped_mm"):
        r(torch._grouped_mm, grouped_mm_anno, name="torch._grouped_mm",
          input_gen_fn=gen_grouped_mm)
