"""The functions of nnscaler's own that generated code calls, under one public name.

Generated files (``gencode{rank}.py``) import ``torch`` and the public runtime only:
when a plan calls one of nnscaler's op implementations (a part of a split op that needs
other code than the op itself), the file calls it as ``nnscaler.runtime.ops.<name>``.

- `row_parallel_embedding`: ``F.embedding`` on a block of rows of the table (the
  vocabulary-parallel embedding: tokens outside the block give zeros, the parts sum);
- `class_parallel_cross_entropy`: ``F.cross_entropy`` on a block of classes, the
  parts exchanging their normalizers through ``group`` (the vocabulary-parallel loss);
- `context_parallel_attention`: ``F.scaled_dot_product_attention`` on a chunk of the
  sequence, the parts passing keys and values through ``group`` (ring, zigzag, Ulysses);
- `routed_experts` / `expert_parallel_moe` / `ffn_parallel_moe`: the routed experts of an
  MoE layer, whole, split over the parts of ``group`` (expert parallelism, tokens
  exchanged all-to-all), or on a slice of every expert's intermediate units (tensor
  parallelism inside the experts);
- `token_parallel_cross_entropy`: a mean ``F.cross_entropy`` on a slice of the tokens,
  the parts all-reducing their sums and counts.

Their implementations live with their annotations in `nnscaler.ops.builtin`; this
module only names them (a test checks that every nnscaler function registered as an op
is here).
"""

from nnscaler.ops.builtin.context_parallel import context_parallel_attention
from nnscaler.ops.builtin.loss import class_parallel_cross_entropy
from nnscaler.ops.builtin.moe import expert_parallel_moe, ffn_parallel_moe, routed_experts
from nnscaler.ops.builtin.nn import row_parallel_embedding
from nnscaler.ops.builtin.token_loss import token_parallel_cross_entropy

__all__ = [
    "class_parallel_cross_entropy",
    "context_parallel_attention",
    "expert_parallel_moe",
    "ffn_parallel_moe",
    "routed_experts",
    "row_parallel_embedding",
    "token_parallel_cross_entropy",
]
