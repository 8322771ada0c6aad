"""Megatron-LM's parallel sizes, read from ``pas_config`` and checked against the compute
config.

Megatron describes a run by its parallel sizes; nnscaler by a scale unit
(``plan_ngpus`` devices that hold one copy of the model) replicated
``runtime_ngpus / plan_ngpus`` times. They map one to one:

- ``plan_ngpus = tensor_model_parallel_size * context_parallel_size *
  pipeline_model_parallel_size``;
- ``data_parallel = runtime_ngpus / plan_ngpus`` (the rest of the devices);
- ``use_distributed_optimizer`` is ZeRO stage 1 over the data-parallel replicas:
  ``ComputeConfig.use_zero``;
- ``expert_model_parallel_size`` splits the experts of every MoE layer over the
  tensor-parallel devices of its pipeline rank, so it is 1 or
  ``tensor_model_parallel_size`` (Megatron-Core shards experts over data-parallel ranks;
  here the data-parallel replicas are whole copies of the scale unit, so the experts
  share the devices of the tensor-parallel group instead);
- ``context_parallel_size`` splits the sequence of every op of a pipeline stage over
  that many devices (the ``sequence`` policy's split: ring attention, zigzag when
  causal); ``cp_comm_type`` is Megatron's ``'p2p'`` (the ring, the default) or
  ``'a2a'`` (Ulysses). With ``tensor_model_parallel_size > 1`` each tensor-parallel
  part (attention's heads first; with ``sequence_parallel`` the ops between blocks by
  the sequence too) is split along the sequence over its own context-parallel devices.

`megatron_compute_config` builds the [`ComputeConfig`][nnscaler.ComputeConfig] from the
Megatron sizes; the policy checks that the compute config it receives agrees with
``pas_config`` and says what to change when it does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from nnscaler.extend import ComputeConfig, ComputeConfigError, PolicyError, as_compute_config

__all__ = ["MegatronConfig", "MegatronConfigError", "megatron_compute_config", "read_config"]

_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
         "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
         "sequence_parallel", "data_parallel", "use_distributed_optimizer",
         "expert_model_parallel_size", "context_parallel_size", "cp_comm_type")
#: Megatron's ``cp_comm_type`` -> the ``sequence`` policy's attention strategy
CP_COMM_TYPES = {"p2p": "ring", "a2a": "ulysses"}


class MegatronConfigError(PolicyError):
    """``pas_config`` of the ``megatron`` policy that cannot work with the compute config."""


@attrs.frozen(kw_only=True)
class MegatronConfig:
    """The checked Megatron sizes of one run."""

    tp: int
    pp: int
    vpp: int | None  # None: derived from num_layers_per_virtual_pipeline_stage
    layers_per_virtual_stage: int | None
    sequence_parallel: bool
    dp: int
    distributed_optimizer: bool
    ep: int = 1
    cp: int = 1
    cp_strategy: str = "ring"  # the sequence policy's attention strategy

    @property
    def plan_ngpus(self) -> int:
        return self.tp * self.cp * self.pp


def _int(cfg: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MegatronConfigError(
            f"policy 'megatron': pas_config[{key!r}] must be a positive int, got {value!r}"
        )
    return value


def _bool(cfg: Mapping[str, Any], key: str) -> bool:
    value = cfg.get(key, False)
    if not isinstance(value, bool):
        raise MegatronConfigError(
            f"policy 'megatron': pas_config[{key!r}] must be True or False, got {value!r}"
        )
    return value


def read_config(compute_config: ComputeConfig) -> MegatronConfig:
    """The Megatron sizes of ``compute_config.pas_config``, checked against
    ``plan_ngpus``, ``runtime_ngpus`` and ``use_zero``.

    ``tensor_model_parallel_size`` defaults to ``plan_ngpus / (context_parallel_size *
    pipeline_model_parallel_size)`` (so ``{}`` means tensor parallelism over the whole
    scale unit).
    """
    try:
        config = as_compute_config(compute_config)
    except ComputeConfigError as e:
        raise MegatronConfigError(
            f"policy 'megatron': {e}. Build the config with "
            f"nnscaler_policy_megatron.megatron_compute_config(...)"
        ) from None
    plan, runtime, cfg = config.plan_ngpus, config.runtime_ngpus, config.pas_config
    pp = _int(cfg, "pipeline_model_parallel_size", 1) or 1
    cp = _int(cfg, "context_parallel_size", 1) or 1
    tp = _int(cfg, "tensor_model_parallel_size",
              plan // (pp * cp) if plan % (pp * cp) == 0 else None)
    if tp is None or tp * cp * pp != plan:
        raise MegatronConfigError(
            f"policy 'megatron': a scale unit holds one copy of the model, so plan_ngpus "
            f"must be tensor_model_parallel_size * context_parallel_size * "
            f"pipeline_model_parallel_size; got plan_ngpus={plan}, "
            f"tensor_model_parallel_size={tp}, context_parallel_size={cp}, "
            f"pipeline_model_parallel_size={pp}. Set plan_ngpus={(tp or 1) * cp * pp} or "
            f"change the sizes (megatron_compute_config(...) computes plan_ngpus for you)"
        )
    cp_strategy = _cp_strategy(cfg, tp, cp)
    vpp = _int(cfg, "virtual_pipeline_model_parallel_size", None)
    per_stage = _int(cfg, "num_layers_per_virtual_pipeline_stage", None)
    if vpp is not None and per_stage is not None:
        raise MegatronConfigError(
            "policy 'megatron': give virtual_pipeline_model_parallel_size or "
            "num_layers_per_virtual_pipeline_stage, not both (as in Megatron-LM)"
        )
    if (vpp or 1) > 1 or per_stage is not None:
        if pp == 1:
            raise MegatronConfigError(
                "policy 'megatron': virtual pipeline stages need "
                "pipeline_model_parallel_size > 1; got pipeline_model_parallel_size=1"
            )
    units = runtime // plan if runtime % plan == 0 else None
    dp = _int(cfg, "data_parallel", units)
    if units is None or dp != units:
        raise MegatronConfigError(
            f"policy 'megatron': data_parallel is the number of scale units, "
            f"runtime_ngpus / plan_ngpus = {runtime} / {plan}; pas_config says "
            f"data_parallel={dp}. Set runtime_ngpus={plan * (dp or 1)}, or leave "
            f"data_parallel out"
        )
    distributed = _bool(cfg, "use_distributed_optimizer")
    use_zero = config.use_zero
    if distributed != use_zero:
        raise MegatronConfigError(
            f"policy 'megatron': use_distributed_optimizer shards the optimizer state over "
            f"the data-parallel replicas, which is ComputeConfig.use_zero (ZeRO stage 1); "
            f"pas_config says use_distributed_optimizer={distributed} but use_zero="
            f"{use_zero}. Set ComputeConfig(use_zero={distributed}) (megatron_compute_config "
            f"does it)"
        )
    sp = _bool(cfg, "sequence_parallel")
    if sp and tp == 1:
        raise MegatronConfigError(
            "policy 'megatron': sequence_parallel splits the ops between transformer blocks "
            "over the tensor-parallel devices, so it needs tensor_model_parallel_size > 1; "
            "got tensor_model_parallel_size=1. Drop sequence_parallel or raise the size"
        )
    ep = _int(cfg, "expert_model_parallel_size", 1) or 1
    if ep not in (1, tp):
        raise MegatronConfigError(
            f"policy 'megatron': expert_model_parallel_size splits the experts over the "
            f"tensor-parallel devices, so it is 1 or tensor_model_parallel_size={tp}; got "
            f"{ep}. Set expert_model_parallel_size={tp} (or tensor_model_parallel_size="
            f"{ep})")
    _check_with_context(cp=cp, ep=ep)
    return MegatronConfig(tp=tp, pp=pp, vpp=vpp, layers_per_virtual_stage=per_stage,
                          sequence_parallel=sp, dp=dp, distributed_optimizer=distributed,
                          ep=ep, cp=cp, cp_strategy=cp_strategy)


def _check_with_context(*, cp: int, ep: int) -> None:
    """What does not combine with context parallelism."""
    if ep > 1 and cp > 1:
        raise MegatronConfigError(
            f"policy 'megatron': expert_model_parallel_size={ep} with context_parallel_size="
            f"{cp} is not planned (the experts' all-to-all has not been checked on sequence "
            f"chunks). Set expert_model_parallel_size=1 (each expert is then split by its "
            f"intermediate units over the tensor-parallel devices), or context_parallel_size=1")


def _cp_strategy(cfg: Mapping[str, Any], tp: int, cp: int) -> str:
    """The attention strategy of ``cp_comm_type``."""
    comm = cfg.get("cp_comm_type", "p2p")
    if comm not in CP_COMM_TYPES:
        raise MegatronConfigError(
            f"policy 'megatron': cp_comm_type is one of {sorted(CP_COMM_TYPES)} ('p2p': "
            f"ring attention, zigzag when causal; 'a2a': Ulysses), got {comm!r}")
    return CP_COMM_TYPES[comm]


def megatron_compute_config(*, tensor_model_parallel_size: int = 1,
                            pipeline_model_parallel_size: int = 1,
                            data_parallel: int = 1,
                            virtual_pipeline_model_parallel_size: int | None = None,
                            num_layers_per_virtual_pipeline_stage: int | None = None,
                            sequence_parallel: bool = False,
                            use_distributed_optimizer: bool = False,
                            expert_model_parallel_size: int = 1,
                            context_parallel_size: int = 1,
                            cp_comm_type: str = "p2p",
                            pas_config: Mapping[str, Any] | None = None,
                            **compute_config: Any) -> ComputeConfig:
    """A [`ComputeConfig`][nnscaler.ComputeConfig] for the ``megatron`` policy from Megatron's
    sizes: ``plan_ngpus = tp * cp * pp``, ``runtime_ngpus = plan_ngpus * data_parallel``,
    ``use_zero = use_distributed_optimizer``; ``pas_config`` adds other keys (for a
    pipeline: ``pipeline_nmicros``, ``pipeline_scheduler``, which is
    ``'1f1b_interleaved'`` by default with virtual stages), ``compute_config`` other
    ``ComputeConfig`` fields (``use_end2end``, ...)."""

    sizes: dict[str, Any] = {
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "data_parallel": data_parallel,
        "sequence_parallel": sequence_parallel,
        "use_distributed_optimizer": use_distributed_optimizer,
        "expert_model_parallel_size": expert_model_parallel_size,
    }
    if context_parallel_size != 1 or cp_comm_type != "p2p":
        sizes.update(context_parallel_size=context_parallel_size, cp_comm_type=cp_comm_type)
    if virtual_pipeline_model_parallel_size is not None:
        sizes["virtual_pipeline_model_parallel_size"] = virtual_pipeline_model_parallel_size
    if num_layers_per_virtual_pipeline_stage is not None:
        sizes["num_layers_per_virtual_pipeline_stage"] = num_layers_per_virtual_pipeline_stage
    vpp = virtual_pipeline_model_parallel_size or 1
    if (vpp > 1 or num_layers_per_virtual_pipeline_stage is not None) and \
            "pipeline_scheduler" not in (pas_config or {}):
        sizes["pipeline_scheduler"] = "1f1b_interleaved"  # Megatron's schedule for them
    plan = tensor_model_parallel_size * context_parallel_size * pipeline_model_parallel_size
    return ComputeConfig(plan_ngpus=plan, runtime_ngpus=plan * data_parallel,
                         use_zero=use_distributed_optimizer,
                         pas_config={**(pas_config or {}), **sizes}, **compute_config)
