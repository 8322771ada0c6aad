"""ZeRO stage 3 in the generated file: the forward gathers, prefetches and frees each unit
around the statements that read it (those calls are the mechanism: nothing else gathers
in forward), and the header lists the shard of every parameter piece the rank holds.

`check_gathers` reads a generated method like the runtime runs it: it follows the
``zero3`` calls and fails on a statement that reads a parameter of a unit that is not
gathered there, on a unit gathered twice or freed while not gathered. The parity of these
plans is in tests/parallel/test_zero_parity.py and tests/pipeline/test_pipeline_zero3.py,
which also check the header's shard ranges against the runtime's buckets.
"""

from __future__ import annotations

import ast
import re

import pytest
from plan_helpers import fresh

from nnscaler import ComputeConfig
from nnscaler.codegen import build_program, generate_rank
from nnscaler.codegen.gathers import with_gathers
from nnscaler.codegen.wrap import unwrap
from nnscaler.policies import data, pp, tp
from nnscaler.runtime.zero3 import unit_of

_CALL = re.compile(r"^\s*zero3\.(gather|prefetch|free)\(self, (zero3\.REST|'[^']*')\)$")
_READ = re.compile(r"\bself\.([A-Za-z_]\w*)")


def _unit(text: str) -> str:
    return "" if text == "zero3.REST" else text.strip("'")


def _methods(src: str) -> dict[str, list[str]]:
    """Each method of ``GenModel`` -> its body's lines."""
    tree = ast.parse(src)
    lines = src.splitlines()
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenModel")
    return {f.name: lines[f.body[0].lineno - 1:f.end_lineno] for f in cls.body
            if isinstance(f, ast.FunctionDef)}


def _units(src: str, zero_units: tuple[str, ...] = ()) -> dict[str, str]:
    """attribute -> unit of the file's trainable parameters (from its add_param lines)."""
    out = {}
    for m in re.finditer(r"self\.add_param\('(\w+)', '([\w.]+)'(.*)\)$", src, re.M):
        if "requires_grad=False" not in m.group(3):
            out[m.group(1)] = unit_of(m.group(2), zero_units)
    return out


def check_gathers(src: str, zero_units: tuple[str, ...] = (), whole: set[str] = frozenset()
                  ) -> dict[str, list[tuple[str, str]]]:
    """Follow the zero3 calls of every forward method of ``src`` (``_forward_impl`` or
    ``_stage_*``): every read of a stage-3 parameter (``whole``: held whole) happens while
    its unit is gathered, directly or through a ``_recompute_*`` method. Returns the calls
    per method."""
    methods = _methods(src)
    units = {a: u for a, u in _units(src, zero_units).items() if a not in whole}
    reads_of = {name: {units[a] for line in body for a in _READ.findall(line) if a in units}
                for name, body in methods.items() if name.startswith("_recompute_")}
    calls: dict[str, list[tuple[str, str]]] = {}
    for name, body in methods.items():
        if name != "_forward_impl" and not name.startswith("_stage_"):
            continue
        gathered: set[str] = set()
        calls[name] = []
        for line in body:
            call = _CALL.match(line)
            if call:
                what, unit = call.group(1), _unit(call.group(2))
                calls[name].append((what, unit))
                if what == "gather":
                    assert unit not in gathered, f"{name}: {unit!r} gathered twice: {line}"
                    gathered.add(unit)
                elif what == "free":
                    assert unit in gathered, f"{name}: {unit!r} freed, not gathered: {line}"
                    gathered.discard(unit)
                continue
            assert "zero3." not in line, line
            for attr in _READ.findall(line):
                needed = {units[attr]} if attr in units else reads_of.get(attr, set())
                missing = needed - gathered
                assert not missing, f"{name}: {line.strip()!r} reads {missing}, not gathered"
    return calls


def _program(policy, plan_ngpus: int, runtime_ngpus: int, name: str = "gpt", **config):
    cfg = ComputeConfig(plan_ngpus=plan_ngpus, runtime_ngpus=runtime_ngpus, zero_stage=3,
                        **config)
    graph = policy(fresh(name), cfg)
    return build_program(graph, plan_ngpus=plan_ngpus, runtime_ngpus=runtime_ngpus,
                         end2end=True, compute_config=cfg), graph


def test_each_block_reads_between_its_gather_and_its_free():
    program, _ = _program(data, 1, 2)
    src = unwrap(generate_rank(program, 1))
    calls = check_gathers(src)["_forward_impl"]
    assert "from nnscaler.runtime import ParallelModule, boundary, zero3" in src
    blocks = sorted({u for _, u in calls if u})
    assert blocks == ["gpt.blocks.0", "gpt.blocks.1"]
    # the rest unit first (the embedding), each block prefetched while the one before
    # runs, each freed before the next is gathered, the rest unit freed after the head
    assert calls == [
        ("gather", ""), ("prefetch", "gpt.blocks.0"),
        ("gather", "gpt.blocks.0"), ("prefetch", "gpt.blocks.1"),
        ("free", "gpt.blocks.0"),
        ("gather", "gpt.blocks.1"),
        ("free", "gpt.blocks.1"),
        ("free", ""),
    ]
    body = "\n".join(_methods(src)["_forward_impl"])
    first = body.index("self.gpt_blocks_0_")
    assert body.rindex("zero3.gather(self, 'gpt.blocks.0')", 0, first) > 0
    compile(src, "gencode1.py", "exec")


def test_the_header_lists_the_shards_of_the_rank():
    program, _ = _program(data, 1, 2)
    head = generate_rank(program, 1).split('"""')[1]
    assert "ZeRO stage 3: this rank holds a shard of each parameter piece below" in head
    assert "    unit gpt.blocks.0, sharded over ranks [0, 1]:" in head
    assert "    unit zero3.REST (the rest), sharded over ranks [0, 1]:" in head
    # rank 1 holds the second half of a unit's flat buffer: the last pieces of block 0
    # (part of its fc weight), none of its first ones
    assert "        gpt_blocks_0_ln_1_weight (8,): none of 8" in head
    assert "        gpt_blocks_0_mlp_fc_weight (32, 8): [116, 256) of 256" in head
    assert "        gpt_blocks_0_mlp_proj_bias (8,): [0, 8) of 8" in head
    assert "        gpt_wte_weight (32, 8): [160, 256) of 256" in head


@pytest.mark.parametrize("policy,plan,runtime", [(tp, 2, 4), (data, 1, 2)])
def test_tensor_parallel_and_named_units(policy, plan, runtime):
    units = ("gpt.blocks", "gpt.wte") if policy is data else ()
    program, _ = _program(policy, plan, runtime, zero_units=units)
    for rank in range(runtime):
        src = unwrap(generate_rank(program, rank))
        calls = check_gathers(src, units)["_forward_impl"]
        gathered = [u for what, u in calls if what == "gather"]
        if units:  # wte, wpe (the rest), the blocks, wte again for the tied head
            assert gathered == ["gpt.wte", "", "gpt.blocks", "gpt.wte"], gathered
        else:
            assert gathered[:2] == ["", "gpt.blocks.0"], gathered
        if policy is tp:  # a piece: its ranges are shown
            assert re.search(r"gpt_blocks_0_attn_q_proj_weight \(8, 8\) \[\d+:\d+, 0:8\]", src)


def test_recomputed_blocks_are_gathered_around_their_checkpoint():
    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=2, zero_stage=3)
    graph = data(fresh("gpt"), cfg)
    for block in ("gpt.blocks.0", "gpt.blocks.1"):
        graph.recompute(block)
    program = build_program(graph, plan_ngpus=1, runtime_ngpus=2, end2end=True,
                            compute_config=cfg)
    src = unwrap(generate_rank(program, 0))
    calls = check_gathers(src)["_forward_impl"]
    assert ("gather", "gpt.blocks.1") in calls
    forward = "\n".join(_methods(src)["_forward_impl"])
    assert re.search(r"zero3\.gather\(self, 'gpt\.blocks\.0'\)\n.*\n.*checkpoint\("
                     r"self\._recompute_0", forward)
    assert "zero3" not in "\n".join(_methods(src)["_recompute_0"])  # backward: the runtime


def test_pipeline_stages_gather_their_own_units():
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=4, zero_stage=3, use_end2end=True,
                        pas_config={"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"})
    graph = pp(fresh("gpt"), cfg)
    program = build_program(graph, plan_ngpus=2, runtime_ngpus=4, end2end=True,
                            compute_config=cfg)
    for rank in range(4):
        src = unwrap(generate_rank(program, rank))
        whole = set(re.findall(r"^        (\w+) \(", src.split("Held whole", 1)[1].split(
            '"""')[0], re.M)) if "Held whole" in src else set()
        calls = check_gathers(src, whole=whole)
        assert [m for m in calls if m.startswith("_stage_")], calls
        assert "gpt_wte_weight" in whole  # tied across the first and the last stage


def test_with_gathers_keeps_with_blocks_and_multiline_statements():
    body = [
        "x = boundary.check({",
        "    'a': 1,",
        "})",
        "with torch.no_grad():",
        "    # model.py:3  y = f(x)",
        "    y = f(x, self.a_w)",
        "z = g(y, self.b_w)",
        "return z",
    ]
    out = with_gathers(body, [], {"a_w": "a.0", "b_w": "b.0"})
    assert out == [
        "x = boundary.check({",
        "    'a': 1,",
        "})",
        "with torch.no_grad():",
        "    zero3.gather(self, 'a.0')",
        "    zero3.prefetch(self, 'b.0')",
        "    # model.py:3  y = f(x)",
        "    y = f(x, self.a_w)",
        "zero3.free(self, 'a.0')",
        "zero3.gather(self, 'b.0')",
        "z = g(y, self.b_w)",
        "zero3.free(self, 'b.0')",
        "return z",
    ]
