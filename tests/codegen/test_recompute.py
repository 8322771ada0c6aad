"""Activation recomputation (``graph.recompute``) in generated code: the ops of a group
run inside ``torch.utils.checkpoint.checkpoint`` and the plan still trains exactly like
one device; with dropout the random masks are the same as without recomputation; groups
code generation cannot honour are refused with the op's source line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from codegen_helpers import run_parity
from dist_utils import run_distributed
from plan_helpers import fresh, traced_case

from nnscaler import ComputeConfig
from nnscaler.codegen import (
    CodegenError,
    build_program,
    emit_files,
    generate_rank,
    load_generated_class,
)
from nnscaler.codegen.wrap import unwrap
from nnscaler.graph import IRGraph
from nnscaler.models import gpt as gpt_module
from nnscaler.models.gpt import GPTConfig, GPTWithLoss
from nnscaler.policies import data, pp, tp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))


def _every_block(graph: IRGraph) -> IRGraph:
    for i in range(len({op.module_path.split(".")[2] for op in graph.ops
                        if op.module_path.startswith("gpt.blocks.")})):
        graph.recompute(f"gpt.blocks.{i}")
    return graph


def _planned(policy, plan_ngpus: int, runtime_ngpus: int, name: str = "gpt") -> IRGraph:
    graph = policy(fresh(name), ComputeConfig(plan_ngpus=plan_ngpus, runtime_ngpus=runtime_ngpus))
    return _every_block(graph)


def test_the_forward_calls_each_group_through_checkpoint():
    program = build_program(_planned(data, 2, 2), plan_ngpus=2, runtime_ngpus=2, end2end=True)
    src = unwrap(generate_rank(program, 0))
    assert "import torch.utils.checkpoint" in src
    assert ("t65 = torch.utils.checkpoint.checkpoint(self._recompute_0, t42, "
            "use_reentrant=False)") in src
    assert "    def _recompute_0(self, t42):" in src and "    def _recompute_1(self, t65):" in src
    body = src.split("def _forward_impl", 1)[1].split("def _recompute_0", 1)[0]
    assert "layer_norm" not in body.split("return", 1)[0].split("t88 = ", 1)[0]
    compile(src, "gencode0.py", "exec")


def test_adapters_cut_a_group_and_run_once():
    """Under tp every block all-reduces twice: the block becomes three checkpointed
    pieces and the all-reduces stay in the forward, outside them."""
    program = build_program(_planned(tp, 2, 2), plan_ngpus=2, runtime_ngpus=2, end2end=True)
    src = unwrap(generate_rank(program, 1))
    forward = src.split("    def _forward_impl", 1)[1].split("\n    def ", 1)[0]
    assert forward.count("torch.utils.checkpoint.checkpoint(self._recompute_0") == 3
    for method in src.split("\n    def _recompute_")[1:]:
        assert "ADAPTER_" not in method


def test_inference_only_runs_the_group_inline():
    program = build_program(_planned(data, 2, 2), plan_ngpus=2, runtime_ngpus=2,
                            end2end=True, inference_only=True)
    src = generate_rank(program, 0)
    assert "checkpoint" not in src and "_recompute_" not in src


@pytest.mark.parametrize("policy,plan_ngpus,runtime_ngpus",
                         [(tp, 2, 2), (data, 2, 4), (tp, 2, 4)])
def test_parity_with_every_block_recomputed(tmp_path, policy, plan_ngpus, runtime_ngpus):
    graph = _planned(policy, plan_ngpus, runtime_ngpus)
    run_parity(tmp_path, "gpt", graph, plan_ngpus=plan_ngpus, runtime_ngpus=runtime_ngpus,
               steps=2)


def test_pipeline_stages_recompute_their_blocks(tmp_path):
    from pipeline_helpers import config, plan
    from pipeline_helpers import run_parity as run_pipeline_parity

    cfg = config(2, pipeline_nmicros=2, pipeline_scheduler="1f1b")
    graph = _every_block(plan("gpt", pp, cfg))
    results = run_pipeline_parity(tmp_path, "gpt", graph, cfg)
    assert results
    for rank in range(2):
        src = (tmp_path / "gen" / f"gencode{rank}.py").read_text()
        assert src.count("torch.utils.checkpoint.checkpoint(") == 2  # 2 blocks per stage


# -- dropout: the same masks with and without recomputation ------------------------------
def _dropout_case():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=8, seq_len=6, dropout=0.25)
    module = GPTWithLoss(config)
    return traced_case("gpt_dropout", module, {"batch": gpt_module.make_batch(config, 4)})


def _dropout_worker(rank: int, world: int, dirs: list[str], batch) -> list:
    out = []
    for outdir in dirs:
        torch.manual_seed(1234 + rank)
        m = load_generated_class(outdir, rank)(init_params=True)
        steps = []
        for _ in range(2):
            m.zero_grad()
            loss = m(batch)
            loss.backward()
            grads = {a: p.grad.clone() for a, p in m.named_parameters() if p.grad is not None}
            steps.append((loss.detach().clone(), grads))
        out.append(steps)
    return out


def test_dropout_draws_the_same_masks_when_recomputed(tmp_path):
    c = _dropout_case()
    dirs = []
    for k, recompute in enumerate((False, True)):
        graph = data(IRGraph.from_graph(c.graph), ComputeConfig(plan_ngpus=2, runtime_ngpus=2))
        if recompute:
            _every_block(graph)
        emit_files(graph, tmp_path / str(k), plan_ngpus=2, runtime_ngpus=2, state=c.module,
                   end2end=True)
        dirs.append(str(tmp_path / str(k)))
    assert "checkpoint(" in (tmp_path / "1" / "gencode0.py").read_text()
    for plain, recomputed in run_distributed(_dropout_worker, 2, dirs, c.args["batch"]):
        assert plain[0][0] != plain[1][0]  # dropout is on: two forwards differ
        for (loss_a, grads_a), (loss_b, grads_b) in zip(plain, recomputed, strict=True):
            assert torch.equal(loss_a, loss_b)
            assert grads_a.keys() == grads_b.keys()
            for name in grads_a:
                assert torch.equal(grads_a[name], grads_b[name]), name


# -- refused ------------------------------------------------------------------------------
def test_a_group_across_pipeline_stages_is_refused():
    graph = fresh("gpt")
    graph.recompute(["gpt.blocks.0", "gpt.blocks.1"])
    graph.staging([graph.nodes()[0], graph.select(module="gpt.blocks.1")[0]])
    for op in graph.nodes():
        graph.assign(op, op.stage)
    with pytest.raises(CodegenError, match=r"gpt\.py:\d+.*recompute group 0 and in pipeline "
                                           r"stage 1.*Fix: mark the ops of each stage"):
        build_program(graph, plan_ngpus=2, runtime_ngpus=2, end2end=True, compute_config={
            "pas_config": {"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"}})


def _head_and_loss_recomputed() -> IRGraph:
    graph = tp(fresh("gpt"), ComputeConfig(plan_ngpus=2, runtime_ngpus=2))
    graph.recompute([op for op in graph.nodes() if op.module_path == ""
                     or "cross_entropy" in op.name])
    return graph


def test_a_collective_part_op_cuts_its_group_and_runs_once():
    """The class-parallel cross-entropy exchanges its normalizers: like an adapter it runs
    once in the forward, outside the checkpointed pieces."""
    program = build_program(_head_and_loss_recomputed(), plan_ngpus=2, runtime_ngpus=2,
                            end2end=True)
    src = unwrap(generate_rank(program, 0))
    forward = src.split("    def _forward_impl", 1)[1].split("\n    def ", 1)[0]
    assert "class_parallel_cross_entropy" in forward
    for method in src.split("\n    def _recompute_")[1:]:
        assert "class_parallel_cross_entropy" not in method


@pytest.mark.slow  # test_experts.py's recomputed expert-parallel MoE covers the path fast
def test_parity_with_a_collective_part_op_in_the_group(tmp_path):
    run_parity(tmp_path, "gpt", _head_and_loss_recomputed(), plan_ngpus=2, runtime_ngpus=2,
               steps=2)


def test_an_op_that_changes_an_input_of_its_group_is_refused():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            h.mul_(2.0)
            return h.sum()

    from nnscaler.trace import trace

    torch.manual_seed(0)
    graph = IRGraph.from_graph(trace(Model(), {"x": torch.randn(2, 4)}))
    for op in graph.nodes():
        graph.assign(op, 0)
    graph.recompute([op for op in graph.nodes() if op.inplace or op.name.endswith("sum")])
    with pytest.raises(CodegenError, match=r"test_recompute\.py:\d+.*changes t\d+ in place.*"
                                           r"input of recompute group 0"):
        generate_rank(build_program(graph, plan_ngpus=1, runtime_ngpus=1), 0)


# -- code generation is linear in the pieces ---------------------------------------------
def _pieces_body(n: int) -> tuple[list[str], dict]:
    """A forward of ``n`` recomputed pieces, an adapter line between each two."""
    from nnscaler.codegen.recompute import BEGIN, END, Segment

    body, segments = ["p0 = x * 1"], {}
    for i in range(n):
        segments[i] = Segment(i)
        body += [f"{BEGIN}{i}>", f"a{i} = torch.relu(p{i})", f"q{i} = a{i} * 2", END,
                 f"p{i + 1} = ADAPTER(q{i})"]
    body.append(f"return p{n}")
    return body, segments


@pytest.mark.parametrize("n", [8, 64])
def test_extract_parses_every_line_once(monkeypatch, n):
    """The pieces of a 40-layer model used to re-parse the whole method around each one
    (quadratic: 41 of the 49 s of an 18B-parameter compile); every line is parsed once."""
    from nnscaler.codegen import recompute as rc

    parsed: list[int] = []
    real = rc._parse
    rc._run_names.cache_clear()  # runs are remembered by their text
    monkeypatch.setattr(rc, "_parse", lambda lines: parsed.append(len(lines)) or real(lines))
    body, segments = _pieces_body(n)
    new, methods = rc.extract(body, ["x"], segments)
    lines = sum(1 for line in body if not line.startswith(("#<", "#</")))
    assert sum(parsed) == lines  # each run of lines once, never the method again
    assert rc.extract(body, ["x"], segments) == (new, methods)  # another device's
    assert sum(parsed) == lines  # same lines: not parsed again
    assert len(methods) == n
    assert new[1] == "q0 = torch.utils.checkpoint.checkpoint(self._recompute_0, p0, " \
                     "use_reentrant=False)"
    assert methods[1][0] == "def _recompute_1(self, p1):" and methods[1][-1] == "    return q1"
