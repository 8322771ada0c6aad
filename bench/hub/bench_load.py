"""Peak memory of loading Hub-format weights into a parallel plan (docs/pretrained.md).

A Llama of about 1.2 B parameters (the shape of Llama-3.2-1B: hidden 2048, 16 layers,
vocabulary 128256, tied embedding; float32, about 4.9 GB; ``--shape tinyllama-1.1b``:
TinyLlama-1.1B's, 22 layers, vocabulary 32000, untied, 4.4 GB) gets random weights and is
saved by transformers' own ``save_pretrained`` into a temporary folder, in a child
process that exits before the ranks start. Then, for ``tp`` and ``pp`` on 2 CPU
processes, each rank builds the model with ``nnscaler.meta_parameters()``, parallelizes
it with ``trace_strategy='meta'`` (``pp``: stages balanced by the parameters they hold,
``--pp-balance``) and calls ``nnscaler.load_pretrained``; its logits on one
batch must equal the HF model's (rtol 1e-5, atol 1e-5 of the largest logit).

Memory is the kernel's resident-set high-water mark, ``VmHWM`` of ``/proc/self/status``
(anonymous and file-backed pages together), read at the end of each rank: ``peak`` over
the whole process (imports, tracing, code generation, loading, the forward), and
``load peak``, after resetting the mark (``/proc/self/clear_refs``) right before
``load_pretrained``. Both are printed as bytes and as a ratio of the model's size.

    python bench/hub/bench_load.py               # the 1.2 B model (needs ~12 GB of disk)
    python bench/hub/bench_load.py --layers 2 --hidden 256 --vocab 1024   # a quick run
    python bench/hub/bench_load.py --shape tinyllama-1.1b                  # untied
    python bench/hub/bench_load.py --reshard     # also tp on 4 -> files -> pp on 2
    python bench/hub/bench_load.py --reshard --only-reshard   # just that

``--reshard``: ``tp`` on 4 ranks (built for training) loads the folder, gets an Adam
optimizer whose state is filled deterministically (``exp_avg = 0.1 * p``,
``exp_avg_sq = p * p``, ``step = 3``; filled, saved and dropped one rank at a time, so the
4 ranks never hold all of it at once) and saves its per-rank model and optimizer files;
then ``pp`` on 2 ranks loads both with ``nnscaler.load_resharded(pm, files, optimizer,
optimizer_files)``. Its load peak is printed as a ratio of the model plus Adam's state
(3x the model's size), and its optimizer state is checked against the formulas above.

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# the shapes of two public 1 B Llamas (their config.json files): Llama-3.2-1B ties its LM
# head to the embedding, TinyLlama-1.1B does not
SHAPES = {
    "llama3.2-1b": dict(hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8,
                        vocab=128256, tied=True),
    "tinyllama-1.1b": dict(hidden=2048, layers=22, intermediate=5632, heads=32, kv_heads=4,
                           vocab=32000, tied=False),
}


def config(args: argparse.Namespace):
    import transformers

    c = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate or args.hidden * 4,
        num_hidden_layers=args.layers, num_attention_heads=args.heads or args.hidden // 64,
        num_key_value_heads=args.kv_heads or max(1, args.hidden // 256), vocab_size=args.vocab,
        max_position_embeddings=256, tie_word_embeddings=args.tied,
    )
    c._attn_implementation = "sdpa"
    return c


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 1000, (2, 16), generator=g)}


def save_model(args: argparse.Namespace, folder: str) -> None:
    """In a child process: random weights, saved by transformers, and the reference
    logits beside them."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(args))
    model.save_pretrained(folder, safe_serialization=True)
    with torch.no_grad():
        logits = model(**batch()).logits
    torch.save(logits, os.path.join(folder, "reference_logits.pt"))


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class WithLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, b: dict[str, torch.Tensor]):
        out = self.model(input_ids=b["input_ids"], labels=b["input_ids"])
        return out.loss, out.logits


def build(args: argparse.Namespace, gen: str, policy: str, world: int):
    """The meta-built model, parallelized (no weights anywhere yet). Built for inference
    (no gradient buffers: what a rank holds is its parameters, and the optimizer state
    when one is built over them)."""
    import transformers

    import nnscaler

    warnings.simplefilter("ignore")
    with nnscaler.meta_parameters():
        model = WithLoss(transformers.LlamaForCausalLM(config(args)))
    cfg = nnscaler.ComputeConfig(plan_ngpus=world, runtime_ngpus=world, trace_strategy="meta",
                                 use_end2end=True,
                                 pas_config={"pipeline_nmicros": 1,
                                             "pipeline_balance": args.pp_balance},
                                 inference_only=True)
    return nnscaler.parallelize(model, {"b": batch()}, policy, cfg, gen_savedir=gen,
                                init_module_params=False, instance_name=f"{policy}{world}")


def fill_adam(optimizer: torch.optim.Optimizer) -> None:
    """Adam's state as after some steps, deterministic in the parameters (so that
    another plan can check what it loaded)."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p] = {"step": torch.tensor(3.0), "exp_avg": p * 0.1,
                                      "exp_avg_sq": p * p}


def check_adam(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            exact = (float(st["step"]) == 3.0
                     and torch.equal(st["exp_avg"], p.detach() * 0.1)
                     and torch.equal(st["exp_avg_sq"], p.detach() * p.detach()))
            if not exact:  # a check of the loader, kept under python -O too
                raise RuntimeError(
                    f"the resharded Adam state of a parameter of shape {tuple(p.shape)} is "
                    f"not the state that was saved (step 3, exp_avg = 0.1 p, exp_avg_sq = p^2)"
                )


def run_rank(rank: int, world: int, args: argparse.Namespace, folder: str, gen: str,
             policy: str, files: list[str] | None = None, train: bool = False) -> dict:
    """Load into ``policy`` on ``world`` ranks: from the Hub folder, or (``files``) from
    another plan's per-rank files with load_resharded (``train``: with Adam's state);
    measure, check the logits."""
    import torch.distributed as dist

    import nnscaler

    pm = build(args, gen, policy, world)
    held = sum(t.numel() * t.element_size() for t in pm.state_dict().values()
               if isinstance(t, torch.Tensor))
    # torch's Adam over the module's tensors (build_optimizer refuses inference-only modules)
    opt = torch.optim.Adam(pm.parameters_for_optimizer(), lr=1e-4) if train else None
    opt_files = None if files is None else [f.replace("_rank", "_opt") for f in files]
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    if files is None:
        nnscaler.load_pretrained(pm, folder)
    else:
        nnscaler.load_resharded(pm, files, opt, opt_files if train else None)
    seconds = time.perf_counter() - start
    load_peak = status("VmHWM")
    held_opt = 0
    if opt is not None and files is not None:
        check_adam(opt)
        held_opt = sum(v.numel() * v.element_size() for st in opt.state.values()
                       for v in st.values())
    with torch.no_grad():
        out = pm.infer_step([batch()])[0] if pm.pipeline is not None else pm(batch())
    ref = torch.load(os.path.join(folder, "reference_logits.pt"))
    scale = float(ref.abs().max())
    # rtol 1e-5, and an atol of 1e-5 of the logits' scale for the entries near zero (a
    # split sum rounds differently from the whole one)
    torch.testing.assert_close(out[1], ref, rtol=1e-5, atol=1e-5 * scale)
    if args.reshard and policy == "tp" and world == 4:  # the files pp on 2 reshards
        nnscaler.checkpoint.save(pm.state_dict(), os.path.join(gen, f"tp4_rank{rank}.pt"))
        for r in range(world):  # one rank at a time holds Adam's state
            if r == rank and opt is not None:
                fill_adam(opt)
                nnscaler.checkpoint.save(opt.state_dict(), os.path.join(gen, f"tp4_opt{rank}.pt"))
                opt.state.clear()
            dist.barrier()
    return {"held": held, "held_opt": held_opt, "rss_before_load": before, "load_peak": load_peak,
            "peak": status("VmHWM"), "seconds": seconds,
            "max_diff": float((out[1] - ref).abs().max()), "scale": scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3.2-1b",
                        help="the model's shape; --layers, --hidden and the others override "
                             "its values")
    for name in ("layers", "hidden", "intermediate", "heads", "kv-heads", "vocab"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                        help="the LM head tied to the embedding (default: as the shape)")
    parser.add_argument("--pp-balance", choices=["compute", "parameters"], default="parameters",
                        help="pas_config['pipeline_balance'] of the pp plans")
    parser.add_argument("--dir", default=None, help="where the temporary folder goes")
    parser.add_argument("--reshard", action="store_true",
                        help="also: tp on 4 ranks saves per-rank files, pp on 2 ranks loads "
                             "them with load_resharded, with Adam's state")
    parser.add_argument("--only-reshard", action="store_true",
                        help="with --reshard: skip the tp 2 and pp 2 loads from the folder")
    args = parser.parse_args()
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    root = tempfile.mkdtemp(prefix="bench_hub_", dir=args.dir)
    try:
        folder, gen = os.path.join(root, "hub"), os.path.join(root, "gen")
        with torch.device("meta"):
            import transformers

            nbytes = sum(p.numel() * 4 for p in
                         transformers.LlamaForCausalLM(config(args)).parameters())
        free = shutil.disk_usage(root).free
        need = (4.5 if args.reshard else 2.5) * nbytes  # the folder, the files, Adam's
        if free < need:
            print(f"skipped: {free / 1e9:.1f} GB free in {root}, the model needs "
                  f"{need / 1e9:.1f} GB")
            return
        start = time.perf_counter()
        child = mp.get_context("spawn").Process(target=save_model, args=(args, folder))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"saving the model failed (exit code {child.exitcode})")
        print(f"model: {nbytes / 1e9:.2f} GB float32 ({nbytes // 4 / 1e9:.2f} B parameters), "
              f"saved by transformers in {time.perf_counter() - start:.0f} s")
        from nnscaler.testing import run_distributed

        runs = [] if args.reshard and args.only_reshard else [("tp", 2, None), ("pp", 2, None)]
        if args.reshard:  # tp on 4 saves its files, pp on 2 reads them without a merge
            files = [os.path.join(gen, f"tp4_rank{r}.pt") for r in range(4)]
            runs += [("tp", 4, None), ("pp", 2, files)]
        report: dict = {"model_bytes": nbytes, "memory": "VmHWM", "runs": {}}
        for policy, world, files in runs:
            train = args.reshard and (world == 4 or files is not None)
            results = run_distributed(run_rank, world, args, folder, gen, policy, files, train,
                                      timeout=3600)
            what = f"{policy}{world}" + (" load_resharded (model + Adam) from tp4's files"
                                         if files else "")
            report["runs"][what] = [{k: r[k] for k in ("held", "held_opt", "load_peak", "peak",
                                                       "seconds")} for r in results]
            for rank, r in enumerate(results):
                print(f"{what} rank {rank}: holds {r['held'] / 1e9:.2f} GB "
                      f"({r['held'] / nbytes:.2f}x); VmHWM whole process "
                      f"{r['peak'] / 1e9:.2f} GB ({r['peak'] / nbytes:.2f}x); during "
                      f"the load {r['load_peak'] / 1e9:.2f} GB "
                      f"({r['load_peak'] / nbytes:.2f}x, {r['rss_before_load'] / 1e9:.2f} GB "
                      f"before it); load {r['seconds']:.1f} s; logits: max |diff| "
                      f"{r['max_diff']:.1e} "
                      f"(max |logit| {r['scale']:.2f})")
                if files:
                    total = 3 * nbytes  # the model, exp_avg and exp_avg_sq
                    print(f"{what} rank {rank}: holds {(r['held'] + r['held_opt']) / 1e9:.2f} GB "
                          f"of model + Adam state ({(r['held'] + r['held_opt']) / total:.2f}x "
                          f"of {total / 1e9:.2f} GB); during the load "
                          f"{r['load_peak'] / 1e9:.2f} GB (**{r['load_peak'] / total:.2f}x**); "
                          f"optimizer state checked")
        print(json.dumps(report))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
