"""The promise check of custom ops at ``parallelize``.

A built-in op's annotation is checked by the test suite; an op a user or a plugin
registered is only as right as its annotation. Before code is generated, every such op
whose pieces the plan runs (the op was split) is run once on random inputs of its traced
shapes, whole and split as the plan splits it (`nnscaler.anno.check_promise`); a
split whose recombined pieces differ from the whole result is an error naming the op, the
split dimension and the largest difference. A passing check is remembered for the process
and on disk (keyed by a hash of the op's name, annotation, source code, shapes, dtypes and
split counts), so it runs once. ``ComputeConfig(check_custom_ops=False)`` skips it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from nnscaler.anno import PromiseBrokenError, check_promise
from nnscaler.errors import CustomOpCheckError
from nnscaler.ir import CURRENT_DEVICE, Op, SubTensor
from nnscaler.plugins import BUILTIN_PLUGINS

__all__ = ["CustomOpCheckError", "check_custom_ops", "checked_cache_dir"]

#: Keys of the checks passed in this process.
_passed: set[str] = set()


def checked_cache_dir() -> Path:
    """Where passed checks are remembered: ``$NNSCALER_CACHE_DIR/checked_ops``, else
    ``$XDG_CACHE_HOME/nnscaler/checked_ops`` (``~/.cache/...``)."""
    root = os.environ.get("NNSCALER_CACHE_DIR")
    if root:
        return Path(root) / "checked_ops"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "nnscaler" / "checked_ops"


def _is_custom(op: Op) -> bool:
    opdef = op.opdef
    # the built-ins' annotations are checked by the test suite, not at every parallelize
    return opdef is not None and opdef.registrant not in BUILTIN_PLUGINS


def _source_hash(fn: Any) -> str:
    try:
        text = inspect.getsource(fn)
    except (OSError, TypeError):
        text = repr(getattr(fn, "__code__", None) and fn.__code__.co_code)
    return hashlib.sha256(text.encode()).hexdigest()


def _key(op: Op, nums: Iterable[int]) -> str:
    opdef = op.opdef
    name, fn = (opdef.name, opdef.fn) if opdef is not None else (op.name, op.fn)
    shapes = [(list(t.shape), str(t.full.dtype)) for t in op.input_tensors()]
    consts = repr(pytree.tree_map(lambda x: None if isinstance(x, SubTensor) else x,
                                  (list(op.inputs), dict(op.kwargs))))
    blob = json.dumps([name, str(op.anno), _source_hash(fn), shapes, consts,
                       sorted(nums), torch.__version__])
    return hashlib.sha256(blob.encode()).hexdigest()


def _random(sub: SubTensor, gen: torch.Generator) -> torch.Tensor:
    shape, dtype = tuple(sub.shape), sub.full.dtype
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    elif dtype == torch.bool:
        x = torch.randint(0, 2, shape, generator=gen).bool()
    else:  # integers: small values, valid as indices into any dim of size >= 2
        x = torch.randint(0, 2, shape, generator=gen).to(dtype)
    return x.requires_grad_(sub.full.requires_grad and (dtype.is_floating_point
                                                         or dtype.is_complex))


def _tolerance(op: Op) -> tuple[float, float]:
    low = any(t.full.dtype in (torch.float16, torch.bfloat16) for t in op.input_tensors())
    return (1e-2, 1e-2) if low else (1e-5, 1e-6)


#: Inputs larger than this (elements, all inputs together) are not made up for a check:
#: a model traced on the meta device can have op inputs of many gigabytes.
MAX_CHECK_ELEMENTS = 1 << 24


def _check_one(op: Op, nums: set[int]) -> bool:
    """Check ``op``'s splits in ``nums`` parts; False when the op cannot run here."""
    opdef = op.opdef
    if opdef is None or op.anno is None:
        return False
    size = sum(math.prod(t.shape) for t in op.input_tensors())
    if size > MAX_CHECK_ELEMENTS:
        warnings.warn(
            f"the annotation of op {opdef.name!r} (registered by {opdef.registrant!r}) was not "
            f"checked at parallelize: its traced inputs have {size:,} elements, more than the "
            f"{MAX_CHECK_ELEMENTS:,} the check makes up. Check it on small inputs with "
            f"nnscaler.ops.verify.verify_op (or trace with smaller dummy inputs)",
            stacklevel=4,
        )
        return False
    gen = torch.Generator().manual_seed(0)

    def concrete(x: Any) -> Any:
        if isinstance(x, SubTensor):
            return _random(x, gen)
        return torch.device("cpu") if x is CURRENT_DEVICE else x

    inputs = pytree.tree_map(concrete, list(op.inputs))
    kwargs = pytree.tree_map(concrete, dict(op.kwargs))

    def clone(x: Any) -> Any:
        return x.detach().clone() if isinstance(x, torch.Tensor) else x

    def run(*args: Any, **kw: Any) -> Any:
        with torch.no_grad():
            return op.call([clone(a) for a in args], {k: clone(v) for k, v in kw.items()})

    def part_op(name: str) -> tuple[Any, bool]:
        from nnscaler.plugins import get_plugin_manager

        part = get_plugin_manager().ops.get(name)

        def run_part(*args: Any, **kw: Any) -> Any:
            with torch.no_grad():
                return part.call([clone(a) for a in args], {k: clone(v) for k, v in kw.items()})

        return run_part, part.collective

    try:  # the op must run on these inputs at all; if not, it cannot be checked here
        run(*inputs, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported as a warning: the check is not possible
        warnings.warn(
            f"the annotation of op {opdef.name!r} (registered by {opdef.registrant!r}) could not "
            f"be checked at parallelize: the op failed on random CPU inputs of its traced "
            f"shapes ({type(e).__name__}: {e}). Check it yourself with "
            f"nnscaler.ops.verify.verify_op, or pass ComputeConfig(check_custom_ops=False) to "
            f"silence this",
            stacklevel=4,
        )
        return False
    rtol, atol = _tolerance(op)
    try:
        check_promise(run, op.anno.anno, inputs, kwargs,
                      rules=opdef.rules_for(op.anno), rtol=rtol, atol=atol,
                      nums=sorted(nums), part_kwargs=opdef.part_kwargs, part_op=part_op)
    except PromiseBrokenError as e:
        where = f" at {op.source}" if op.source else ""
        code = f" ({op.code.strip()!r})" if op.code.strip() else ""
        registered = f", registered at {opdef.source}" if opdef.source else ""
        raise CustomOpCheckError(
            f"the custom op {opdef.name!r} (registered by {opdef.registrant!r}{registered}) "
            f"does not keep the promise of its annotation '{op.anno.anno}' for a split the "
            f"plan uses; checked on random inputs of its traced shapes "
            f"{[list(t.shape) for t in op.input_tensors()]} (call{where}{code}): {e}. The "
            f"parallel program would train differently from the model. Fix the annotation "
            f"(mark a dimension the op mixes across with '^', or '+' when the parts sum to "
            f"the result), or, if the op is right and the check is not (e.g. it is random), "
            f"pass ComputeConfig(check_custom_ops=False)."
        ) from None
    return True


def check_custom_ops(graph: Any, *, cache: bool = True) -> list[str]:
    """Check every custom op that ``graph`` (a planned ``IRGraph``) splits; returns the
    names of the ops checked now (not found in a cache). Raises
    `CustomOpCheckError` for the first op that breaks its promise."""
    splits: dict[Op, set[int]] = {}
    for inst in graph.nodes():
        origin = graph.origin(inst)
        if not _is_custom(origin):
            continue
        parts = graph.split_parts(inst)
        if len(parts) > 1:
            splits.setdefault(origin, set()).add(len(parts))
    checked = []
    folder = checked_cache_dir()
    for op, nums in splits.items():
        key = _key(op, nums)
        marker = folder / key
        if cache and (key in _passed or marker.is_file()):
            _passed.add(key)
            continue
        if not _check_one(op, nums):
            continue
        checked.append(op.opdef.name if op.opdef is not None else op.name)
        _passed.add(key)
        if cache:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                tmp = folder / f".{key}.{os.getpid()}.tmp"
                tmp.write_text(json.dumps({"op": checked[-1], "annotation": str(op.anno)}))
                os.replace(tmp, marker)
            except OSError:  # an unwritable cache only costs a check next time
                pass
    return checked
