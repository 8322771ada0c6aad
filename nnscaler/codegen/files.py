"""Generated files on disk: ``gencode{rank}.py`` for every rank and ``fullmodel.pt``.

Each file is written atomically (a temporary file in the same directory, then
``os.replace``), so a reader never sees half a file. The names are the folder format's
(`nnscaler.gendir`); ``config.json`` is not written here:
[`nnscaler.parallelize`][nnscaler.parallelize] writes it last, after these files.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nnscaler.codegen.emit import generate
from nnscaler.codegen.errors import CodegenError
from nnscaler.codegen.program import Program, build_program
from nnscaler.config import ComputeConfig
from nnscaler.gendir import FULLMODEL, gencode_name
from nnscaler.graph.graph import as_irgraph
from nnscaler.ir import Graph, TensorKind

_loaded = itertools.count()


def _write_atomic(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _state_of(state: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(state, torch.nn.Module):
        out = dict(state.named_parameters(remove_duplicate=False))
        out.update(state.named_buffers(remove_duplicate=False))
        return out
    return dict(state)


def full_state(graph: Graph, state: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``fullmodel.pt`` holds: every parameter and buffer of the graph under each of
    its names, and every captured constant under ``__constants__.<name>`` (CPU copies)."""
    given = _state_of(state)
    out: dict[str, torch.Tensor] = {}
    for full in as_irgraph(graph).tensors:
        if full.version:
            continue
        if full.kind in (TensorKind.PARAMETER, TensorKind.BUFFER):
            value = next((given[n] for n in full.names if n in given), None)
            if value is None:
                raise CodegenError(
                    f"the state given for fullmodel.pt has no entry for the {full.kind.value} "
                    f"{' / '.join(full.names)}; pass the traced module itself (its "
                    f"non-persistent buffers are not in its state_dict), or a mapping with "
                    f"every parameter and buffer by name"
                )
            # a module on the meta device has no values: its entries stay meta (shape and
            # dtype only), and loading them says how to get values (a checkpoint)
            tensor = value.detach() if value.is_meta else value.detach().to("cpu").clone()
            for name in full.names:
                out[name] = tensor
        elif full.kind is TensorKind.CONSTANT:
            if full.value is None:
                raise CodegenError(f"the constant {full} has no recorded value")
            value = full.value.detach()
            out[f"__constants__.{full.name}"] = value if value.is_meta else value.to("cpu").clone()
    return out


def emit_files(
    graph: Graph,
    outdir: str | os.PathLike[str],
    *,
    plan_ngpus: int,
    runtime_ngpus: int,
    state: torch.nn.Module | Mapping[str, torch.Tensor],
    end2end: bool = False,
    inference_only: bool = False,
    compute_config: ComputeConfig | Mapping[str, Any] | None = None,
    forward_signature: inspect.Signature | None = None,
    program: Program | None = None,
    origin: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write ``gencode{rank}.py`` for every runtime rank and ``fullmodel.pt`` into
    ``outdir`` (created if missing); returns the paths written.

    ``state`` is the traced module (or its parameters and buffers by name, non-persistent
    buffers included); ``compute_config`` (a [`ComputeConfig`][nnscaler.ComputeConfig], or a mapping
    of some of its fields) gives the reducer options and the pipeline schedule; ``forward_signature`` (the traced module's
    ``inspect.signature(module.forward)``) orders the generated forward's arguments and
    keeps the untraced ones with their defaults. ``program`` reuses an analysis made by
    `build_program` with the same arguments; ``origin`` (what
    produced the plan: ``module``, ``policy``) goes into each file's header.
    """
    if program is None:
        program = build_program(
            graph, plan_ngpus=plan_ngpus, runtime_ngpus=runtime_ngpus, end2end=end2end,
            inference_only=inference_only, compute_config=compute_config,
            forward_signature=forward_signature, origin=origin,
        )
    sources = generate(program)
    weights = full_state(program.graph, state)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for rank, text in sources.items():
        path = out / gencode_name(rank)
        _write_atomic(path, lambda f, text=text: f.write(text.encode()))
        written.append(path)
    path = out / FULLMODEL
    _write_atomic(path, lambda f: torch.save(weights, f))
    written.append(path)
    return written


def load_generated_module(outdir: str | os.PathLike[str], rank: int) -> Any:
    """Import ``{outdir}/gencode{rank}.py`` as a new module with a unique name."""
    path = Path(outdir).resolve() / gencode_name(rank)
    if not path.is_file():
        raise CodegenError(
            f"{path} does not exist: the generated code of rank {rank} is missing. Generate "
            f"it first (nnscaler.parallelize or nnscaler.codegen.emit_files), for a "
            f"runtime_ngpus larger than {rank}"
        )
    name = f"nnscaler_gencode_{abs(hash(str(path.parent))):x}_{rank}_{next(_loaded)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CodegenError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_generated_class(outdir: str | os.PathLike[str], rank: int) -> type:
    """The ``GenModel`` class of ``{outdir}/gencode{rank}.py`` (imported under a unique
    module name, so several generated modules coexist)."""
    module = load_generated_module(outdir, rank)
    cls = getattr(module, "GenModel", None)
    if cls is None:
        raise CodegenError(f"{module.__file__} defines no GenModel class; generate it again")
    return cls
