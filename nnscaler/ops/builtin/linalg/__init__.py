"""Linear algebra: linear, matmul and its relatives, einsum, tensordot, grouped matmul.

Contracted dims are ``+`` (the parts of a split sum to the whole) unless a bias or an
``input`` term is added to the product, in which case splitting the contraction would add
that term once per part: then they are ``^``. Kept dims (rows, columns, batch dims) split.
Broadcast batch dims of size 1 are the number ``1``. The input generators the promise
test draws from are in `nnscaler.ops.builtin.linalg_inputs`.

By role: `products` (linear, matmul and its relatives, tensordot, grouped matmul, and
the dim helpers they share), `einsum` (``torch.einsum`` in both its forms), and
`input_gens` (the random inputs the promise test draws); ``register`` below registers
them all.
"""

from __future__ import annotations

import torch

from nnscaler.ops.builtin.linalg.einsum import einsum_anno, einsum_signature
from nnscaler.ops.builtin.linalg.input_gens import (
    gen_add_product,
    gen_bilinear,
    gen_bmm,
    gen_einsum,
    gen_grouped_mm,
    gen_inner,
    gen_linear,
    gen_matmul,
    gen_mm,
    gen_mv,
    gen_outer,
    gen_rmatmul,
    gen_tensordot,
    gen_vec2,
    gen_vecdot,
)
from nnscaler.ops.builtin.linalg.products import (
    addbmm_anno,
    addmm_anno,
    addmv_anno,
    addr_anno,
    baddbmm_anno,
    bias_rule,
    bilinear_anno,
    bmm_anno,
    dot_anno,
    grouped_mm_anno,
    inner_anno,
    linear_anno,
    linear_rules,
    matmul_anno,
    mm_anno,
    mv_anno,
    outer_anno,
    rmatmul_anno,
    tensordot_anno,
    vdot_anno,
    vecdot_anno,
)
from nnscaler.ops.registry import OpRegistry

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
      transform_rules=bias_rule(1, 0),
      input_gen_fn=gen_add_product(mk, ("m", "n"), False))
    r(T.addmm_, addmm_anno, name="torch.Tensor.addmm_",
      input_gen_fn=gen_add_product(mk, ("m", "n"), True))
    r(torch.baddbmm, baddbmm_anno, name="torch.baddbmm", aliases=(T.baddbmm,),
      transform_rules=bias_rule(2, 1),
      input_gen_fn=gen_add_product(bmk, ("b", "m", "n"), False))
    r(T.baddbmm_, baddbmm_anno, name="torch.Tensor.baddbmm_",
      input_gen_fn=gen_add_product(bmk, ("b", "m", "n"), True))
    r(torch.addbmm, addbmm_anno, name="torch.addbmm", aliases=(T.addbmm,),
      input_gen_fn=gen_add_product(bmk, ("m", "n"), False))
    r(T.addbmm_, addbmm_anno, name="torch.Tensor.addbmm_",
      input_gen_fn=gen_add_product(bmk, ("m", "n"), True))
    r(torch.addmv, addmv_anno, name="torch.addmv", aliases=(T.addmv,),
      transform_rules=bias_rule(1, 0),
      input_gen_fn=gen_add_product((("n", "k"), ("k",)), ("n",), False))
    r(T.addmv_, addmv_anno, name="torch.Tensor.addmv_",
      input_gen_fn=gen_add_product((("n", "k"), ("k",)), ("n",), True))
    r(torch.addr, addr_anno, name="torch.addr", aliases=(T.addr,),
      input_gen_fn=gen_add_product((("m",), ("n",)), ("m", "n"), False))
    r(T.addr_, addr_anno, name="torch.Tensor.addr_",
      input_gen_fn=gen_add_product((("m",), ("n",)), ("m", "n"), True))
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
    r(torch.einsum, einsum_anno, name="torch.einsum", signature=einsum_signature,
      input_gen_fn=gen_einsum)
    if hasattr(torch, "_grouped_mm"):
        r(torch._grouped_mm, grouped_mm_anno, name="torch._grouped_mm",
          input_gen_fn=gen_grouped_mm)
