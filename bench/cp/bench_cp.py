"""Context parallelism on CPU processes (gloo, OMP_NUM_THREADS=1).

``--what memory``: activation memory per rank at a fixed total sequence, by degree. For
each degree ``d`` in ``--degrees``, ``d`` processes parallelize ``GPTWithLoss`` (``--layers``
layers, d_model 128, 4 heads, vocab 256, batch 1, ``--seq`` tokens) with the ``sequence``
policy (``plan_ngpus=d``, ring attention; degree 1 is the module as it is, attention by
``scaled_dot_product_attention``) and run one forward and backward. Memory is counted as
in ``bench/parallel/bench_recompute_memory.py``: a ``TorchDispatchMode`` adds the bytes of
every storage the ops make until it is freed; ``after forward`` is what is alive when the
forward returns (what autograd keeps for backward), ``peak`` the largest count during
forward and backward. Reported per rank (the largest rank), in MiB, and as a ratio to
degree 1.

``--what time``: the step time (forward and backward) of causal attention alone at
``--seq`` tokens on ``--world`` processes, by strategy: ``zigzag`` ring, plain ``ring``
and ``allgather`` (every rank gathers all keys and values), in the same processes,
interleaved (``bench/_launch.py``'s ``time_modes``); and whether
``torch.distributed.tensor.experimental.context_parallel`` runs on CPU here.

``--what tpcp``: memory per rank (activations after forward, the peak, and the weights)
of the ``megatron`` policy on 4 processes: ``tensor_model_parallel_size=4``,
``context_parallel_size=4`` and 2 x 2 (tensor x context parallelism in one scale unit),
with and without ``sequence_parallel``, against one process, counted as for
``--what memory``.

Prints a table, then one JSON line. Usage::

    python bench/cp/bench_cp.py --what memory [--seq 4096] [--degrees 1 2 4]
    python bench/cp/bench_cp.py --what time [--seq 4096] [--world 4] [--steps 5]
    python bench/cp/bench_cp.py --what tpcp [--seq 4096] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))  # bench/_launch.py
sys.path.insert(0, str(HERE / "parallel"))  # LiveBytes
from _launch import compare_modes, launch, time_modes  # noqa: E402
from bench_recompute_memory import LiveBytes  # noqa: E402

MIB = 2.0**20
HEADS, HEAD_DIM = 4, 32


def _memory_rank(rank: int, world: int, seq: int, layers: int, gen: str,
                 megatron: dict[str, int] | None = None) -> dict[str, float]:
    """One forward and backward on this rank: the ``sequence`` policy over ``world``
    devices, or the ``megatron`` policy with the sizes ``megatron``."""
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch

    cfg = GPTConfig(vocab_size=256, n_layer=layers, n_head=HEADS, d_model=HEADS * HEAD_DIM,
                    seq_len=seq)
    torch.manual_seed(0)
    model = GPTWithLoss(cfg)
    batch = make_batch(cfg, 1)
    if megatron is not None:
        from nnscaler_policy_megatron import megatron_compute_config

        config = megatron_compute_config(**megatron)
        name = "megatron-" + "-".join(f"{k[:2]}{int(v)}" for k, v in megatron.items())
    else:
        config = ComputeConfig(plan_ngpus=world, runtime_ngpus=world,
                               pas_config={"attention": "ring"})
        name = f"cp{world}"
    if world > 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            policy = "sequence" if megatron is None else "megatron"
            model = parallelize(model, {"batch": batch}, policy, config, gen_savedir=gen,
                                instance_name=name)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    counter = LiveBytes()
    with counter:
        loss = model(batch)
        after_forward = counter.live
        loss.backward()
    return {"after_forward": after_forward / MIB, "peak": counter.peak / MIB,
            "weights": weights / MIB, "loss": float(loss)}


#: ``--what tpcp``: ways to use 4 devices on one model copy
TPCP_PLANS = {
    "tp4": {"tensor_model_parallel_size": 4},
    "cp4": {"context_parallel_size": 4},
    "tp2xcp2": {"tensor_model_parallel_size": 2, "context_parallel_size": 2},
    "tp2xcp2+sp": {"tensor_model_parallel_size": 2, "context_parallel_size": 2,
                   "sequence_parallel": True},
}


def tpcp(args: argparse.Namespace) -> dict[str, Any]:
    """Activation and weight memory per rank on 4 processes: megatron tp 4, cp 4 and
    tp 2 x cp 2 in one scale unit, against one process."""
    rows = {}
    with tempfile.TemporaryDirectory() as gen:
        one = launch(_memory_rank, 1, args.seq, args.layers, gen)[0]
    rows["one process"] = one
    for name, sizes in TPCP_PLANS.items():
        with tempfile.TemporaryDirectory() as gen:
            per_rank = launch(_memory_rank, 4, args.seq, args.layers, gen, sizes)
        rows[name] = {key: max(r[key] for r in per_rank)
                      for key in ("after_forward", "peak", "weights")}
        rows[name]["loss"] = per_rank[0]["loss"]
    print(f"memory per rank (the largest rank), megatron on 4 processes, GPT {args.layers} "
          f"layers, seq {args.seq} (MiB; ratio to one process)")
    print(f"{'plan':>12} {'after forward':>14} {'ratio':>6} {'peak':>9} {'ratio':>6} "
          f"{'weights':>8} {'ratio':>6} {'loss':>9}")
    for name, row in rows.items():
        print(f"{name:>12} {row['after_forward']:>14.1f} "
              f"{row['after_forward'] / one['after_forward']:>6.3f} {row['peak']:>9.1f} "
              f"{row['peak'] / one['peak']:>6.3f} {row['weights']:>8.2f} "
              f"{row['weights'] / one['weights']:>6.3f} {row['loss']:>9.5f}")
    return {"what": "tpcp", "seq": args.seq, "layers": args.layers, "rows": rows}


def memory(args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    for degree in args.degrees:
        with tempfile.TemporaryDirectory() as gen:
            per_rank = launch(_memory_rank, degree, args.seq, args.layers, gen)
        rows[degree] = {key: max(r[key] for r in per_rank) for key in ("after_forward", "peak")}
        rows[degree]["loss"] = per_rank[0]["loss"]
    base = rows[args.degrees[0]]
    print(f"activation memory per rank, GPT {args.layers} layers, seq {args.seq} (MiB)")
    print(f"{'degree':>6} {'after forward':>14} {'ratio':>6} {'peak':>9} {'ratio':>6} {'loss':>9}")
    for degree, row in rows.items():
        print(f"{degree:>6} {row['after_forward']:>14.1f} "
              f"{row['after_forward'] / base['after_forward']:>6.3f} {row['peak']:>9.1f} "
              f"{row['peak'] / base['peak']:>6.3f} {row['loss']:>9.5f}")
    return {"what": "memory", "seq": args.seq, "layers": args.layers, "rows": rows}


def _attention_inputs(seq: int, rank: int, world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(1, HEADS, seq, HEAD_DIM, generator=g) for _ in range(3)]
    return [t.chunk(world, -2)[rank].clone().requires_grad_(True) for t in whole]


def _torch_cp_runs(seq: int, world: int) -> str:
    """Try torch's own context parallelism on this CPU mesh; say what happened."""
    try:
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, HEADS, seq, HEAD_DIM, generator=g) for _ in range(3))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        got = [q.clone(), k.clone(), v.clone()]
        with context_parallel(mesh, buffers=got, buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(*got, is_causal=True)
        rank = torch.distributed.get_rank()
        err = (out - want.chunk(world, 2)[rank]).abs().max().item()
        return f"ran; max error against the whole op on rank {rank}'s chunk: {err:.2e}"
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return f"does not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _time_rank(rank: int, world: int, seq: int, steps: int) -> dict[str, Any]:
    from nnscaler.ops.builtin.context_parallel import context_parallel_attention
    from nnscaler.runtime.partgroup import ProcessPartGroup

    group = ProcessPartGroup(list(range(world)))
    inputs = _attention_inputs(seq, rank, world)
    up = torch.randn(1, HEADS, seq // world, HEAD_DIM, generator=torch.Generator().manual_seed(1))

    def step(strategy: str):
        def run() -> float:
            out = context_parallel_attention(*inputs, is_causal=True, strategy=strategy,
                                             group=group)
            (out * up).sum().backward()
            return float(out.detach().sum())
        return run

    modes = {name: step(name) for name in ("zigzag", "ring", "allgather")}
    result = time_modes(modes, steps, warmup=1)
    result["torch_cp"] = _torch_cp_runs(min(seq, 256), world)
    return result


def timing(args: argparse.Namespace) -> dict[str, Any]:
    results = launch(_time_rank, args.world, args.seq, args.steps)
    summary = compare_modes(results, "zigzag", args.steps, "ratio_to_zigzag")
    print(f"causal attention forward + backward, seq {args.seq}, {args.world} processes, "
          f"{HEADS} heads x {HEAD_DIM} (per step, median of {args.steps})")
    for mode, row in summary.items():
        print(f"{mode:>10} {json.dumps({k: round(v, 4) for k, v in row.items()})}")
    print(f"torch context_parallel on CPU: {results[0]['torch_cp']}")
    return {"what": "time", "seq": args.seq, "world": args.world, "summary": summary,
            "torch_cp": results[0]["torch_cp"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--what", choices=("memory", "time", "tpcp"), required=True)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    out = {"memory": memory, "time": timing, "tpcp": tpcp}[args.what](args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
