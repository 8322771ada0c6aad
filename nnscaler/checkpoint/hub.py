"""Hugging Face Hub-format weights in and out of parallel modules, and resharding a
checkpoint into another plan, each rank reading only the pieces it holds.

- [`load_pretrained`][nnscaler.load_pretrained]: a folder written by ``transformers``'
  ``save_pretrained`` (``model.safetensors``, or shards with ``model.safetensors.index.json``) into
  a parallel module of any plan, typically one traced on the meta device;
- [`save_pretrained`][nnscaler.save_pretrained]: a parallel module (collective) or its per-rank
  checkpoint files into such a folder, tensor by tensor;
- [`load_resharded`][nnscaler.load_resharded]: per-rank checkpoint files saved under one plan into a
  module of another plan, and its optimizer (`optimizer_reshard`), without merging them;
- [`meta_parameters`][nnscaler.meta_parameters]: build a model whose parameters are on the meta
  device and whose buffers have their values (what [`load_pretrained`][nnscaler.load_pretrained]
  fills).

See ``docs/pretrained.md``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from nnscaler.checkpoint.collective import agree
from nnscaler.checkpoint.module_source import ModuleSource
from nnscaler.checkpoint.optimizer import parallel_modules
from nnscaler.checkpoint.pieces import (
    HubSource,
    RankFilesSource,
    load_into,
)
from nnscaler.checkpoint.safetensors_io import parse_size, write_hub_folder
from nnscaler.checkpoint.shards import rank_state_dict
from nnscaler.errors import CheckpointError

__all__ = ["load_pretrained", "load_resharded", "meta_parameters", "save_pretrained"]

DEFAULT_SHARD_SIZE = "5GB"


# -- building a model without its weights ----------------------------------------------------
@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Inside, every parameter a module registers is put on the meta device (no memory,
    no initialisation cost); buffers keep their values. Such a model traces with
    ``trace_strategy='meta'``; its non-persistent buffers (rotary frequencies, masks),
    which no checkpoint holds, reach the parallel module through ``fullmodel.pt``, while
    [`load_pretrained`][nnscaler.load_pretrained] fills the parameters."""
    original = torch.nn.Module.register_parameter

    def register(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.detach().to("meta"),
                                       requires_grad=param.requires_grad)
        original(self, name, param)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


# -- names ----------------------------------------------------------------------------------
def name_map(model_names: Sequence[str], stored_names: Sequence[str],
             prefix: str | None) -> Callable[[str], str | None]:
    """How a model name becomes a stored one.

    ``prefix`` (the stored model's path in the model, e.g. ``'model.'``) is stripped. None:
    each model name is matched to the stored names that share its longest dotted suffix,
    and the head replaced (``a.`` -> ``b.``, either empty) is the one most names agree on
    (ties: the shortest heads)."""
    if prefix is not None:
        if prefix and not prefix.endswith("."):
            prefix += "."
        return lambda n: n[len(prefix):] if n.startswith(prefix) else None
    heads: dict[str, list[str]] = {}  # dotted suffix -> the heads stored before it
    for s in stored_names:
        parts = s.split(".")
        for i in range(len(parts)):
            head = ".".join(parts[:i]) + ("." if i else "")
            heads.setdefault(".".join(parts[i:]), []).append(head)
    votes: Counter[tuple[str, str]] = Counter()
    for n in model_names:
        parts = n.split(".")
        for i in range(len(parts)):  # the longest suffix first
            found = heads.get(".".join(parts[i:]))
            if found:
                head = ".".join(parts[:i]) + ("." if i else "")
                votes.update((head, h) for h in set(found))
                break
    if not votes:
        return lambda n: n
    (cut, add), _ = max(votes.items(), key=lambda kv: (kv[1], -len(kv[0][0]) - len(kv[0][1])))
    return lambda n: add + n[len(cut):] if n.startswith(cut) else None


def _model_names(module: torch.nn.Module) -> list[str]:
    """Every name a checkpoint of ``module`` may use (all ranks' pieces, the original
    module's tensors no rank holds, tied names included)."""
    from nnscaler.runtime.state import plan_manifest

    names: list[str] = []
    pms = parallel_modules(module)
    for key in rank_state_dict(module):  # outside the parallel modules: no unit gathered
        if not any(key.startswith(p) and "." not in key[len(p):] for p, _ in pms):
            names.append(key)
    for prefix, pm in pms:
        for e in plan_manifest(pm) or ():
            names += [prefix + n for n in e["names"]]
        names += [prefix + n for m in pm.fullmap.values() for n in m.names]
    everyone: list[Any] = [names]
    if dist.is_available() and dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, names)
    return list(dict.fromkeys(n for ns in everyone for n in ns))


# -- loading ----------------------------------------------------------------------------------
def load_pretrained(module: torch.nn.Module, path: str | os.PathLike[str], *,
                    prefix: str | None = None, strict: bool = True) -> None:
    """Load a Hub-format folder (or one ``.safetensors`` file) into ``module``, a
    ParallelModule of any plan or a model holding some; every rank calls it.

    Each rank reads only the slices its pieces hold, one at a time, with positioned reads
    (no rank ever holds more than its pieces and one row block). The module's names are
    the wrapped model's (``model.embed_tokens.weight``), possibly under a prefix
    (``model.`` when the Hugging Face model is ``self.model`` of a wrapper): ``prefix``
    names it; None finds the head to replace (``model.model.`` -> ``model.``, ``base.`` ->
    ``model.``) that most names agree on, matching each by its longest dotted suffix. A tied tensor is read under any of its names
    (``lm_head.weight`` is absent when ``tie_word_embeddings``). Non-persistent buffers
    and captured constants take the values ``fullmodel.pt`` recorded at trace time.

    Every name and shape is checked on every rank before any value is read: a tensor whose
    shape differs from the model's, a model tensor missing from the folder, a name in the
    folder the model lacks (with ``strict``), a missing shard or a truncated file is a
    [`CheckpointError`][nnscaler.errors.CheckpointError] naming the key, the file and the shapes.
    """
    error: BaseException | None = None
    source: HubSource | None = None
    try:
        source = HubSource(path)
    except CheckpointError as e:
        error = e
    agree(error, "load_pretrained")
    source = cast(HubSource, source)  # agree raised when it is not
    to_source = name_map(_model_names(module), source.names(), prefix)
    load_into(module, source, to_source, what="load_pretrained", strict=strict)


def load_resharded(module: torch.nn.Module,
                   files: Sequence[str | os.PathLike[str] | Mapping[str, Any]],
                   optimizer: torch.optim.Optimizer | None = None,
                   optimizer_files: Sequence[str | os.PathLike[str] | Mapping[str, Any]]
                   | None = None, *, strict: bool = True) -> None:
    """Load the per-rank (or deduped) state-dict files of a model saved under any plan
    into ``module`` (the same model under another plan); every rank calls it with the
    list of every saved rank's file.

    The files are memory-mapped and each rank reads only the pieces that overlap its own
    (replicas once, value parts summed): no rank merges the whole model. Names and shapes
    are checked first, as in [`load_pretrained`][nnscaler.load_pretrained].

    With ``optimizer`` (built over ``module``, e.g. by
    [`nnscaler.build_optimizer`][nnscaler.build_optimizer]) and ``optimizer_files`` (every saved
    rank's ``optimizer.state_dict()``, in the order of ``files``), the optimizer state moves too,
    with or without ZeRO on either side: each rank reads only the slices of the elementwise state
    (Adam's ``exp_avg``, ``exp_avg_sq``, ...) of the pieces it holds; scalars (``step``) and the
    groups' hyperparameters are taken as
    [`nnscaler.load_merged_state_dicts`][nnscaler.load_merged_state_dicts] takes them from a merged
    checkpoint, with the same result. Everything (a missing rank, state that is not elementwise,
    another optimizer class) is checked on every rank before anything is loaded: a
    [`CheckpointError`][nnscaler.errors.CheckpointError] leaves module and optimizer as they
    were."""
    from nnscaler.checkpoint.optimizer_reshard import OptimizerFilesSource, plan_optimizer

    error: BaseException | None = None
    source: RankFilesSource | None = None
    plan = None
    try:
        if (optimizer is None) != (optimizer_files is None):
            raise CheckpointError("load_resharded: pass both optimizer and optimizer_files "
                                  "(every saved rank's optimizer state dict), or neither")
        source = RankFilesSource(files)
        source.catalog.check_complete(
            "pass the file of every rank of the saved plan, each saved after the same step")
        if optimizer is not None and optimizer_files is not None:
            plan = plan_optimizer(module, optimizer,
                                  OptimizerFilesSource(optimizer_files, source.sds))
    except CheckpointError as e:
        error = e
    agree(error, "load_resharded")
    source = cast(RankFilesSource, source)
    load_into(module, source, lambda n: n, what="load_resharded", strict=strict)
    if plan is not None and optimizer is not None:
        optimizer.load_state_dict(plan.local_state())


# -- exporting --------------------------------------------------------------------------------
def _hf_model(config: Any) -> tuple[str, dict[str, tuple[int, ...]]] | None:
    """The architecture ``config`` describes and its state-dict names and shapes (the
    model built on the meta device): its ``architectures[0]``, else the causal-LM class of
    its ``model_type``; None when transformers has neither."""
    try:
        import transformers
    except ImportError:
        return None
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None and not isinstance(config, Mapping):
        cls = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    if cls is None:
        return None
    with torch.device("meta"):
        model = cls(config)
    return cls.__name__, {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _config_bytes(config: Any, arch: str | None) -> bytes:
    if isinstance(config, Mapping):
        return (json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode()
    to_json = getattr(config, "to_json_string", None)
    if to_json is None:
        raise CheckpointError(f"config must be a transformers PretrainedConfig or a dict, got "
                              f"{type(config).__name__}")
    if arch is not None and not getattr(config, "architectures", None):
        config = copy.deepcopy(config)
        config.architectures = [arch]  # what from_pretrained of an Auto class reads
        to_json = config.to_json_string
    return to_json().encode()


def save_pretrained(source: torch.nn.Module | Sequence[str | os.PathLike[str] | Mapping[str, Any]],
                    out_dir: str | os.PathLike[str], config: Any = None, *,
                    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
                    prefix: str | None = None) -> None:
    """Write a Hub-format folder that ``transformers``' ``from_pretrained`` reads:
    safetensors shards of at most ``max_shard_size`` (bytes, or ``'5GB'``, ``'500MiB'``),
    ``model.safetensors.index.json`` when there are several, and ``config.json`` from
    ``config`` (a ``PretrainedConfig`` or a dict).

    ``source`` is a model holding parallel modules (every rank calls it; rank 0 writes,
    receiving the other ranks' pieces one tensor at a time), or the list of every rank's
    state-dict files (per-rank or deduped; read memory-mapped, in one process). Tied
    tensors are written once, under their first name. ``prefix`` (e.g. ``'model.'``) is
    stripped from the names; None: with a ``config``, the prefix that makes the names
    those of the model it describes (its ``architectures[0]``, else the causal-LM class of
    its ``model_type``; every name and shape must then be that model's), else none.
    Written into a temporary folder and renamed to ``out_dir`` at the end."""
    is_module = isinstance(source, torch.nn.Module)
    error: BaseException | None = None
    src: Any = None
    specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    firsts: list[str] = []
    try:
        src = ModuleSource(source) if is_module else RankFilesSource(source)
        src.catalog.check_complete("pass the file of every rank of the saved plan")
        parse_size(max_shard_size)
        hf = _hf_model(config) if config is not None else None
        arch, stored = hf if hf is not None else (None, None)
        extra = {} if config is None else {"config.json": _config_bytes(config, arch)}
        firsts = list(src.catalog.order)
        to_out = name_map(src.names(), stored or [], prefix if stored or prefix else "")
        for first in firsts:
            e = src.catalog.entries[first]
            out = next((to_out(n) for n in e.names if to_out(n) is not None), None)
            if out is None:
                raise CheckpointError(
                    f"save_pretrained: the model's {first!r} (shape {e.shape}) has no name in "
                    f"the exported model (prefix {prefix!r}); pass prefix= the path of the "
                    f"exported model in yours"
                )
            if stored is not None and stored.get(out) != e.shape:
                theirs = "does not have" if out not in stored else f"has with shape {stored[out]}"
                raise CheckpointError(
                    f"save_pretrained: the model's {first!r} (shape {e.shape}) becomes "
                    f"{out!r}, which {arch} {theirs}; the config describes another model"
                )
            specs.append((out, e.shape, e.dtype))
        if stored is not None:
            written = {n for first in firsts for n in
                       (to_out(x) for x in src.catalog.entries[first].names) if n}
            lacking = [n for n in stored if n not in written]
            if lacking:
                raise CheckpointError(
                    f"save_pretrained: {arch} has {lacking[0]!r} (shape "
                    f"{stored[lacking[0]]}), which the model does not ({len(lacking)} such "
                    f"names); the config describes another model"
                )
    except CheckpointError as e:
        error = e
    if is_module:
        agree(error, "save_pretrained")
    elif error is not None:
        raise error
    rank = dist.get_rank() if is_module and dist.is_available() and dist.is_initialized() else 0
    write_hub_folder(out_dir, specs, lambda i: src.read(firsts[i]),
                     max_shard_size=max_shard_size, extra_files=extra, writer=rank == 0)
    if is_module and dist.is_available() and dist.is_initialized():
        dist.barrier()
