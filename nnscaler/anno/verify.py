"""Check an annotation's promise: the parts of every split recombine to the whole result."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nnscaler.anno.errors import PromiseBrokenError
from nnscaler.anno.parser import OpAnno, parse
from nnscaler.anno.partgroup import run_parts
from nnscaler.anno.transform import Replicate, Transform, TransformRule, ValuePartial

__all__ = ["check_promise"]


def _outputs(result: Any, anno: OpAnno, what: str) -> tuple[Any, ...]:
    """The results of one run as a tuple aligned with the annotation's outputs."""
    n = len(anno.outputs)
    if isinstance(result, (tuple, list)) and (n > 1 or (len(result) == 1 and anno.outputs[0].is_tensor)):
        if len(result) != n:
            raise PromiseBrokenError(f"{what} returned {len(result)} values but the annotation "
                                     f"'{anno}' has {n} outputs")
        return tuple(result)
    if n != 1:
        raise PromiseBrokenError(f"{what} returned one value of type {type(result).__name__} "
                                 f"but the annotation '{anno}' has {n} outputs")
    return (result,)


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape or got.numel() == 0:
        return float("inf") if got.shape != want.shape else 0.0
    to = torch.complex128 if want.is_complex() else torch.float64
    got, want = got.to(to), want.to(to)
    diff = (got - want).abs().masked_fill(got.isnan() & want.isnan(), 0)
    return float(diff.nan_to_num(float("inf")).max())


def check_promise(
    fn: Callable[..., Any],
    annotation: str | OpAnno,
    inputs: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    rules: Sequence[TransformRule] = (),
    rtol: float = 1e-5,
    atol: float = 1e-6,
    nums: Sequence[int] | None = None,
    part_kwargs: Callable[[Transform, Mapping[str, Any], int], dict[str, Any]] | None = None,
    part_op: Callable[[str], tuple[Callable[..., Any], bool]] | None = None,
) -> list[Transform]:
    """Check that ``annotation`` keeps its promise for ``fn(*inputs, **kwargs)``.

    ``inputs`` align with the annotation's inputs. ``fn`` runs on the whole inputs (the
    real output shapes must equal the inferred ones), then, for every transform of the
    space (in ``nums`` parts only, when given), on each part's inputs and keyword
    arguments; each tensor output is recombined with its layout and compared with the whole
    result (``torch.testing.assert_close``; integers and booleans exactly). ``part_kwargs``
    replaces `Transform.part_kwargs` for ops that rewrite more arguments.
    ``part_op(name) -> (callable, collective)`` resolves the part op a transform rule
    names; a collective one gets ``group`` and its parts run together
    (`nnscaler.anno.partgroup.run_parts`). ``fn`` must be deterministic. Returns the checked
    transforms; raises `PromiseBrokenError` on the first disagreement.
    """
    anno = parse(annotation) if isinstance(annotation, str) else annotation
    kwargs = dict(kwargs or {})
    shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in inputs]
    bound = anno.bind(shapes, kwargs)
    name = f"annotation '{anno}'"
    whole = _outputs(fn(*inputs, **kwargs), anno, "the op")
    _check_output_shapes(name, whole, bound.output_shapes)
    if nums is None:
        space = bound.transform_space(rules=rules)
    else:
        space = [t for n in nums for t in bound.transform_space(n, rules=rules)]
    for t in space:
        results = _run_parts(name, t, fn, inputs, kwargs, part_kwargs, part_op)
        parts = [_outputs(r, anno, f"part {p} of {t}") for p, r in enumerate(results)]
        for k, layout in enumerate(t.outputs):
            if layout is None or bound.output_shapes[k] is None:
                continue
            hint = ""
            if isinstance(layout, Replicate) and t.modifier is None:
                hint = (f"; if the parts of output {k} sum to it, mark {t.ident!r} '+', and if "
                        f"{t.ident!r} cannot be split, mark it '^'")
            _compare(layout.combine([p[k] for p in parts]), whole[k], rtol, atol,
                     f"{name} breaks its promise under {t}: output {k}", hint)
    return space


def _check_output_shapes(name: str, whole: Sequence[Any],
                         shapes: Sequence[tuple[int, ...] | None]) -> None:
    """The op's outputs have the shapes the annotation infers (None: not a tensor)."""
    for k, (out, shape) in enumerate(zip(whole, shapes, strict=True)):
        if shape is None:
            continue
        real = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        if real != shape and not (real == () and shape == (1,)):  # a 0-d tensor is '1'
            what = f"shape {real}" if real is not None else f"a {type(out).__name__}"
            raise PromiseBrokenError(f"{name}: output {k} should have shape {shape} but the op "
                                     f"returned {what}")


def _run_parts(
    name: str,
    t: Transform,
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    kwargs: dict[str, Any],
    part_kwargs: Callable[[Transform, Mapping[str, Any], int], dict[str, Any]] | None,
    part_op: Callable[[str], tuple[Callable[..., Any], bool]] | None,
) -> list[Any]:
    """The results of the ``t.num`` parts of transform ``t``, each run on its pieces of
    the inputs (a collective part op: all together)."""
    part_fn, collective = fn, False
    if t.part_op is not None:
        if part_op is None:
            raise ValueError(f"{name}, {t}: the parts call the op {t.part_op!r}; pass "
                             f"part_op= to resolve it (verify_op does)")
        part_fn, collective = part_op(t.part_op)
    calls = []
    for part in range(t.num):
        args = [x if layout is None or not isinstance(x, torch.Tensor)
                else _piece(layout, x, t.num, part)
                for x, layout in zip(inputs, t.inputs, strict=True)]
        kw = part_kwargs(t, kwargs, part) if part_kwargs else t.part_kwargs(kwargs, part)
        calls.append(functools.partial(_call, part_fn, args, kw, collective))
    results: list[Any] = []
    try:
        if collective:
            results = run_parts(calls)
        else:
            for call in calls:
                results.append(call(None))
    except Exception as e:
        which = "one of the parts" if collective else f"part {len(results)}"
        raise PromiseBrokenError(f"{name}, {t}: the op failed on {which}: "
                                 f"{type(e).__name__}: {e}") from e
    return results


def _piece(layout: Any, x: torch.Tensor, num: int, part: int) -> torch.Tensor:
    """Part ``part`` of input ``x`` in ``layout``. A value-partial input is cut into
    shares that sum to it but are not proportional to it (``x / num`` plus fixed
    pseudo-random offsets that sum to zero; integers alike, in whole numbers), so that an
    op that is not linear in it cannot pass for linear: with the whole on part 0 and
    zeros elsewhere ``a * b`` would, and with proportional shares ``relu`` would."""
    if not isinstance(layout, ValuePartial) or x.dtype == torch.bool or num < 2:
        return layout.chunk(x, num, part)
    gen = torch.Generator().manual_seed(0x5EED + num)
    if x.is_floating_point() or x.is_complex():
        scale = float(x.detach().abs().mean()) if x.numel() else 1.0
        noise = torch.randn((num, *x.shape), generator=gen, dtype=torch.float64)
        offsets = (noise - noise.mean(0)) * (scale or 1.0)
        return x / num + offsets[part].to(x.dtype if x.is_floating_point() else x.real.dtype)
    noise = torch.randint(-3, 4, (num, *x.shape), generator=gen, dtype=torch.int64)
    noise[-1] = -noise[:-1].sum(0)
    base = torch.div(x, num, rounding_mode="floor")
    share = base if part else x - base * (num - 1)
    return (share + noise[part]).to(x.dtype)


def _call(fn: Callable[..., Any], args: list[Any], kw: dict[str, Any], collective: bool,
          group: Any) -> Any:
    return fn(*args, **kw, group=group) if collective else fn(*args, **kw)


def _compare(
    got: Any, want: torch.Tensor, rtol: float, atol: float, where: str, hint: str
) -> None:
    if not isinstance(got, torch.Tensor):
        raise PromiseBrokenError(f"{where}: the parts returned a {type(got).__name__}, not a tensor")
    exact = not (want.is_floating_point() or want.is_complex())
    try:
        if exact:
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                raise AssertionError(f"dtype {got.dtype} vs {want.dtype}, shape "
                                     f"{tuple(got.shape)} vs {tuple(want.shape)}")
        else:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        detail = str(e).strip().splitlines()[0]
        raise PromiseBrokenError(
            f"{where} differs from the whole result by up to {_max_diff(got, want):.3g} "
            f"({detail}){hint}"
        ) from None
