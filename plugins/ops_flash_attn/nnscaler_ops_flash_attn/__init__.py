"""flash-attn operators for nnscaler, with a PyTorch fallback.

Models call these functions exactly as they would call ``flash_attn``'s::

    from nnscaler_ops_flash_attn import flash_attn_func

    out = flash_attn_func(q, k, v, causal=True)   # q: (batch, seqlen, nheads, headdim)

With flash-attn installed and the tensors on CUDA, the call runs flash-attn; otherwise
a ``scaled_dot_product_attention`` fallback with the same semantics. Under the nnscaler
tracer each call is recorded as one operator (``flash_attn.flash_attn_func``, ...)
whose annotation lets the batch and the heads be split (see
`nnscaler_ops_flash_attn.annotations`); the plugin registers those operators
through the ``nnscaler_register_ops`` hook (`nnscaler_ops_flash_attn.plugin`).

``flash_attn_segmented_func`` is this plugin's own: padded and packed batches in the dense
layout (`nnscaler_ops_flash_attn.segments`). `register_hf_attention` makes all of
them a Hugging Face attention, ``attn_implementation="nnscaler_fa"``
(`nnscaler_ops_flash_attn.hf`).
"""

from __future__ import annotations

from nnscaler.extend import make_recording_wrapper
from nnscaler_ops_flash_attn import kernels
from nnscaler_ops_flash_attn.annotations import OP_NAMES
from nnscaler_ops_flash_attn.kernels import flash_attn_available

__version__ = "0.1.0"

flash_attn_func = make_recording_wrapper(kernels.flash_attn_func, OP_NAMES["flash_attn_func"])
flash_attn_varlen_func = make_recording_wrapper(
    kernels.flash_attn_varlen_func, OP_NAMES["flash_attn_varlen_func"]
)
flash_attn_qkvpacked_func = make_recording_wrapper(
    kernels.flash_attn_qkvpacked_func, OP_NAMES["flash_attn_qkvpacked_func"]
)
flash_attn_kvpacked_func = make_recording_wrapper(
    kernels.flash_attn_kvpacked_func, OP_NAMES["flash_attn_kvpacked_func"]
)
flash_attn_segmented_func = make_recording_wrapper(
    kernels.flash_attn_segmented_func, OP_NAMES["flash_attn_segmented_func"]
)

# after the wrappers: the Hugging Face attention calls them (transformers is imported only
# when register_hf_attention() runs)
from nnscaler_ops_flash_attn.hf import (  # noqa: E402
    HF_ATTENTION,
    UnsupportedAttentionError,
    register_hf_attention,
)

__all__ = [
    "HF_ATTENTION",
    "UnsupportedAttentionError",
    "__version__",
    "flash_attn_available",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_segmented_func",
    "flash_attn_varlen_func",
    "register_hf_attention",
]
