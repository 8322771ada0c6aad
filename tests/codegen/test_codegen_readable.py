"""Generated code is a product: people read it. Names follow the module paths, each op
carries its source line, adapters name their primitives, and the file imports only
torch, the ops' own modules and the public runtime."""

from __future__ import annotations

import ast
import re

from plan_helpers import fresh, megatron_mlp

from nnscaler.codegen import build_program, generate, generate_rank
from nnscaler.codegen.wrap import unwrap


def _source(rank: int = 0, runtime_ngpus: int = 2) -> str:
    program = build_program(megatron_mlp(fresh("gpt"), 2), plan_ngpus=2,
                            runtime_ngpus=runtime_ngpus, end2end=True)
    return unwrap(generate_rank(program, rank))


def test_parameters_are_named_after_module_paths():
    src = _source()
    assert ("self.add_param('gpt_blocks_0_attn_q_proj_weight', "
            "'gpt.blocks.0.attn.q_proj.weight'") in src
    assert "self.gpt_blocks_1_mlp_fc_weight" in src
    # the tied LM head is one parameter with both names
    assert "names=('gpt.wte.weight', 'gpt.lm_head.weight')" in src
    assert "def _forward_impl(self, batch):" in src
    assert "batch_input_ids = batch['input_ids']" in src


def test_every_op_is_under_its_source_line():
    src = _source()
    assert "# gpt.py:82  y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)" in src
    body = src.split("def _forward_impl", 1)[1].splitlines()[1:]
    seen_comment = False
    for line in body:
        text = line.strip()
        if text.startswith("# gpt.py:"):
            seen_comment = True
        elif re.match(r"t\d+ = ", text):
            assert seen_comment, f"op without a source comment above it: {text}"


def test_adapters_name_their_primitives():
    src = _source(rank=3, runtime_ngpus=4)
    lines = src.splitlines()
    adapters = [i for i, line in enumerate(lines) if re.match(r"ADAPTER_\d+ = Adapter\(", line)]
    assert adapters
    for i in adapters:
        assert lines[i - 1].startswith("# "), lines[i]
        assert "over [2, 3]" in lines[i - 1]  # scale unit 1: runtime ranks 2 and 3
        assert "@[2,3]" in lines[i]


def test_imports_only_torch_op_modules_and_the_runtime():
    for rank, src in generate(build_program(megatron_mlp(fresh("gpt"), 2), plan_ngpus=2,
                                            runtime_ngpus=2)).items():
        tree = ast.parse(src)
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                modules.add(node.module or "")
        assert modules == {"torch", "torch.nn.functional", "nnscaler.runtime"}, (rank, modules)
        compile(src, f"gencode{rank}.py", "exec")


def test_ranks_of_different_units_differ_only_in_rank_numbers():
    program = build_program(megatron_mlp(fresh("gpt"), 2), plan_ngpus=2, runtime_ngpus=4)
    a, b = generate_rank(program, 1), generate_rank(program, 3)

    def numbers_out(text: str) -> str:
        return re.sub(r"\d+", "N", text)

    assert a != b and numbers_out(a) == numbers_out(b)
