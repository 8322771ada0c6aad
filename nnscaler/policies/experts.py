"""Expert parallelism in the built-in policies: the ``expert_parallel`` option.

With ``pas_config={'expert_parallel': True}``, the ``data`` policy splits every
`moe_experts` op (an expert stack, recognised while tracing or called by the model) by its
experts as well as its tokens: device ``p`` of the scale unit holds ``E / plan_ngpus`` of
the layer's experts and exchanges tokens with the others (see
`nnscaler.ops.builtin.moe`). The rest of the model is split by the batch as always, and
the scale units are data parallel, so the expert-parallel degree is ``plan_ngpus`` and the
data-parallel degree ``runtime_ngpus``.
"""

from __future__ import annotations

from typing import Any

from nnscaler.anno import Transform
from nnscaler.ir import Op
from nnscaler.ops.builtin.moe import EXPERT_PARALLEL, FFN_PARALLEL, MOE_EXPERTS
from nnscaler.policies.common import PolicyError

__all__ = ["expert_parallel_option", "expert_transform", "ffn_transform", "is_moe",
           "require_moe_layers"]


def is_moe(op: Op) -> bool:
    return op.opdef is not None and op.opdef.name == MOE_EXPERTS


def expert_parallel_option(pas_config: Any, policy: str) -> bool:
    value = pas_config.get("expert_parallel", False)
    if not isinstance(value, bool):
        raise PolicyError(f"policy {policy!r}: pas_config['expert_parallel'] is True (split "
                          f"the experts of every MoE layer over the scale unit) or False; got "
                          f"{value!r}")
    return value


def _where(op: Op) -> str:
    layer = op.kwargs.get("layer") or op.module_path or "?"
    return f"MoE layer {layer!r} ({op.source_file}:{op.source_line})"


def expert_transform(op: Op, num: int, policy: str) -> Transform:
    """The expert-parallel split of ``op`` in ``num`` parts; a layer whose experts ``num``
    does not divide raises `PolicyError` naming it."""
    experts = op.anno.input_shapes[3][0]
    if experts % num:
        raise PolicyError(
            f"policy {policy!r}: {_where(op)} has {experts} experts, which {num} devices "
            f"cannot share evenly (expert parallel degree = plan_ngpus = {num}). Use a "
            f"plan_ngpus that divides {experts}, or set pas_config['expert_parallel'] = False")
    t = op.anno.split(3, 0, num, rules=op.opdef.rules_for(op.anno))
    if t.part_op != EXPERT_PARALLEL:  # pragma: no cover - the op's rules give it
        raise PolicyError(f"policy {policy!r}: {_where(op)} has no expert-parallel split")
    return t


def ffn_transform(op: Op, num: int, policy: str) -> Transform:
    """The tensor-parallel split of ``op`` in ``num`` parts: every expert's intermediate
    units in slices (``down_proj`` split by its last dim, ``gate_up_proj`` held as
    ``[E, 2, F, H]`` by the tracer split by ``F``, each part's gate and up rows; the parts'
    results summed). A ``gate_up_proj`` that other ops read too stays fused and whole on
    each part, which slices it (`nnscaler.trace.moe_weights`). A layer whose intermediate
    size ``num`` does not divide raises `PolicyError` naming it."""
    ffn = op.anno.input_shapes[4][2]
    if ffn % num:
        raise PolicyError(
            f"policy {policy!r}: {_where(op)} has experts of {ffn} intermediate units, which "
            f"{num} tensor-parallel devices cannot share evenly. Use a tensor-parallel size "
            f"that divides {ffn}, or split the experts themselves (expert parallelism)")
    t = op.anno.split(4, 2, num, rules=op.opdef.rules_for(op.anno))
    if t.part_op != FFN_PARALLEL:  # pragma: no cover - the op's rules give it
        raise PolicyError(f"policy {policy!r}: {_where(op)} has no tensor-parallel split")
    return t


def require_moe_layers(ops: list[Op], policy: str) -> None:
    """``expert_parallel`` with no MoE op in the graph: say which layers are recognised."""
    if not any(is_moe(op) for op in ops):
        raise PolicyError(
            f"policy {policy!r}: pas_config['expert_parallel'] is set but the model has no "
            f"MoE layer nnscaler can place: expert stacks are recognised by structure "
            f"(Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3: parameters "
            f"gate_up_proj [E, 2F, H] and down_proj [E, H, F]; a trace warning names a "
            f"module that has expert weights but does not fit), or called as "
            f"nnscaler.ops.builtin.moe.moe_experts(...) in your model's forward (docs/moe.md)")
