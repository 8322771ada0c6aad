"""``nnscaler.verify``: run a plan and its single-device model side by side, op by op.

``verify(module, dummy_forward_args, pas_policy, compute_config)`` answers "does this plan
train like one device?" and, when it does not, "where does it first go wrong?":

1. it traces the module and plans it exactly as [`parallelize`][nnscaler.parallelize] does, and
   writes the generated files into a temporary folder;
2. the *reference*: the traced graph runs op by op on one device
   (`nnscaler.ir.leaf_values`, ``Op.call``), keeping every op's output and, after
   backward, the gradient that reached it;
3. the *parallel run*: every runtime rank loads its real ``gencode{rank}.py`` and runs
   one forward and backward (``train_step`` for end2end modules, the pipeline schedule
   for pipelined ones). A trace function on the generated methods (``sys.settrace``, no
   change to the generated code) keeps the value of every local variable when it is
   assigned, and its gradient after backward. ``Program.variables`` says which op
   output each variable holds, and the op instance says which piece (index ranges and
   value part) of the full tensor it is;
4. the comparison, in program order: every piece of every op output against the
   reference over the piece's ranges (value-partial pieces summed with their sibling
   parts first), then, in backward order, every gradient. The first difference is
   reported with the op, its source line, the layouts on both sides and the size of the
   difference.

The ranks are this process group's when ``torch.distributed`` is initialised (run under
torchrun with ``runtime_ngpus`` processes); otherwise ``verify`` starts
``runtime_ngpus`` CPU processes with gloo itself (forked; POSIX only).

Pipelined plans run ``pipeline_nmicros`` copies of the sample; every micro-batch is
compared with the one reference. Random ops (dropout) draw different numbers on
different devices and are reported as differences; verify with dropout off.

The parts live beside this module: the report types in `nnscaler.parallel.verify_report`,
the parallel run in `nnscaler.parallel.verify_ranks`, the comparison in
`nnscaler.parallel.verify_compare`.
"""

from __future__ import annotations

import copy
import inspect
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from nnscaler.errors import VerifyError
from nnscaler.parallel.config import ComputeConfig
from nnscaler.parallel.verify_compare import Compare
from nnscaler.parallel.verify_ranks import backward, fresh, run_everywhere
from nnscaler.parallel.verify_report import ATOL, RTOL, Difference, VerifyReport

__all__ = ["Difference", "VerifyError", "VerifyReport", "verify"]


# -- the reference ------------------------------------------------------------------------


def _reference(graph: Any, state: Mapping[str, torch.Tensor], args: Mapping[str, Any],
               end2end: bool) -> tuple[dict[Any, torch.Tensor], dict[Any, torch.Tensor],
                                       dict[str, torch.Tensor]]:
    """Every op output of the traced ``graph`` run on one device, the gradient that
    reached it (``run_graph``'s loop, keeping what it computes), and every parameter's
    gradient by name."""
    from nnscaler.ir import CURRENT_DEVICE, SubTensor, default_device, leaf_values

    params = {n: fresh(t) for n, t in state.items()}
    env = leaf_values(graph, params, fresh(dict(args)))
    device = default_device(env)
    values: dict[Any, torch.Tensor] = {}
    live: dict[Any, torch.Tensor] = {}

    def value_of(leaf: Any) -> Any:
        if isinstance(leaf, SubTensor):
            return env[leaf.full]
        return device if leaf is CURRENT_DEVICE else leaf

    grad_on = torch.is_grad_enabled()
    try:
        for op in graph.ops:
            torch.set_grad_enabled(grad_on and not op.no_grad)
            result = op.call(pytree.tree_map(value_of, op.inputs),
                             pytree.tree_map(value_of, dict(op.kwargs)))
            for before, after in op.mutations:
                env[after.full] = env[before.full]
                values[after.full] = env[before.full].detach().to("cpu", copy=True)
            for ir, value in zip(op.outputs, pytree.tree_leaves(result), strict=True):
                if isinstance(ir, SubTensor) and isinstance(value, torch.Tensor):
                    env[ir.full] = value
                    values[ir.full] = value.detach().to("cpu", copy=True)
                    if value.requires_grad and not value.is_leaf:
                        value.retain_grad()
                        live[ir.full] = value
    finally:
        torch.set_grad_enabled(grad_on)
    backward(pytree.tree_map(value_of, graph.outputs), end2end)
    grads = {full: t.grad.detach().to("cpu", copy=True) for full, t in live.items()
             if t.grad is not None}
    param_grads = {n: t.grad.detach().to("cpu", copy=True) for n, t in params.items()
                   if isinstance(t, torch.Tensor) and t.grad is not None}
    return values, grads, param_grads


# -- the entry point ----------------------------------------------------------------------


def _policy_name(pas_policy: Any) -> str:
    if isinstance(pas_policy, str):
        return pas_policy
    return getattr(pas_policy, "__qualname__", repr(pas_policy))


def _check_args(module: Any, dummy_forward_args: Any, compute_config: Any) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"verify takes the single-device torch.nn.Module, got "
                        f"{type(module).__name__} {module!r}")
    if not isinstance(dummy_forward_args, Mapping):
        raise TypeError(f"dummy_forward_args must be a dict of forward arguments by name (as "
                        f"for parallelize), got {type(dummy_forward_args).__name__}")
    if not isinstance(compute_config, ComputeConfig):
        raise TypeError(f"compute_config must be an nnscaler.ComputeConfig, got "
                        f"{type(compute_config).__name__} {compute_config!r}")
    if compute_config.inference_only:
        raise VerifyError("verify compares forward and backward; it needs "
                          "ComputeConfig(inference_only=False)")


def verify(
    module: torch.nn.Module,
    dummy_forward_args: dict[str, Any],
    pas_policy: str | Callable[[Any, ComputeConfig], Any],
    compute_config: ComputeConfig,
    *,
    rtol: float = RTOL,
    atol: float = ATOL,
    timeout: float = 600.0,
) -> VerifyReport:
    """Run ``module`` on one device and the plan ``pas_policy`` makes for it on
    ``compute_config.runtime_ngpus`` processes, and compare them op by op.

    Arguments are those of [`parallelize`][nnscaler.parallelize] (``dummy_forward_args`` are
    also the inputs compared on; for an end2end module, the sample). Returns a
    [`VerifyReport`][nnscaler.VerifyReport]: ``report.equal``, or ``report.first``, the first op in
    program order whose output differs (else, in backward order, the first gradient), with its
    source line, the layouts on both sides and the difference. ``module`` is left as it
    was. Under torchrun (``torch.distributed`` initialised, ``runtime_ngpus`` processes)
    every rank calls it and gets the same report; otherwise it forks ``runtime_ngpus``
    CPU processes with gloo, which must finish within ``timeout`` seconds.
    """
    from nnscaler.codegen import build_program, emit_files
    from nnscaler.graph import IRGraph
    from nnscaler.parallel.api import _resolve_auto, _resolve_policy
    from nnscaler.trace import trace

    start = time.perf_counter()
    _check_args(module, dummy_forward_args, compute_config)
    policy_fn = _resolve_policy(pas_policy)
    config = compute_config
    state = {n: t.detach().clone().requires_grad_(t.requires_grad)
             for n, t in module.named_parameters(remove_duplicate=False)}
    state.update({n: t.detach().clone() for n, t in module.named_buffers(remove_duplicate=False)})
    try:
        traced_module = copy.deepcopy(module)  # tracing runs forward: keep the user's intact
    except Exception:  # noqa: BLE001 - a module that does not copy: restore its state below
        traced_module = module
    try:
        graph = trace(traced_module, dummy_forward_args, strategy=config.tracing.strategy)
    finally:
        if traced_module is module:
            with torch.no_grad():
                for n, t in [*module.named_parameters(remove_duplicate=False),
                             *module.named_buffers(remove_duplicate=False)]:
                    t.copy_(state[n])
    planned = policy_fn(IRGraph.from_graph(graph), config)
    if not isinstance(planned, IRGraph):
        raise VerifyError(f"the policy {_policy_name(pas_policy)!r} must return the IRGraph it "
                          f"was given, got {type(planned).__name__}")
    config = _resolve_auto(config, planned, _policy_name(pas_policy))
    planned.check(config.plan_ngpus)
    program = build_program(
        planned, plan_ngpus=config.plan_ngpus, runtime_ngpus=config.runtime_ngpus,
        end2end=config.use_end2end, inference_only=False, compute_config=config,
        forward_signature=inspect.signature(module.forward))
    nmicros = program.pipeline.settings.nmicros if program.pipeline is not None else 1
    ref_values, ref_grads, ref_params = _reference(graph, state, dummy_forward_args,
                                                   config.use_end2end)

    with tempfile.TemporaryDirectory(prefix="nnscaler-verify-") as outdir:
        emit_files(planned, outdir, plan_ngpus=config.plan_ngpus,
                   runtime_ngpus=config.runtime_ngpus, state=state,
                   end2end=config.use_end2end, compute_config=config, program=program)
        records = run_everywhere(outdir, dummy_forward_args, config, nmicros, timeout)
    compare = Compare(program, records, ref_values, ref_grads, ref_params, nmicros, rtol, atol)
    first = compare.forward() or compare.backward() or compare.parameters()
    return VerifyReport(
        equal=first is None, first=first, policy=_policy_name(pas_policy),
        plan_ngpus=config.plan_ngpus, runtime_ngpus=config.runtime_ngpus,
        compared_outputs=compare.outputs, compared_gradients=compare.gradients,
        compared_parameter_gradients=compare.parameter_gradients,
        unrecorded=tuple(sorted(compare.unrecorded)),
        rtol=rtol, atol=atol, seconds=time.perf_counter() - start)


# -- the command --------------------------------------------------------------------------


def _load(path: str, what: str, *, call: bool = True) -> Any:
    """``package.module:name`` -> the object (called, with ``call``, when it is callable
    and not a module)."""
    import importlib

    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise VerifyError(f"{what} must be given as 'package.module:name' (an import path, a "
                          f"colon, then a callable or object in that module), got {path!r}")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise VerifyError(f"{what} {path!r}: cannot import {module_name!r} ({e}); run from the "
                          f"folder that holds it or add it to PYTHONPATH") from e
    for part in attr.split("."):
        if not hasattr(found, part):
            raise VerifyError(f"{what} {path!r}: {module_name!r} has no attribute {attr!r}")
        found = getattr(found, part)
    if call and callable(found) and not isinstance(found, torch.nn.Module):
        found = found()
    return found


def add_arguments(parser: Any) -> None:
    """The options of ``python -m nnscaler verify`` (an ``argparse`` parser)."""
    import argparse

    parser.add_argument("model", help="the single-device module: 'package.module:factory', a "
                        "function returning an nn.Module (or a module object)")
    parser.add_argument("inputs", help="the dummy forward arguments: 'package.module:function' "
                        "returning a dict by argument name (as for parallelize)")
    parser.add_argument("--policy", required=True, help="a registered policy name (dp, data, "
                        "tp, pp, hybrid, ...) or 'package.module:function'")
    parser.add_argument("--plan-ngpus", type=int, default=2)
    parser.add_argument("--runtime-ngpus", type=int, default=None,
                        help="default: plan_ngpus")
    parser.add_argument("--end2end", action=argparse.BooleanOptionalAction, default=True,
                        help="forward(sample) returns the loss first (default); "
                        "--no-end2end backpropagates the sum of every output")
    parser.add_argument("--pas-config", default="{}", help="the policy's options, as JSON")
    parser.add_argument("--rtol", type=float, default=RTOL)
    parser.add_argument("--atol", type=float, default=ATOL)
    parser.add_argument("--timeout", type=float, default=600.0)


def run_command(args: Any) -> int:
    """``python -m nnscaler verify``: print the report; exit status 0 when equal, 1 when a
    difference was found, 2 when the comparison could not run (the reason on stderr)."""
    try:
        return _command(args)
    except VerifyError as e:
        print(f"nnscaler verify: {e}", file=sys.stderr)
        return 2


def _command(args: Any) -> int:
    import json

    try:
        pas_config = json.loads(args.pas_config)
    except json.JSONDecodeError as e:
        raise VerifyError(f"--pas-config must be JSON (e.g. '{{\"pipeline_nmicros\": 2}}'), "
                          f"got {args.pas_config!r}: {e}") from e
    policy: Any = args.policy
    if ":" in policy:  # a policy function: imported, not called
        policy = _load(policy, "--policy", call=False)
    config = ComputeConfig(plan_ngpus=args.plan_ngpus,
                           runtime_ngpus=args.runtime_ngpus or args.plan_ngpus,
                           use_end2end=args.end2end, pas_config=pas_config)
    module = _load(args.model, "the model")
    inputs = _load(args.inputs, "the inputs")
    report = verify(module, inputs, policy, config, rtol=args.rtol, atol=args.atol,
                    timeout=args.timeout)
    print(report)
    return 0 if report.equal else 1
