"""``ParallelModule``: the base class of every generated ``GenModel``.

A generated class sets the class attributes (``rank``, ``plan_ngpus``,
``runtime_ngpus``, ``end2end``, ``inference_only``, ``process_groups``,
``reducer_groups``, ``reducer_config``), registers this rank's piece of every parameter,
buffer and constant with `add_param`,
`add_buffer` and `add_constant`, and calls
`_post_init`, which loads the initial values from ``fullmodel.pt``
beside the generated file, creates the process groups (every rank, the same list, in the
same order) and one `Reducer` per set of ranks that hold the
same parameter pieces.

Gradients are summed, never averaged: over the devices of a scale unit (they hold shares
of a replicated piece's gradient), over scale units (different samples) and over
micro-batches in [`train_step`][nnscaler.ParallelModule.train_step]. See ``docs/codegen.md``.

A pipelined module (class attribute ``pipeline``, see `nnscaler.runtime.pipeline`
and ``docs/pipeline.md``) has one method per stage instead of ``_forward_impl``; its
[`train_step`][nnscaler.ParallelModule.train_step] and
[`infer_step`][nnscaler.ParallelModule.infer_step] run the schedule.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from nnscaler.config import ReducerConfig
from nnscaler.errors import ParallelModuleError
from nnscaler.gendir import FULLMODEL, gencode_name
from nnscaler.runtime import zero3_state
from nnscaler.runtime.device import current_device
from nnscaler.runtime.groups import ensure_groups
from nnscaler.runtime.partgroup import ProcessPartGroup
from nnscaler.runtime.reducer import Reducer
from nnscaler.runtime.zero3 import Zero3Runner, unit_of

if TYPE_CHECKING:
    from nnscaler.runtime.pipeline import Pipeline

__all__ = ["AttrMeta", "ParallelModule", "ParallelModuleError"]


@attrs.frozen(kw_only=True)
class AttrMeta:
    """What one attribute of a parallel module holds: a piece of an original tensor.

    - ``attr``: the attribute name (``gpt_blocks_0_attn_q_proj_weight``);
    - ``kind``: ``"parameter"``, ``"buffer"`` or ``"constant"`` (a tensor the model
      captured, saved in ``fullmodel.pt`` under ``orig_name``);
    - ``orig_name``: the original qualified name (``gpt.blocks.0.attn.q_proj.weight``) and
      ``names``: all of them (tied parameters have several);
    - ``shape``: the full tensor's shape; ``index``: the ``(start, stop)`` range per dim
      of the piece; ``value``: ``(part, nparts)``, the piece holds one of ``nparts``
      summands (``(0, 1)``: the value itself);
    - ``holders``: the runtime ranks that hold the same piece (their gradients sum to its
      gradient); ``persistent``: for buffers, whether it is in the state dict;
    - ``model_shape``: for a parameter the plan holds reshaped (an expert ``gate_up_proj
      [E, 2F, H]`` as ``[E, 2, F, H]``, see `nnscaler.trace.moe_weights`), the module's
      own shape, in which checkpoints hold it (None: ``shape``); ``index`` is a box of
      ``shape``.
    """

    attr: str
    kind: str
    orig_name: str
    names: tuple[str, ...]
    shape: tuple[int, ...]
    index: tuple[tuple[int, int], ...]
    value: tuple[int, int] = (0, 1)
    dtype: torch.dtype
    holders: tuple[int, ...] = ()
    persistent: bool = True
    model_shape: tuple[int, ...] | None = None

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of ``full``, the whole tensor in ``shape`` or in ``model_shape``."""
        if self.model_shape is not None and tuple(full.shape) == self.model_shape:
            full = full.reshape(self.shape)
        return full[self.slicers]

    @property
    def slicers(self) -> tuple[slice, ...]:
        """``index`` as slices of the full tensor."""
        return tuple(slice(a, b) for a, b in self.index)

    @property
    def sub_shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.index)

    @property
    def val_chunks(self) -> int:
        return self.value[1]


def first_output(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(out, dict) and out:
        first = next(iter(out.values()))
        if isinstance(first, torch.Tensor):
            return first
    raise ParallelModuleError(
        f"train_step: the first output of an end2end module is its loss (a scalar tensor), "
        f"but forward returned {type(out).__name__}; return the loss first"
    )


def _detach(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


class ParallelModule(torch.nn.Module):
    """The base class of generated modules; see the module docstring."""

    rank: int = 0
    plan_ngpus: int = 1
    runtime_ngpus: int = 1
    end2end: bool = False
    inference_only: bool = False
    process_groups: Sequence[tuple[int, ...]] = ()
    reducer_groups: Sequence[tuple[int, ...]] = ()
    reducer_config: dict[str, Any] = {}  # noqa: RUF012 - set by each generated class
    pipeline: Pipeline | None = None  # the stages and schedule of a pipelined module
    #: ``torch.compile``'s keywords when generated with ``ComputeConfig(compile=...)``
    compile_config: dict[str, Any] | None = None

    def __init__(self, init_params: bool = True) -> None:
        super().__init__()
        self.fullmap: dict[str, AttrMeta] = {}
        self._reducers: list[Reducer] = []
        self._part_groups: dict[tuple[int, ...], ProcessPartGroup] = {}
        self._device = current_device()
        self._zero3: Zero3Runner | None = None  # stage 3: gathers the parameters' units

    # -- registration (called by the generated __init__) --------------------------------
    @property
    def device(self) -> torch.device:
        """The device this rank computes on: where its pieces live (they start on
        `nnscaler.runtime.current_device` and follow ``.to()``)."""
        for t in self.parameters():
            return t.device
        for t in self.buffers():
            return t.device
        return self._device

    def part_group(self, devices: Sequence[int]) -> ProcessPartGroup:
        """The parts of a split run by the plan devices ``devices`` (in part order) of this
        rank's scale unit: the ``group`` generated code passes to a collective part op."""
        key = tuple(devices)
        if key not in self._part_groups:
            offset = (self.rank // self.plan_ngpus) * self.plan_ngpus
            self._part_groups[key] = ProcessPartGroup([offset + d for d in key], rank=self.rank)
        return self._part_groups[key]

    def _piece(self, shape: Sequence[int], index: Sequence[tuple[int, int]],
               dtype: torch.dtype) -> torch.Tensor:
        sub = tuple(b - a for a, b in index)
        if len(sub) != len(tuple(shape)):
            raise ParallelModuleError(f"a piece needs one (start, stop) range per dim of the "
                                      f"full shape {tuple(shape)}, got {tuple(index)}")
        return torch.empty(sub, dtype=dtype, device=self._device)

    def _meta(self, kind: str, attr: str, name: str, names: Sequence[str] | None,
              shape: Sequence[int], index: Sequence[tuple[int, int]], value: tuple[int, int],
              dtype: torch.dtype, holders: Sequence[int], persistent: bool,
              model_shape: Sequence[int] | None = None) -> None:
        self.fullmap[attr] = AttrMeta(
            attr=attr, kind=kind, orig_name=name, names=tuple(names or (name,)),
            shape=tuple(shape), index=tuple((int(a), int(b)) for a, b in index),
            value=(int(value[0]), int(value[1])), dtype=dtype,
            holders=tuple(sorted(int(r) for r in holders)), persistent=persistent,
            model_shape=None if model_shape is None else tuple(int(n) for n in model_shape),
        )

    def add_param(self, attr: str, name: str, *, names: Sequence[str] | None = None,
                  shape: Sequence[int], index: Sequence[tuple[int, int]],
                  value: tuple[int, int] = (0, 1), dtype: torch.dtype,
                  holders: Sequence[int], requires_grad: bool = True,
                  model_shape: Sequence[int] | None = None) -> None:
        """Register this rank's piece of the parameter ``name`` as ``self.<attr>``
        (``model_shape``: the module's shape of a parameter held reshaped)."""
        piece = torch.nn.Parameter(self._piece(shape, index, dtype), requires_grad=requires_grad)
        self.register_parameter(attr, piece)
        self._meta("parameter", attr, name, names, shape, index, value, dtype, holders, True,
                   model_shape)

    def add_buffer(self, attr: str, name: str, *, names: Sequence[str] | None = None,
                   shape: Sequence[int], index: Sequence[tuple[int, int]],
                   value: tuple[int, int] = (0, 1), dtype: torch.dtype,
                   persistent: bool = True) -> None:
        """Register this rank's piece of the buffer ``name`` as ``self.<attr>``."""
        self.register_buffer(attr, self._piece(shape, index, dtype), persistent=persistent)
        self._meta("buffer", attr, name, names, shape, index, value, dtype, (), persistent)

    def add_constant(self, attr: str, name: str, *, shape: Sequence[int],
                     index: Sequence[tuple[int, int]], value: tuple[int, int] = (0, 1),
                     dtype: torch.dtype) -> None:
        """Register this rank's piece of a captured constant (saved in ``fullmodel.pt``
        under ``name``) as a non-persistent buffer."""
        self.register_buffer(attr, self._piece(shape, index, dtype), persistent=False)
        self._meta("constant", attr, name, None, shape, index, value, dtype, (), False)

    # -- start-up -----------------------------------------------------------------------
    @classmethod
    def generated_dir(cls) -> str:
        """The directory of the generated file (where ``fullmodel.pt`` lies)."""
        return os.path.dirname(os.path.abspath(inspect.getfile(cls)))

    def _post_init(self, init_params: bool) -> None:
        self._check_rank()
        if init_params:
            self._load_initial()
        if self.process_groups:
            ensure_groups(self.process_groups)
        if not self.inference_only:
            self._build_reducers()
        if self.compile_config is not None:
            self._compile()

    def _compile(self) -> None:
        # an instance attribute shadows the method: forward and train_step run the
        # compiled regions, and communication stays eager (nnscaler.runtime.compiling)
        from nnscaler.runtime.compiling import compile_forward

        if self.pipeline is not None:
            raise ParallelModuleError(
                f"{type(self).__qualname__} is pipelined and has compile_config: compile "
                f"does not cover pipeline schedules; generate it without compile"
            )
        self._forward_impl = compile_forward(  # type: ignore[method-assign]
            self._forward_impl, self.compile_config, owner=type(self).__qualname__)

    def _check_rank(self) -> None:
        name = type(self).__qualname__
        if not (dist.is_available() and dist.is_initialized()):
            if self.runtime_ngpus != 1:
                raise ParallelModuleError(
                    f"{name} is the program of rank {self.rank} of {self.runtime_ngpus}, but "
                    f"torch.distributed is not initialized. Launch {self.runtime_ngpus} "
                    f"processes (torchrun --nproc-per-node {self.runtime_ngpus} ...) and call "
                    f"nnscaler.runtime.init_distributed() first"
                )
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != self.runtime_ngpus:
            raise ParallelModuleError(
                f"{name} was generated for runtime_ngpus={self.runtime_ngpus} processes, but "
                f"the job has {world}; generate for {world} (ComputeConfig.runtime_ngpus) or "
                f"launch {self.runtime_ngpus} processes"
            )
        if rank != self.rank:
            raise ParallelModuleError(
                f"{name} is the program of rank {self.rank}, but this process is rank {rank}; "
                f"load {gencode_name(rank)} on rank {rank}"
            )

    def _load_initial(self) -> None:
        path = os.path.join(self.generated_dir(), FULLMODEL)
        if not os.path.exists(path):
            raise ParallelModuleError(
                f"init_params=True loads the initial values from {path}, which does not "
                f"exist. Copy the generated directory with its {FULLMODEL} to this node, or "
                f"construct with init_params=False and load a checkpoint"
            )
        state = torch.load(path, map_location="cpu", weights_only=True)
        with torch.no_grad():
            for attr, meta in self.fullmap.items():
                full = next((state[n] for n in (meta.orig_name, *meta.names) if n in state), None)
                if full is None:
                    raise ParallelModuleError(
                        f"{path} has no entry for {meta.kind} {meta.orig_name!r} (held as "
                        f"{attr}); the file does not belong to this generated code: generate "
                        f"again"
                    )
                if full.is_meta:
                    raise ParallelModuleError(
                        f"{path} holds no value for {meta.kind} {meta.orig_name!r}: the module "
                        f"was compiled on the meta device, where tensors have shapes but no "
                        f"data. Construct with init_params=False (parallelize(..., "
                        f"init_module_params=False)) and load a checkpoint "
                        f"(nnscaler.load_merged_state_dicts or load_state_dict)"
                    )
                if tuple(full.shape) not in (meta.shape, meta.model_shape):
                    raise ParallelModuleError(
                        f"{path}: {meta.orig_name!r} has shape {tuple(full.shape)}, but the "
                        f"generated code expects {meta.model_shape or meta.shape}; generate "
                        f"again"
                    )
                target = getattr(self, attr)
                if meta.value[0] == 0:
                    target.copy_(meta.take(full))
                else:
                    target.zero_()

    def _build_reducers(self) -> None:
        cfg = ReducerConfig.from_options(self.reducer_config)
        zero, ngroups, async_op, cap = cfg.use_zero, cfg.zero_ngroups, cfg.async_op, cfg.bucket_cap_mb
        async_op = async_op or cfg.zero_stage >= 2  # stage 2 reduces from gradient hooks
        units: dict[str, list[torch.nn.Parameter]] = {}  # stage 3's gathering units
        by_holders: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        for attr, meta in self.fullmap.items():
            p = getattr(self, attr)
            if meta.kind == "parameter" and p.requires_grad:
                by_holders.setdefault(meta.holders, []).append(p)
                units.setdefault(unit_of(meta.orig_name, cfg.zero_units), []).append(p)
        distributed = dist.is_available() and dist.is_initialized()
        for holders in self.reducer_groups:
            holders = tuple(holders)
            group = None
            if async_op and distributed and len(holders) > 1:
                # a communicator of its own: async reductions launched from backward hooks
                # must not interleave with the adapters' collectives on a shared group
                group = dist.new_group(list(holders))
            params = by_holders.get(holders, [])
            if self.rank not in holders or not params:
                continue
            self._reducers.append(Reducer(
                params, holders, bucket_cap_mb=cap, async_op=async_op, zero=zero,
                zero_ngroups=ngroups if len(holders) > 1 else 1, process_group=group,
                zero_stage=self._stage_of(holders, cfg.zero_stage), units=list(units.items()),
                reduce_dtype=None if cfg.reduce_dtype is None else getattr(torch, cfg.reduce_dtype),
            ))
        if self.pipeline is not None and cfg.zero_stage >= 2:
            # stage 3 reduces in the step's last backward; a reducer whose ranks run
            # different stages (they reach a hook at different times) in sync_grad
            for r in self._reducers:
                r.hold_in_no_sync = r.stage >= 3 or self._spans_stages(r.ranks)
        if cfg.zero_stage >= 3:
            self._start_zero3()

    def _start_zero3(self) -> None:
        """Stage 3: the runner that gathers units; recomputed pieces gather again in
        backward; a pipeline's gradients accumulate over the micro-batches of a step
        and are reduce-scattered once, in the last one's backward (docs/zero.md)."""
        runner = self._zero3 = Zero3Runner([r for r in self._reducers if r.stage >= 3])
        for name in dir(type(self)):
            if name.startswith("_recompute_"):  # an instance attribute shadows the method
                setattr(self, name, runner.recomputing(getattr(self, name)))

    def _stage_of(self, holders: tuple[int, ...], stage: int) -> int:
        """The ZeRO stage of the reducer over ``holders``: a pipeline's piece held by
        several ranks of a scale unit (a weight tied across stages, a replicated piece
        under ``hybrid``) keeps its parameters whole (stage 2): its ranks run different
        stages at different times, and a gather needs them all at once. Its gradients
        are reduced once per step too, by `sync_grad`, after the schedule."""
        return 2 if stage >= 3 and self._spans_stages(holders) else stage

    def _spans_stages(self, holders: Sequence[int]) -> bool:
        """Whether a pipeline's piece is held by several ranks of one scale unit."""
        units = {h // self.plan_ngpus for h in holders}
        return self.pipeline is not None and len(units) < len(holders)

    # -- the optimizer's view -----------------------------------------------------------
    @property
    def reducers(self) -> list[Reducer]:
        """The reducers of this rank, one per set of ranks holding the same pieces."""
        return list(self._reducers)

    def _managed(self) -> set[int]:
        return {id(p) for r in self._reducers for p in r.params}

    def parameters_for_optimizer(self) -> list[torch.nn.Parameter]:
        """The tensors an optimizer updates: the reducers' (fp32 shards with ZeRO), then
        any parameter no reducer manages."""
        out: list[torch.nn.Parameter] = []
        for r in self._reducers:
            out += r.parameters_for_optimizer()
        managed = self._managed()
        out += [p for p in self.parameters() if p.requires_grad and id(p) not in managed]
        return out

    def sync_grad(self) -> None:
        """Sum every parameter piece's gradient over the ranks that hold it (waits for
        reductions the async reducer launched during backward)."""
        for r in self._reducers:
            r.sync_grads()

    def gather_params(self) -> None:
        """After ``optimizer.step()`` with ZeRO: all-gather the updated shards into the
        parameters. A no-op without ZeRO."""
        for r in self._reducers:
            r.gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the reducers' gradient buffers; other parameters' gradients become None
        (or zero, with ``set_to_none=False``)."""
        for r in self._reducers:
            r.zero_grad()
        managed = self._managed()
        for p in self.parameters():
            if id(p) in managed or p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (the async reducer launches
        nothing); [`train_step`][nnscaler.ParallelModule.train_step] runs all micro-batches but the
        last inside it."""
        with contextlib.ExitStack() as stack:
            for r in self._reducers:
                stack.enter_context(r.no_sync())
            yield

    # -- state dicts (the format: nnscaler.runtime.state) ---------------------------------
    def get_extra_state(self) -> dict[str, Any]:
        """What ``state_dict()`` stores under ``_extra_state``: the metadata that merging,
        resharding and checking need (original names, full shapes, the slices held, ...),
        non-persistent buffers and the tensors no rank holds. See ``docs/checkpoint.md``."""
        from nnscaler.runtime.state import module_extra_state

        return module_extra_state(self)

    def set_extra_state(self, state: Any) -> None:
        """Restore what `get_extra_state` saved (``load_state_dict`` calls it)."""
        from nnscaler.runtime.state import load_module_extra_state

        load_module_extra_state(self, state)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any,
                              strict: bool, missing_keys: list[str],
                              unexpected_keys: list[str], error_msgs: list[str]) -> None:
        # a state dict of another model, plan or rank fails naming the first mismatching
        # key and both shapes; with ZeRO, the optimizer's shards follow the loaded values
        from nnscaler.runtime.state import check_module_state_dict, refresh_zero_shards

        check_module_state_dict(self, state_dict, prefix, local_metadata)
        section = zero3_state.section_of(state_dict.get(prefix + "_extra_state"))
        if section is not None:  # stage-3 shards: no unit is gathered
            zero3_state.check_shards(self, section, f"{type(self).__qualname__} (rank "
                                                    f"{self.rank}).load_state_dict")
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
            held = {prefix + a for a in zero3_state.sharded_attrs(section)}
            missing_keys[:] = [k for k in missing_keys if k not in held]
            refresh_zero_shards(self)
            zero3_state.load_shards(self, section)
            return
        # stage 3, whole values: each goes straight into this rank's part of its shard
        units = zero3_state.unit_keys(self, state_dict, prefix)
        rest = {k: v for k, v in state_dict.items() if k not in units} if units else state_dict
        super()._load_from_state_dict(rest, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        missing_keys[:] = [k for k in missing_keys if k not in units]
        refresh_zero_shards(self)
        for key, (bucket, offset, count) in units.items():
            zero3_state.write_piece(bucket, offset, count, lambda k=key: state_dict[k])

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        section = zero3_state.section_of(destination.get(prefix + "_extra_state"))
        for attr in zero3_state.sharded_attrs(section):  # their values are in the shards
            destination.pop(prefix + attr, None)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """``torch.nn.Module.state_dict``; with ZeRO stage 3 the parameters' values are
        copied out one unit at a time (each gathered, copied, freed), except inside
        `nnscaler.runtime.zero3_state.saving_shards` (what the checkpoint functions use),
        where this rank's shards are saved instead and nothing is gathered."""
        out = super().state_dict(*args, **kwargs)  # a unit's entries: views of no storage
        if self._zero3 is not None and not zero3_state.is_saving_shards(self):
            prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
            zero3_state.copy_units_out(self, out, prefix)
        return out

    # -- end of the state-dict section --------------------------------------------------

    # -- running ------------------------------------------------------------------------
    def _forward_impl(self, *args: Any, **kwargs: Any) -> Any:
        raise ParallelModuleError(f"{type(self).__qualname__} has no generated forward; use "
                                  f"a class generated by nnscaler")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            raise ParallelModuleError(
                f"{type(self).__qualname__} is pipelined: its stages run on different ranks "
                f"over micro-batches, so it has no forward of one sample. Call "
                f"train_step(samples) to train or infer_step(samples) to evaluate, with a "
                f"list of micro-batches"
            )
        return self._run_forward(*args, **kwargs)

    def _run_forward(self, *args: Any, **kwargs: Any) -> Any:
        """``_forward_impl``; with ZeRO stage 3 its units are gathered as it reads them."""
        if self._zero3 is None:
            return self._forward_impl(*args, **kwargs)
        with self._zero3.forward():
            return self._forward_impl(*args, **kwargs)

    def train_step(
        self,
        samples: Sequence[Any],
        is_dummy_batch: Sequence[bool] | None = None,
        scale_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> list[Any]:
        """One training step over the micro-batches ``samples`` (end2end modules).

        Zeroes the gradients first, then runs forward and backward for each sample (the
        first output is the loss; ``scale_fn`` scales it before backward; a dummy batch
        contributes zero gradient). Gradients are summed over the micro-batches; call
        [`sync_grad`][nnscaler.ParallelModule.sync_grad] (``build_optimizer`` does) before
        ``optimizer.step()``. Returns each sample's outputs, detached.

        A pipelined module runs its schedule instead: ``samples`` are its
        ``pipeline_nmicros`` micro-batches (see `nnscaler.runtime.pipeline.train_step`).
        """
        name = type(self).__qualname__
        if not self.end2end:
            raise ParallelModuleError(
                f"train_step is for end2end modules (forward takes the sample and returns the "
                f"loss first), but {name} was generated with end2end=False; call the module "
                f"and backward yourself, or parallelize with ComputeConfig(use_end2end=True)"
            )
        if self.inference_only:
            raise ParallelModuleError(f"{name} was generated for inference only; use "
                                      f"infer_step, or generate with inference_only=False")
        samples = list(samples)
        if is_dummy_batch is not None and len(is_dummy_batch) != len(samples):
            raise ParallelModuleError(
                f"train_step: is_dummy_batch has {len(is_dummy_batch)} entries for "
                f"{len(samples)} samples; give one flag per sample"
            )
        if self.pipeline is not None:
            from nnscaler.runtime import pipeline

            return pipeline.train_step(self, samples, is_dummy_batch, scale_fn)
        self.zero_grad()
        outputs = []
        for i, sample in enumerate(samples):
            last = i == len(samples) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                out = self._run_forward(sample)
                loss = first_output(out)
                if is_dummy_batch is not None and is_dummy_batch[i]:
                    loss = loss * 0.0
                if scale_fn is not None:
                    loss = scale_fn(loss)
                loss.backward()
            outputs.append(pytree.tree_map(_detach, out))
        return outputs

    def infer_step(self, samples: Sequence[Any]) -> list[Any]:
        """Run forward on each sample without gradients; returns the outputs."""
        if self.pipeline is not None:
            from nnscaler.runtime import pipeline

            return pipeline.infer_step(self, samples)
        with torch.no_grad():
            return [self._run_forward(sample) for sample in samples]
