"""Normalization: layer_norm, rms_norm, group_norm, batch_norm, instance_norm.

The dims a norm takes its statistics over are ``^``; the others split, and affine
parameters and running statistics split with the channel dim they carry.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F

from nnscaler.ops.builtin._common import idents, tensor_str
from nnscaler.ops.builtin.nn import f64, shape_of, size
from nnscaler.ops.registry import OpRegistry


def _opt(t: Any, dims: list[str]) -> str:
    return tensor_str(dims) if isinstance(t, torch.Tensor) else "?"


# -- layer_norm, rms_norm ------------------------------------------------------------------


def _last_dims(input, normalized_shape) -> tuple[list[str], list[str]]:
    k = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    names = idents(input.dim())
    dims = [n + "^" if i >= input.dim() - k else n for i, n in enumerate(names)]
    return dims, dims[input.dim() - k :]


def layer_norm_anno(input, normalized_shape, weight=None, bias=None, eps=1e-05) -> str:
    dims, norm = _last_dims(input, normalized_shape)
    x = tensor_str(dims)
    return f"{x}, ?, {_opt(weight, norm)}, {_opt(bias, norm)} -> {x}"


def torch_layer_norm_anno(
    input, normalized_shape, weight=None, bias=None, eps=1e-05, cudnn_enable=True
) -> str:
    return layer_norm_anno(input, normalized_shape, weight, bias)


def rms_norm_anno(input, normalized_shape, weight=None, eps=None) -> str:
    dims, norm = _last_dims(input, normalized_shape)
    x = tensor_str(dims)
    return f"{x}, ?, {_opt(weight, norm)} -> {x}"


def _gen_norm(with_bias: bool):
    def gen(rng: random.Random) -> tuple[tuple, dict]:
        shape = shape_of(rng, 1, 4)
        k = rng.randint(1, len(shape))
        ns = list(shape[len(shape) - k :])
        x = f64(rng, *shape)
        kw: dict[str, Any] = {}
        if rng.random() < 0.7:
            kw["weight"] = f64(rng, *ns)
        if with_bias and rng.random() < 0.7:
            kw["bias"] = f64(rng, *ns)
        if rng.random() < 0.3:
            kw["eps"] = 1e-3
        if rng.random() < 0.3:
            ns = tuple(ns)
        if rng.random() < 0.3 and not with_bias and "weight" in kw:
            return (x, ns, kw.pop("weight")), kw
        return (x, ns), kw

    return gen


# -- group_norm ----------------------------------------------------------------------------


def group_norm_anno(input, num_groups, weight=None, bias=None, eps=1e-05) -> str:
    # statistics per (sample, group) over the group's channels and all spatial dims; the
    # group count is a positional argument, which cannot size a hidden dim: channels '^'
    names = idents(input.dim())
    dims = [names[0], *(n + "^" for n in names[1:])]
    x = tensor_str(dims)
    return f"{x}, ?, {_opt(weight, [dims[1]])}, {_opt(bias, [dims[1]])} -> {x}"


def gen_group_norm(rng: random.Random) -> tuple[tuple, dict]:
    g = rng.choice((1, 2, 3))
    per_group = rng.choice((1, 2))
    spatial = [rng.choice((2, 3, 4)) for _ in range(rng.randint(0 if per_group > 1 else 1, 2))]
    c = g * per_group  # every group holds more than one value
    x = f64(rng, size(rng), c, *spatial)
    kw: dict[str, Any] = {}
    if rng.random() < 0.7:
        kw["weight"] = f64(rng, c)
        kw["bias"] = f64(rng, c)
    return (x, g), kw


# -- batch_norm, instance_norm ------------------------------------------------------------


def batch_norm_anno(
    input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
    eps=1e-05,
) -> str:
    # training (or no running statistics): statistics over the batch and spatial dims
    batch_stats = training or running_mean is None
    names = idents(input.dim())
    dims = [n + "^" if batch_stats and i != 1 else n for i, n in enumerate(names)]
    x = tensor_str(dims)
    c = [dims[1]]
    return (
        f"{x}, {_opt(running_mean, c)}, {_opt(running_var, c)}, {_opt(weight, c)}, "
        f"{_opt(bias, c)} -> {x}"
    )


def instance_norm_anno(
    input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
    momentum=0.1, eps=1e-05,
) -> str:
    names = idents(input.dim())
    if use_input_stats:
        # statistics per (sample, channel) over the spatial dims; the running statistics,
        # if any, are updated with the mean over the batch: then the batch is '^' too
        batch = names[0] + ("^" if running_mean is not None else "")
        dims = [batch, names[1], *(n + "^" for n in names[2:])]
    else:
        dims = names
    x = tensor_str(dims)
    c = [dims[1]]
    return (
        f"{x}, {_opt(running_mean, c)}, {_opt(running_var, c)}, {_opt(weight, c)}, "
        f"{_opt(bias, c)} -> {x}"
    )


def _stats(rng: random.Random, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    return f64(rng, c), f64(rng, c).abs() + 0.5


def gen_batch_norm(rng: random.Random) -> tuple[tuple, dict]:
    c = size(rng)
    x = f64(rng, rng.choice((2, 3, 4, 6)), c, *shape_of(rng, 0, 2))
    training = rng.random() < 0.5
    mean, var = _stats(rng, c) if (not training or rng.random() < 0.5) else (None, None)
    kw: dict[str, Any] = {"training": training}
    if rng.random() < 0.7:
        kw["weight"] = f64(rng, c)
    if rng.random() < 0.7:
        kw["bias"] = f64(rng, c)
    if rng.random() < 0.3:
        kw["momentum"] = 0.5
    return (x, mean, var), kw


def gen_instance_norm(rng: random.Random) -> tuple[tuple, dict]:
    c = size(rng)
    x = f64(rng, rng.choice((1, 2, 4)), c, *(rng.choice((2, 3, 4)) for _ in range(rng.randint(1, 2))))
    kw: dict[str, Any] = {}
    use_input_stats = rng.random() < 0.7
    if not use_input_stats:
        kw["use_input_stats"] = False
    if not use_input_stats or rng.random() < 0.4:
        kw["running_mean"], kw["running_var"] = _stats(rng, c)
    if rng.random() < 0.6:
        kw["weight"] = f64(rng, c)
        kw["bias"] = f64(rng, c)
    return (x,), kw


def register(registry: OpRegistry) -> None:
    r = registry.register
    r(F.layer_norm, layer_norm_anno, name="torch.nn.functional.layer_norm",
      input_gen_fn=_gen_norm(True))
    r(torch.layer_norm, torch_layer_norm_anno, name="torch.layer_norm",
      input_gen_fn=_gen_norm(True))
    r(F.rms_norm, rms_norm_anno, name="torch.nn.functional.rms_norm",
      input_gen_fn=_gen_norm(False))
    if hasattr(torch, "rms_norm"):
        r(torch.rms_norm, rms_norm_anno, name="torch.rms_norm", input_gen_fn=_gen_norm(False))
    r(F.group_norm, group_norm_anno, name="torch.nn.functional.group_norm",
      input_gen_fn=gen_group_norm)
    r(F.batch_norm, batch_norm_anno, name="torch.nn.functional.batch_norm",
      input_gen_fn=gen_batch_norm)
    r(F.instance_norm, instance_norm_anno, name="torch.nn.functional.instance_norm",
      input_gen_fn=gen_instance_norm)
