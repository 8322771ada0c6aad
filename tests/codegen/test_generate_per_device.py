"""``generate`` makes each device's code once and shares it across scale units: every
file must be exactly the one ``generate_rank`` writes for that rank alone (plain plans,
tensor parallelism with ZeRO, pipelines, and a forward input whose gradient is summed over
the unit, which names the unit's ranks in the body)."""

from __future__ import annotations

import pytest
import torch
from plan_helpers import case, data_parallel, megatron_mlp, replicate_rest
from torch import nn

from nnscaler.codegen import build_program, emit_files, generate, generate_rank
from nnscaler.codegen.file_parts import Wrapped as _Wrapped
from nnscaler.codegen.wrap import unwrap, wrap_lines
from nnscaler.graph import IRGraph
from nnscaler.trace import trace

PIPE = {"pas_config": {"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"}}


def _same_as_alone(program) -> dict[int, str]:
    shared = generate(program)
    assert sorted(shared) == list(range(program.runtime_ngpus))
    for rank, text in shared.items():
        assert text == generate_rank(program, rank), f"rank {rank}"
    return shared


def _staged(name: str, devices: list[int]) -> IRGraph:
    graph = IRGraph.from_graph(case(name).graph)
    ops = graph.nodes()
    n = len(devices)
    graph.staging([ops[0], *(ops[len(ops) * k // n] for k in range(1, n))])
    for op in graph.nodes():
        graph.assign(op, devices[op.stage])
    return graph


@pytest.mark.parametrize("runtime_ngpus", [2, 6])
def test_data_parallel_with_zero(runtime_ngpus):
    graph = data_parallel(IRGraph.from_graph(case("gpt").graph), 2)
    program = build_program(graph, plan_ngpus=2, runtime_ngpus=runtime_ngpus, end2end=True,
                            compute_config={"use_zero": True})
    files = _same_as_alone(program)
    if runtime_ngpus == 6:
        assert "scale unit 2 of 3" in " ".join(files[5].split())


def test_tensor_parallel_adapters_name_each_units_ranks():
    graph = megatron_mlp(IRGraph.from_graph(case("gpt").graph), 2)
    replicate_rest(graph, 2)
    program = build_program(graph, plan_ngpus=2, runtime_ngpus=6)
    files = _same_as_alone(program)
    adapters = [line for line in unwrap(files[5]).splitlines() if line.startswith("ADAPTER_")]
    assert adapters and all("@[4,5]" in line and "@[0,1]" not in line for line in adapters)


def test_pipeline_over_three_units():
    program = build_program(_staged("gpt", [0, 1]), plan_ngpus=2, runtime_ngpus=6,
                            end2end=True, compute_config=PIPE)
    files = _same_as_alone(program)
    assert "stage_ranks=(4, 5)" in files[4].replace("\n", " ")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x))


def test_input_gradient_summed_over_each_unit(tmp_path):
    """The body names the unit's ranks (``boundary.input(x, ranks=...)``): each unit
    gets its own, and emit_files writes what generate_rank does."""
    torch.manual_seed(0)
    module = Block()
    x = torch.randn(4, 8, requires_grad=True)
    graph = data_parallel(IRGraph.from_graph(trace(module, {"x": x})), 2)
    program = build_program(graph, plan_ngpus=2, runtime_ngpus=4)
    files = _same_as_alone(program)
    assert "boundary.input(x, ranks=[0, 1])" in files[1]
    assert "boundary.input(x, ranks=[2, 3])" in files[3]
    emit_files(graph, tmp_path, plan_ngpus=2, runtime_ngpus=4, state=module, program=program)
    for rank in range(4):
        assert (tmp_path / f"gencode{rank}.py").read_text() == files[rank]


def test_wrapped_parts_join_like_the_whole():
    """Parts wrapped apart equal the whole wrapped, unless a part leaves a '\"\"\"' open
    (then the file is wrapped whole)."""
    long = "x = f(" + ", ".join(f"argument_{k}" for k in range(20)) + ")"
    parts = [["a = 1", long], ['"""doc', long, '"""'], [long]]
    wrapped = [_Wrapped.of(p) for p in parts]
    assert not any(w.ends_in_string for w in wrapped)
    joined = [line for w in wrapped for line in w.lines]
    assert joined == wrap_lines([line for p in parts for line in p])
    assert _Wrapped.of(['s = """open', long]).ends_in_string


def test_call_keys_tell_apart_what_is_written_differently():
    from nnscaler.codegen.emit import _call_key
    from nnscaler.codegen.literals import Code

    keys = [_call_key(x) for x in (0.0, -0.0, 0, False, (1,), [1], {"a": 1}, {"b": 1},
                                   Code("x"), "x", slice(1, 2), slice(1, 3), ...)]
    assert None not in keys and len(set(keys)) == len(keys)
    assert _call_key([Code("t1"), 2]) == _call_key([Code("t1"), 2])
    assert _call_key(torch.ones(2)) is None and _call_key((1, torch.ones(2))) is None
    assert _call_key(object()) is None
