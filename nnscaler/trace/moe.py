"""Expert stacks found by structure while tracing: each is recorded as one
`moe_experts` op, which the policies can split by experts (expert parallelism).

An *expert stack* is the module that Hugging Face's MoE models (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, DeepSeek-V3, ...) call as ``experts(hidden, top_k_index,
top_k_weights)``: parameters ``gate_up_proj [E, 2F, H]`` (gate rows, then up rows) and
``down_proj [E, H, F]``, a gated MLP per expert, no bias. While the tracer runs, the
forward of every such module is the op (`expert_layers`); the router, its auxiliary loss
and the shared experts around it trace as they are. A module with 3-d expert weights that
breaks one of those rules, or whose forward computes something else on a probe batch
(`computes_differently`), is left as it is, with an `UnplacedExpertsWarning` naming it,
the rule and what to do: call `moe_experts` from its forward (docs/moe.md).
"""

from __future__ import annotations

import contextlib
import inspect
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from nnscaler.errors import UnplacedExpertsWarning
from nnscaler.ops.builtin.moe import ACTIVATIONS, MOE_EXPERTS, moe_experts, routed_experts
from nnscaler.ops.registry import make_recording_wrapper

__all__ = ["UnplacedExpertsWarning", "computes_differently", "expert_layers",
           "expert_stack_problem"]

#: the flags Hugging Face's ``use_experts_implementation`` sets, and the value we need
_FLAGS = {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True,
          "has_post_expert_norm": False}


def _activation(module: nn.Module) -> str | None:
    config = getattr(module, "config", None)
    name = getattr(config, "hidden_act", None)
    if isinstance(name, str) and name in ACTIVATIONS:
        return name
    act = getattr(module, "act_fn", None)
    if isinstance(act, nn.SiLU):
        return "silu"
    if isinstance(act, nn.ReLU):
        return "relu"
    if isinstance(act, nn.GELU):
        return "gelu" if act.approximate == "none" else "gelu_pytorch_tanh"
    return None


def expert_stack_problem(module: nn.Module) -> str | None:
    """Why ``module`` cannot be recorded as `moe_experts` (``None``: it can). Raises
    nothing; a module without 3-d ``gate_up_proj`` and ``down_proj`` is no expert stack."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "it has no gate_up_proj and down_proj parameters"
    if gate_up.dim() != 3 or down.dim() != 3:
        return "its gate_up_proj and down_proj are not 3-d expert stacks"
    e, two_f, h = gate_up.shape
    if two_f % 2 or tuple(down.shape) != (e, h, two_f // 2):
        return (f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} are not "
                f"[E, 2F, H] and [E, H, F]")
    for flag, want in _FLAGS.items():
        if getattr(module, flag, want) != want:
            return f"{flag}={getattr(module, flag)!r} (moe_experts needs {want!r})"
    if _activation(module) is None:
        return (f"its activation {getattr(module, 'act_fn', None)!r} is none of "
                f"{sorted(ACTIVATIONS)}")
    params = list(inspect.signature(type(module).forward).parameters)[1:]
    if len(params) < 3:
        return f"its forward takes {params}, not (hidden, top_k_index, top_k_weights)"
    return None


#: expert stacks on the meta device up to this many bytes are probed with random weights
PROBE_BYTES = 2**30


def computes_differently(module: nn.Module) -> str | None:
    """Why ``module``'s own forward is not `moe_experts` on a probe batch (``None``: the
    two agree). Names, shapes and flags cannot tell gate rows from up rows, or see a scale
    or a different combine; two tokens per expert, through both, can. Weights on the meta
    device are replaced by random ones for the probe (put back after)."""
    names = ("gate_up_proj", "down_proj")
    weights = {n: getattr(module, n) for n in names}
    meta = any(w.device.type == "meta" for w in weights.values())
    if meta and sum(w.numel() * 4 for w in weights.values()) > PROBE_BYTES:
        return None  # too large to make up; its structure matched
    gen = torch.Generator().manual_seed(0)
    e, _, h = weights["gate_up_proj"].shape
    k, tokens = min(2, e), 2 * e
    dtype = torch.float32 if meta else weights["gate_up_proj"].dtype
    device = torch.device("cpu") if meta else weights["gate_up_proj"].device
    hidden = torch.randn(tokens, h, generator=gen).to(dtype=dtype, device=device)
    index = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).to(device)
    router = torch.randn(tokens, k, generator=gen).softmax(-1).to(dtype=dtype, device=device)
    saved = dict(module._parameters)
    try:
        if meta:
            for n, w in weights.items():
                module._parameters[n] = nn.Parameter(
                    torch.randn(w.shape, generator=gen) / w.shape[-1] ** 0.5)
        with torch.no_grad():
            own = type(module).forward(module, hidden, index, router)
            ours = routed_experts(hidden, index, router, module.gate_up_proj, module.down_proj,
                                  activation=_activation(module))
    except Exception as exc:  # noqa: BLE001 - a forward that rejects the probe is not ours
        return f"its forward failed on a probe batch ({type(exc).__name__}: {exc})"
    finally:
        module._parameters.update(saved)
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    if not isinstance(own, torch.Tensor) or own.shape != ours.shape:
        return "its forward returns something other than one [tokens, hidden] tensor"
    err = float((own.float() - ours.float()).abs().max() / ours.float().abs().max().clamp_min(1e-12))
    if not err <= tol:
        return (f"its forward computes something else than moe_experts (relative difference "
                f"{err:.2g} on a probe batch; gate rows then up rows, {_activation(module)}, "
                f"weighted sum of the top-k experts)")
    return None


def _forward_as_op(module: nn.Module, path: str) -> Any:
    op = make_recording_wrapper(moe_experts, MOE_EXPERTS)
    activation = _activation(module)

    def forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.device.type == "meta":  # shapes only: the op's result
            return torch.empty_like(hidden_states)
        return op(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                  self.down_proj, activation=activation, layer=path)

    return types.MethodType(forward, module)


def _has_expert_weights(module: nn.Module) -> bool:
    """3-d ``gate_up_proj`` or ``down_proj`` tensors: an expert stack, placeable or not (a
    dense MLP's ``nn.Linear`` of those names is none)."""
    weights = [getattr(module, n, None) for n in ("gate_up_proj", "down_proj")]
    return any(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights)


@contextlib.contextmanager
def expert_layers(root: nn.Module) -> Iterator[list[str]]:
    """While the block runs, every expert stack under ``root`` runs as `moe_experts`;
    yields their module paths. Modules with expert weights that do not fit are warned
    about (`UnplacedExpertsWarning`) and left alone."""
    patched: list[tuple[nn.Module, bool, Any]] = []
    found: list[str] = []
    try:
        for path, module in root.named_modules():
            problem = expert_stack_problem(module)
            if problem is None:
                problem = computes_differently(module)
            if problem is None:
                own = "forward" in module.__dict__
                patched.append((module, own, module.__dict__.get("forward")))
                module.forward = _forward_as_op(module, path)
                found.append(path)
            elif _has_expert_weights(module):
                warnings.warn(
                    f"{path or 'the root module'} ({type(module).__name__}) has expert "
                    f"weights but cannot run as one moe_experts op: {problem}. Its experts "
                    f"stay dense (every plan keeps them whole). To place them on devices, "
                    f"call nnscaler.ops.builtin.moe.moe_experts from its forward, or "
                    f"register an op of your own with an expert-parallel rule (docs/moe.md)",
                    UnplacedExpertsWarning, stacklevel=3)
        yield found
    finally:
        for module, own, forward in reversed(patched):
            if own:
                module.forward = forward
            else:
                del module.forward
