"""The throughput check of ``bench/gpu/check.py``: the Trainer against a plain PyTorch
loop and ``torch.compile`` of that loop, on the same Llama and the same batch.

The model: Hugging Face ``LlamaForCausalLM`` with sdpa attention and random weights, on
CUDA of TinyLlama's shape (d 2048, 22 layers, 32 heads, 4 key-value heads, MLP 5632,
vocabulary 32000: 1.10 B parameters), sequence 2048, micro-batch 4; on CPU a tiny one.
Every mode trains in bf16 with fp32 master weights and fp32 AdamW state
(``nnscaler.cli.precision.mixed_precision(AdamW)``, what ``TrainerArgs(precision='bf16')``
uses) and starts from the same weights (a state dict saved once):

- ``trainer``: ``Trainer.run()`` with ``pas_policy='dp'`` and a plan of one device
  (``plan_ngpus=runtime_ngpus=1``), its data loader over a dataset whose first batch is the
  batch the loops use, steps timed end to end (loader, step, bookkeeping) from one step's
  end to the next through the ``on_train_step_end`` hook;
- ``eager``: ``zero_grad``, ``model(batch).backward()``, ``step`` on the same batch;
- ``compiled``: the same loop over ``torch.compile(model)`` (compilation is left out of
  the timed steps and reported apart). The backend is inductor, but on CPU ``aot_eager``
  by default (``--compile-backend``): dynamo's capture and AOTAutograd's joint graph run
  as on the GPU, while inductor's C++ code generation would take minutes on 2 cores.

The device is synchronized at the end of every timed step in every mode (the Trainer
reads the loss each step anyway). Figures: the median step, tokens per second and MFU,
with FLOPs per token ``6 N + 12 L d T`` (N: parameters but the input embedding, whose
lookup does no matmul; L layers, d the model width, T the sequence length: PaLM's count,
attention's score and value products in full, without halving them for the causal mask)
over the device's dense bf16 peak; and ours / eager, the step-time ratio (goal <= 1.02).
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from typing import Any

import torch
from gpu_checks import LlamaLM, device_of, sync, time_steps, token_batch
from gpu_common import Context, Result, timeout_in

LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                max_position_embeddings=2048, tie_word_embeddings=False)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=64, tie_word_embeddings=False)
SIZES = {"cuda": (LLAMA_1B, 2048, 4), "cpu": (LLAMA_TINY, 32, 2)}  # config, seq, batch
GOAL = 1.02  # ours / eager
#: bf16 first-step losses of the three modes: the same weights and batch in the same
#: dtype; reordered sums move the loss by a few units of bf16 roundoff at most
LOSS_TOL = 1e-2


class TokenWindows:
    """A dataset of ``n`` random token rows, row ``i`` fixed by its index, so that the
    Trainer's first (unshuffled) batch is :func:`gpu_checks.token_batch`'s."""

    def __init__(self, vocab: int, seq: int, n: int, batch: int) -> None:
        self.data = [token_batch(vocab, batch, seq, seed=k) for k in range(n // batch)]
        self.batch = batch

    def __len__(self) -> int:
        return len(self.data) * self.batch

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        part = self.data[i // self.batch]
        return {k: v[i % self.batch] for k, v in part.items()}


def flops_per_token(config: dict[str, Any], params: int, seq: int) -> float:
    """``6 N + 12 L d T`` (see the module docstring); N excludes the input embedding."""
    n = params - config["vocab_size"] * config["hidden_size"]
    return 6 * n + 12 * config["num_hidden_layers"] * config["hidden_size"] * seq


def _optimizer(params: Any) -> torch.optim.Optimizer:
    from nnscaler.cli.precision import mixed_precision

    return mixed_precision(torch.optim.AdamW)(params, lr=1e-4)


def _loop(model: torch.nn.Module, batch: dict[str, torch.Tensor], dev: torch.device,
          warmup: int, steps: int) -> tuple[list[float], float]:
    opt = _optimizer(model.parameters())

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(batch)
        loss.backward()
        opt.step()
        return loss.detach()

    times, first = time_steps(step, dev, warmup, steps)
    return times, float(first)


def _trainer(ctx: Context, config: dict[str, Any], seq: int, batch: int, weights: str,
             warmup: int, steps: int) -> tuple[list[float], float, float]:
    from nnscaler.cli.trainer import Trainer
    from nnscaler.cli.trainer_args import (
        CheckpointConfig,
        ComputeConfig,
        DatasetConfig,
        DatasetSamplerConfig,
        HookMapConfig,
        ModelConfig,
        OptimizerConfig,
        TrainerArgs,
    )

    dev = device_of(ctx)
    ends: list[float] = []
    losses: list[float] = []

    def on_step_end(trainer: Any, outputs: Any) -> None:
        sync(dev)
        ends.append(time.perf_counter())
        losses.append(trainer.last_train_loss)

    work = ctx.workdir / "throughput"
    args = TrainerArgs(
        compute_config=ComputeConfig(plan_ngpus=1, runtime_ngpus=1, use_end2end=True,
                                     trace_strategy="meta"),
        model=ModelConfig(type=LlamaLM, args=config),
        optimizer=OptimizerConfig(type=torch.optim.AdamW, args={"lr": 1e-4}),
        dataset=DatasetConfig(type=TokenWindows, train_args={
            "vocab": config["vocab_size"], "seq": seq, "n": batch * (warmup + steps + 1),
            "batch": batch}),
        dataset_sampler=DatasetSamplerConfig(train_args={"shuffle": False}),
        pas_policy="dp", precision="bf16", gen_savedir=str(work / "gen"), seed=0,
        tracing_from_weights=weights, micro_batch_size=batch,
        max_train_steps=warmup + steps + 1, enable_progress_bar=False,
        log_every_n_steps=10**6, hook=HookMapConfig(on_train_step_end=on_step_end),
        checkpoint=CheckpointConfig(save_dir=str(work / "ckpt"), no_save=True),
    )
    t0 = time.perf_counter()
    trainer = Trainer(train_args=args)
    with warnings.catch_warnings():
        # under trace_strategy='meta' the Trainer also loads tracing_from_weights into the
        # module it builds on the meta device, where torch warns once per parameter that
        # the copy does nothing; the module it trains is built again with the weights
        warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter")
        trainer.run()
    setup = (ends[0] if ends else time.perf_counter()) - t0
    # step k's time: from step k-1's end to step k's end; the first `warmup` left out
    times = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]
    del trainer
    return times, losses[0], setup


def _row(name: str, times: list[float], tokens: int, fpt: float,
         peak: float | None) -> dict[str, Any]:
    med = statistics.median(times)
    tps = tokens / med
    return {"mode": name, "median_ms": med * 1e3, "min_ms": min(times) * 1e3,
            "tokens_per_s": tps,
            "mfu": (fpt * tps / (peak * 1e12)) if peak else None, "steps": len(times)}


def throughput(ctx: Context) -> list[Result]:
    config, seq, batch = SIZES[ctx.device]
    dev = device_of(ctx)
    warmup = 2
    steps = ctx.steps or (10 if ctx.cuda else 3)
    torch.manual_seed(0)
    with torch.device(dev):  # initialising 1 B parameters takes seconds on the GPU, not 10s
        base = LlamaLM(**config).to(torch.bfloat16)
    params = sum(p.numel() for p in base.parameters())
    weights = str(ctx.workdir / "llama.pt")
    torch.save({k: v.cpu() for k, v in base.state_dict().items()}, weights)
    del base
    data = {k: v.to(dev) for k, v in token_batch(config["vocab_size"], batch, seq).items()}
    tokens = batch * seq
    fpt = flops_per_token(config, params, seq)
    peak = ctx.peak_tflops if ctx.cuda else None

    def fresh() -> torch.nn.Module:
        with torch.device(dev):
            model = LlamaLM(**config).to(torch.bfloat16)
        model.load_state_dict(torch.load(weights, map_location=dev, weights_only=True))
        return model

    first: dict[str, float] = {}
    extra: dict[str, float] = {}
    times: dict[str, list[float]] = {}

    def trainer() -> None:
        times["trainer"], first["trainer"], extra["trainer_setup_s"] = _trainer(
            ctx, config, seq, batch, weights, warmup, steps)

    def eager() -> None:
        times["eager"], first["eager"] = _loop(fresh(), data, dev, warmup, steps)

    def compiled() -> None:
        model = fresh()
        t0 = time.perf_counter()
        fn = torch.compile(model, backend=ctx.compile_backend)
        times["compiled"], first["compiled"] = _loop(fn, data, dev, warmup, steps)
        extra["compile_and_warmup_s"] = time.perf_counter() - t0 - sum(times["compiled"])

    errors = _run_modes({"trainer": trainer, "eager": eager, "compiled": compiled}, ctx)
    rows = [_row(m, t, tokens, fpt, peak) for m, t in times.items()]
    eager_ms = times and "eager" in times and rows[[r["mode"] for r in rows].index("eager")]
    for row in rows:
        row["over_eager"] = row["median_ms"] / eager_ms["median_ms"] if eager_ms else None
    ratio = rows[0]["over_eager"] if rows and rows[0]["mode"] == "trainer" else None
    loss_err = ({m: abs(v - first["eager"]) / abs(first["eager"]) for m, v in first.items()}
                if "eager" in first else {})
    ok = (not errors and all(math.isfinite(v) for v in first.values())
          and max(loss_err.values(), default=math.inf) <= LOSS_TOL)
    figures = {"model": config, "parameters": params, "seq": seq, "micro_batch": batch,
               "tokens_per_step": tokens, "flops_per_token": fpt,
               "flop_formula": "6*N + 12*L*d*T (N: parameters without the input embedding)",
               "peak_tflops": peak, "rows": rows, "first_loss": first,
               "first_loss_rel_err": loss_err, "loss_tolerance": LOSS_TOL,
               "trainer_over_eager": ratio, "goal": GOAL,
               "goal_met": None if ratio is None else ratio <= GOAL, "errors": errors,
               "warmup": warmup, "compile_backend": ctx.compile_backend, **extra,
               "table": _table(rows, params, seq, batch, peak)}
    speeds = ", ".join(f"{r['mode']} {r['tokens_per_s']:.0f}" for r in rows)
    line = f"Llama {_count(params)} bf16 sdpa, seq {seq}, batch {batch}: tok/s {speeds or 'none'}"
    line += f" (compile backend {ctx.compile_backend})"
    if ratio is not None:
        line += f"; ours/eager {ratio:.3f} (goal <= {GOAL}: {'met' if ratio <= GOAL else 'not met'})"
    if peak and rows:
        line += "; MFU " + "/".join(f"{r['mfu']:.1%}" for r in rows)
    line += "; first losses " + "/".join(f"{v:.4f}" for v in first.values()) + f" (tol {LOSS_TOL})"
    if errors:
        line += "; " + "; ".join(f"{m}: {e}" for m, e in errors.items())
    return [Result("PASS" if ok else "FAIL", "throughput", line, figures)]


def _run_modes(modes: dict[str, Any], ctx: Context) -> dict[str, str]:
    """Run each mode; one that raises is recorded and the next runs, but a timeout (the
    check's limit, already spent) ends the check with what was measured so far."""
    import traceback

    errors: dict[str, str] = {}
    for name, fn in modes.items():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the other modes still run
            timeout = timeout_in(e)
            if timeout is not None:
                errors[name] = f"CheckTimeout: {timeout}"
                break
            traceback.print_exc()
            text = str(e).strip().splitlines()
            errors[name] = f"{type(e).__name__}: {text[0][:300] if text else ''}"
        finally:
            _free(ctx)
    return errors


def _count(params: int) -> str:
    return f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"


def _free(ctx: Context) -> None:
    import gc

    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def _table(rows: list[dict[str, Any]], params: int, seq: int, batch: int,
           peak: float | None) -> str:
    head = (f"throughput: Llama {_count(params)}, bf16, sdpa, seq {seq}, micro-batch "
            f"{batch}; MFU = (6N + 12 L d T) x tokens/s / "
            + (f"{peak:g} TFLOP/s" if peak else "peak (n/a on CPU)"))
    lines = [head, f"{'mode':10} {'median step':>12} {'tokens/s':>10} {'MFU':>7} "
                   f"{'x eager':>8}"]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        lines.append(f"{r['mode']:10} {r['median_ms']:>9.1f} ms {r['tokens_per_s']:>10.0f} "
                     f"{mfu:>7} {r['over_eager']:>8.3f}")
    return "\n".join(lines)
