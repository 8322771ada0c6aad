"""Convolutions: conv1d/2d/3d and conv_transpose1d/2d/3d.

- the batch dim splits;
- output channels split (weight, bias and output together);
- input channels are a contraction: ``+`` without a bias, ``^`` with one;
- with ``groups > 1`` the channel dims are hidden groups ``(groups c)``: splitting
  ``groups`` splits the input channels, the weight and the output channels by whole
  groups and divides the ``groups`` keyword argument;
- a spatial dim is ``^`` (windows overlap, padding depends on the edges), except when the
  windows tile it exactly (no padding, kernel span at most the stride, the size a
  multiple of the stride): then it is the group ``(t stride)`` and ``t`` splits.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch.nn.functional as F

from nnscaler.ops.builtin._common import tensor_str
from nnscaler.ops.builtin.nn import f64
from nnscaler.ops.registry import OpRegistry


def _tuple(v: Any, n: int) -> tuple[int, ...]:
    if isinstance(v, int):
        return (v,) * n
    v = tuple(int(x) for x in v)
    return v * n if len(v) == 1 else v


def _channels(groups: int, bias: Any, transposed: bool) -> tuple[str, str, str, str]:
    """(input channel dim, weight channel dims, output channel dim, bias) entries."""
    if groups == 1:
        c = "c+" if bias is None else "c^"
        w = f"{c} o" if transposed else f"o {c}"
        return c, w, "o", "?" if bias is None else "o"
    cin = "(groups ci^)"
    cout = "(groups co^)"
    w = f"{cin} co^" if transposed else f"{cout} ci^"
    return cin, w, cout, "?" if bias is None else cout


def conv_anno(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1) -> str:
    nsp = weight.dim() - 2
    batched = input.dim() == nsp + 2
    s, d = _tuple(stride, nsp), _tuple(dilation, nsp)
    kernel = weight.shape[2:]
    spatial = input.shape[input.dim() - nsp :]
    if isinstance(padding, str):
        pads = (0,) * nsp if padding == "valid" else None  # 'same': output size = input size
    else:
        pads = _tuple(padding, nsp)
    cin, w, cout, b = _channels(groups, bias, transposed=False)
    ins, wk, outs = [], [], []
    for i in range(nsp):
        k, size = int(kernel[i]), int(spatial[i])
        span = d[i] * (k - 1) + 1
        wk.append(f"k{i}^")
        p = 0 if pads is None and span == 1 else (None if pads is None else pads[i])
        if p == 0 and span <= s[i] and size % s[i] == 0:  # windows tile the dim
            ins.append(f"t{i}" if s[i] == 1 else f"(t{i} {s[i]})")
            outs.append(f"t{i}")
            continue
        ins.append(f"s{i}^")
        if pads is None:
            outs.append(str(size))
        else:
            outs.append(str((size + 2 * pads[i] - span) // s[i] + 1))
    n = ["n"] if batched else []
    x = tensor_str([*n, cin, *ins])
    return f"{x}, {w} {' '.join(wk)}, {b} -> {tensor_str([*n, cout, *outs])}"


def conv_transpose_anno(
    input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1
) -> str:
    nsp = weight.dim() - 2
    batched = input.dim() == nsp + 2
    s, d = _tuple(stride, nsp), _tuple(dilation, nsp)
    p, op = _tuple(padding, nsp), _tuple(output_padding, nsp)
    kernel = weight.shape[2:]
    spatial = input.shape[input.dim() - nsp :]
    cin, w, cout, b = _channels(groups, bias, transposed=True)
    ins, wk, outs = [], [], []
    for i in range(nsp):
        k, size = int(kernel[i]), int(spatial[i])
        span = d[i] * (k - 1) + 1
        wk.append(f"k{i}^")
        # input position t writes output positions t * stride + [0, span): when the spans
        # tile the output (no padding, output_padding filling each block), t splits
        if p[i] == 0 and span <= s[i] and op[i] == s[i] - span:
            ins.append(f"t{i}")
            outs.append(f"t{i}" if s[i] == 1 else f"(t{i} {s[i]})")
            continue
        ins.append(f"s{i}^")
        outs.append(str((size - 1) * s[i] - 2 * p[i] + span + op[i]))
    n = ["n"] if batched else []
    x = tensor_str([*n, cin, *ins])
    return f"{x}, {w} {' '.join(wk)}, {b} -> {tensor_str([*n, cout, *outs])}"


def _maybe_tuple(rng: random.Random, v: Sequence[int]) -> Any:
    if len(set(v)) == 1 and rng.random() < 0.6:
        return v[0]
    return tuple(v)


def _gen_conv(nsp: int, transposed: bool):
    def gen(rng: random.Random) -> tuple[tuple, dict]:
        groups = rng.choice((1, 1, 2, 3))
        cin = groups * rng.choice((1, 2))
        cout = groups * rng.choice((1, 2))
        small = nsp == 3
        kernel = [rng.choice((1, 2) if small else (1, 2, 3)) for _ in range(nsp)]
        tiling = rng.random() < 0.4  # patch-embedding-like: stride == kernel
        stride = list(kernel) if tiling else [rng.choice((1, 1, 2)) for _ in range(nsp)]
        kw: dict[str, Any] = {}
        if tiling:
            spatial = [kk * rng.choice((1, 2, 3) if small else (1, 2, 3, 4)) for kk in kernel]
        else:
            spatial = [rng.choice((3, 4) if small else (3, 4, 6)) + kk for kk in kernel]
        if not transposed and not tiling and rng.random() < 0.4:
            pad = [rng.choice((0, 1)) for _ in range(nsp)]
            kw["padding"] = _maybe_tuple(rng, pad)
        if not transposed and not tiling and rng.random() < 0.15:
            kw["padding"] = rng.choice(("same", "valid"))
            if kw["padding"] == "same":
                stride = [1] * nsp
        if not tiling and rng.random() < 0.2:
            kw["dilation"] = _maybe_tuple(rng, [rng.choice((1, 2)) for _ in range(nsp)])
        if transposed and rng.random() < 0.5:
            # output_padding < stride (or dilation) lets the blocks tile the output
            dil = _tuple(kw.get("dilation", 1), nsp)
            op = [min(max(s - (dil[i] * (kernel[i] - 1) + 1), 0), max(s, dil[i]) - 1)
                  for i, s in enumerate(stride)]
            kw["output_padding"] = _maybe_tuple(rng, op)
        if stride != [1] * nsp or rng.random() < 0.2:
            kw["stride"] = _maybe_tuple(rng, stride)
        if groups > 1:
            kw["groups"] = groups
        batched = rng.random() < 0.8
        x = f64(rng, *([rng.choice((1, 2, 4))] if batched else []), cin, *spatial)
        if transposed:
            w = f64(rng, cin, cout // groups, *kernel)
        else:
            w = f64(rng, cout, cin // groups, *kernel)
        if rng.random() < 0.5:
            kw["bias"] = f64(rng, cout)
        return (x, w), kw

    return gen


def register(registry: OpRegistry) -> None:
    r = registry.register
    for nsp, fn in enumerate((F.conv1d, F.conv2d, F.conv3d), start=1):
        r(fn, conv_anno, name=f"torch.nn.functional.conv{nsp}d", input_gen_fn=_gen_conv(nsp, False))
    for nsp, fn in enumerate((F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d), start=1):
        r(fn, conv_transpose_anno, name=f"torch.nn.functional.conv_transpose{nsp}d",
          input_gen_fn=_gen_conv(nsp, True))
