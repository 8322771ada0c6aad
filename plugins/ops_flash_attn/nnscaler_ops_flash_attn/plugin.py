"""The nnscaler plugin: registers the flash-attn operators, and flash-attention's block
kernel for nnscaler's ring attention (`nnscaler_ops_flash_attn.ring`).

Found through the entry point ``ops_flash_attn`` in the group ``nnscaler``. Each op is
registered under the name ``flash_attn.<function>`` for the raw implementation in
`nnscaler_ops_flash_attn.kernels` (what generated code calls), with the recording
wrapper of the same name exported by `nnscaler_ops_flash_attn` (what models call,
and what a running tracer records as that op) as an alias.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import nnscaler_ops_flash_attn
from nnscaler.extend import hookimpl
from nnscaler_ops_flash_attn.annotations import OPS

if TYPE_CHECKING:
    from nnscaler.extend import OpRegistry, Registry


@hookimpl
def nnscaler_register_ops(registry: OpRegistry) -> None:
    for spec in OPS:
        # the public recording wrapper is an alias: looking it up gives the same op
        wrapper = getattr(nnscaler_ops_flash_attn, spec.fn.__name__)
        registry.register(
            spec.fn,
            spec.annotation,
            name=spec.name,
            input_gen_fn=spec.input_gen_fn,
            aliases=(wrapper,),
        )


@hookimpl
def nnscaler_register_attention_kernels(registry: Registry) -> None:
    """flash-attention runs ring attention's blocks on CUDA in half precision."""
    from nnscaler_ops_flash_attn.ring import FlashBlockKernel

    kernel = FlashBlockKernel()
    registry.register(kernel.name, kernel)
