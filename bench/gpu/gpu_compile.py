"""The ``compiled-codegen`` check of ``bench/gpu/check.py``: generated code under
``torch.compile`` (``ComputeConfig(compile=...)``) on the device.

The project's GPT (fp32, the parity checks' sizes) is parallelized with a plan of one
device twice, eager and compiled (``--compile-backend``: inductor on CUDA, ``aot_eager``
on CPU, where inductor's C++ code generation takes minutes on 2 cores). The compiled
module's loss and every gradient of its first step are held against the eager model's,
as ||a - b|| / ||b|| per tensor, at the fp32 parity tolerance (1e-5); then both
modules train with SGD and their median step times give compiled / eager generated code.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
import warnings
from typing import Any

import torch
from gpu_checks import TOLERANCE, _rel, device_of, make_model, time_steps, to_device
from gpu_common import Context, Result


def _first_step(pm: torch.nn.Module, data: Any) -> torch.Tensor:
    loss = pm(data)
    loss.backward()
    pm.sync_grad()
    return loss


def _sgd_step(pm: torch.nn.Module, data: Any) -> Any:
    from nnscaler import build_optimizer

    opt = build_optimizer(pm, torch.optim.SGD, lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = pm(data)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def compiled_codegen(ctx: Context) -> list[Result]:
    from nnscaler import ComputeConfig, parallelize

    dev = device_of(ctx)
    model, batch = make_model("gpt", ctx.device)
    eager = copy.deepcopy(model).to(dev)
    data = to_device(batch, dev)
    modules = {}
    t0 = time.perf_counter()
    for name, compile_ in (("eager", False), ("compiled", {"backend": ctx.compile_backend})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            modules[name] = parallelize(
                copy.deepcopy(model), {"batch": batch}, "dp",
                ComputeConfig(1, 1, compile=compile_), gen_savedir=str(ctx.workdir / "gen"),
                instance_name=f"compiled-codegen-{name}")
    pm = modules["compiled"]
    ref = eager(data)
    ref.backward()
    loss = _first_step(pm, data)
    first_step_s = time.perf_counter() - t0
    ref_params = dict(eager.named_parameters(remove_duplicate=False))
    metas = [(a, m) for a, m in pm.fullmap.items() if m.kind == "parameter"]
    errs = {m.orig_name: _rel(getattr(pm, a).grad, ref_params[m.orig_name].grad)
            for a, m in metas}
    worst = max(errs, key=errs.get)
    loss_err = _rel(loss, ref)
    tol = TOLERANCE[torch.float32]
    warmup, steps = 2, ctx.steps or (10 if ctx.cuda else 5)
    times = {}
    for name, module in modules.items():
        module.zero_grad()
        times[name], _ = time_steps(_sgd_step(module, data), dev, warmup, steps)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    ratio = med["compiled"] / med["eager"]
    ok = loss_err <= tol and errs[worst] <= tol and all(math.isfinite(e) for e in errs.values())
    figures = {"backend": ctx.compile_backend, "loss": loss.item(), "eager_loss": ref.item(),
               "loss_rel_err": loss_err, "grads": len(errs), "max_grad_rel_err": errs[worst],
               "worst_grad": worst, "tolerance": tol, "median_ms": med,
               "compiled_over_eager": ratio, "build_and_first_step_s": first_step_s,
               "steps": steps}
    line = (f"GPT fp32, backend {ctx.compile_backend}: loss rel {loss_err:.1e}, {len(errs)} "
            f"grads max rel {errs[worst]:.1e} (tol {tol:g}); step {med['compiled']:.2f} ms "
            f"compiled vs {med['eager']:.2f} ms eager generated code ({ratio:.3f}x)")
    return [Result("PASS" if ok else "FAIL", "compiled-codegen", line, figures)]
