"""Code generation for pipelines: the generated files, tensors that skip a stage, and
the errors for plans and settings a pipeline cannot run."""

from __future__ import annotations

import pytest
from pipeline_helpers import case, config, generate, plan, run_parity

from nnscaler.codegen import CodegenError, build_program, generate_rank
from nnscaler.codegen.wrap import unwrap
from nnscaler.errors import UnknownNameError
from nnscaler.graph import IRGraph
from nnscaler.policies import pp


def _staged(name: str, devices: list[int], cuts: list[int] | None = None) -> IRGraph:
    """``name`` cut into ``len(devices)`` stages at ``cuts`` (positions; default: even),
    stage ``s`` whole on ``devices[s]``."""
    graph = IRGraph.from_graph(case(name).graph)
    ops = graph.nodes()
    n = len(devices)
    cuts = cuts if cuts is not None else [len(ops) * k // n for k in range(1, n)]
    graph.staging([ops[0], *(ops[c] for c in cuts)])
    for op in graph.nodes():
        graph.assign(op, devices[op.stage])
    return graph


PIPE = {"pas_config": {"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"}}


def test_the_generated_file_of_a_stage(tmp_path):
    cfg = config(2, pipeline_nmicros=2, pipeline_scheduler="1f1b")
    outdir = generate(tmp_path, "mlp8", plan("mlp8", pp, cfg), cfg)
    text = unwrap((outdir / "gencode1.py").read_text())
    assert "pipeline stage 1 of 2" in " ".join(text.splitlines()[:3])
    assert ("from nnscaler.runtime import ParallelModule, Piece, Pipeline, boundary, "
            "parse_schedule") in text
    assert "_forward_impl" not in text and "def _stage_0" not in text
    assert "    def _stage_1(self, batch, t" in text
    assert "receives t" in text and "returns the module's outputs" in text
    schedule = text.split('SCHEDULE = parse_schedule("""\n', 1)[1].split('""")', 1)[0]
    assert schedule.split("\n")[:4] == ["    RECV_ACT 0 s0->s1", "    F0@s1", "    B0@s1",
                                        "    SEND_GRAD 0 s1->s0, RECV_ACT 1 s0->s1"]
    assert "scheduler='1f1b'," in text and "stage_ranks=(0, 1)," in text
    assert "grad=True)" in text
    first = (outdir / "gencode0.py").read_text()
    assert "    def _stage_0(self, batch):" in first and "sends t" in first
    assert "return (t" in first


def test_a_tensor_that_skips_a_stage_passes_through(tmp_path):
    """The first layer's output is read by the third stage: the second stage receives it
    and sends it on, and its gradient comes back the same way."""
    graph = IRGraph.from_graph(case("skip").graph)
    ops = graph.nodes()
    starts = [next(i for i, op in enumerate(ops) if op.module_path == f"layers.{k}")
              for k in range(3)]
    graph.staging([ops[i] for i in starts])
    for op in graph.nodes():
        graph.assign(op, op.stage)
    cfg = config(3, pipeline_nmicros=3, pipeline_scheduler="1f1b")
    run_parity(tmp_path, "skip", graph, cfg)
    middle = (tmp_path / "gen" / "gencode1.py").read_text()
    last = (tmp_path / "gen" / "gencode2.py").read_text()
    signature = next(line for line in last.splitlines() if "def _stage_2" in line)
    skipped, _ = signature.split("batch, ", 1)[1].rstrip("):").split(", ")
    assert f"def _stage_1(self, batch, {skipped}):" in middle
    returned = next(line for line in middle.splitlines() if line.strip().startswith("return ("))
    assert returned.strip().startswith(f"return ({skipped}, ")  # passed on


def test_a_received_tensor_changed_in_place_is_cloned_first(tmp_path):
    graph = IRGraph.from_graph(case("inplace").graph)
    ops = graph.nodes()
    graph.staging([ops[0], next(op for op in ops if op.name.endswith("mul_"))])
    for op in graph.nodes():
        graph.assign(op, op.stage)
    run_parity(tmp_path, "inplace", graph, config(2, pipeline_nmicros=2,
                                                  pipeline_scheduler="gpipe"))
    text = (tmp_path / "gen" / "gencode1.py").read_text()
    signature = next(line for line in text.splitlines() if "def _stage_1" in line)
    received = signature.split("batch, ", 1)[1].rstrip("):")
    assert f"{received} = {received}.clone()" in text


def test_a_device_that_only_sends_inside_its_stage_gets_its_gradient(tmp_path):
    """Stage 0 on devices [0, 1]: the first linear runs on device 1 only and its output
    moves to device 0, so device 1 only sends it. Its gradient comes back inside the
    stage's backward because the stage output device 1 sends carries the anchor."""
    graph = IRGraph.from_graph(case("mlp8").graph)
    ops = graph.nodes()
    graph.staging([ops[0], ops[4]])
    graph.assign(ops[0], 1)
    graph.assign(ops[1], 0)
    for op in ops[2:]:
        base = 0 if op.stage == 0 else 2
        for k, copy in enumerate(graph.replicate(op, 2)):
            graph.assign(copy, base + k)
    run_parity(tmp_path, "mlp8", graph, config(4, pipeline_nmicros=2,
                                               pipeline_scheduler="1f1b"))
    text = unwrap((tmp_path / "gen" / "gencode1.py").read_text())
    (imported,) = [x for x in text.splitlines() if x.startswith("from nnscaler.runtime import")]
    assert " anchored," in imported and " Piece," in imported
    assert "return (anchored(t" in text


def test_tied_weight_is_held_by_both_stages():
    program = build_program(_staged("gpt", [0, 1]), plan_ngpus=2, runtime_ngpus=4,
                            end2end=True, compute_config=PIPE)
    for rank in range(4):  # both stages, both scale units
        text = unwrap(generate_rank(program, rank))
        line = next(x for x in text.splitlines() if "'gpt.wte.weight'" in x)
        assert "holders=(0, 1, 2, 3)" in line
    stage_1 = unwrap(generate_rank(program, 3))
    line = next(x for x in stage_1.splitlines() if "'gpt.ln_f.weight'" in x)
    assert "holders=(1, 3)" in line


def test_a_non_end2end_module_cannot_be_pipelined():
    with pytest.raises(CodegenError) as e:
        build_program(_staged("mlp8", [0, 1]), plan_ngpus=2, runtime_ngpus=2, end2end=False,
                      compute_config=PIPE)
    text = str(e.value)
    assert "cuts the graph into 2 pipeline stages, but the module is not end2end" in text
    assert "ComputeConfig(use_end2end=True)" in text


def test_a_pipeline_refuses_compile():
    with pytest.raises(CodegenError, match=r"compile=\.\.\.\) is not supported for a pipelined "
                       r"plan \(this one has 2 stages\)"):
        build_program(_staged("mlp8", [0, 1]), plan_ngpus=2, runtime_ngpus=2, end2end=True,
                      compute_config={**PIPE, "compile": True})


def test_pipeline_nmicros_is_required():
    with pytest.raises(CodegenError, match=r"pas_config has no 'pipeline_nmicros'"):
        build_program(_staged("mlp8", [0, 1]), plan_ngpus=2, runtime_ngpus=2, end2end=True)
    with pytest.raises(CodegenError, match=r"a positive int; got 0"):
        build_program(_staged("mlp8", [0, 1]), plan_ngpus=2, runtime_ngpus=2, end2end=True,
                      pipeline={"pipeline_nmicros": 0})


def test_an_unknown_schedule_lists_the_registered_ones():
    with pytest.raises(UnknownNameError) as e:
        build_program(_staged("mlp8", [0, 1]), plan_ngpus=2, runtime_ngpus=2, end2end=True,
                      pipeline={"pipeline_nmicros": 2, "pipeline_scheduler": "zero_bubble"})
    assert "Registered schedules: 1f1b, 1f1b_interleaved, gpipe" in str(e.value)


def test_a_schedule_that_cannot_run_the_stages():
    """1f1b runs one stage per device; 4 stages on 2 devices need virtual stages."""
    with pytest.raises(CodegenError) as e:
        build_program(_staged("mlp8", [0, 1, 0, 1]), plan_ngpus=2, runtime_ngpus=2,
                      end2end=True, compute_config=PIPE)
    text = str(e.value)
    assert "the schedule '1f1b' for 2 pipeline devices, 2 micro-batches and 2 stages per" in text
    assert "Use '1f1b_interleaved'" in text


@pytest.mark.parametrize("devices,message", [
    ([0, 1, 0, 0], r"stage 3 runs on devices \[0\], but stage s must run on the devices of "
                   r"stage s % p"),
    ([0, 1, 1], r"device 1 runs stages of two pipeline devices \(1 and 2\)"),
    ([0, 1, 0], r"the 3 pipeline stages cannot be laid out on 2 pipeline devices"),
    ([0, 0], None),  # one device set: a single pipeline device, fine
])
def test_stages_must_follow_the_pipeline_layout(devices, message):
    graph = _staged("mlp8", devices)
    if message is None:
        build_program(graph, plan_ngpus=1, runtime_ngpus=1, end2end=True,
                      compute_config={"pas_config": {"pipeline_nmicros": 2,
                                                     "pipeline_scheduler": "gpipe"}})
        return
    with pytest.raises(CodegenError, match=message):
        build_program(graph, plan_ngpus=2, runtime_ngpus=2, end2end=True, compute_config=PIPE)


def test_stage_device_sets_must_not_overlap_and_match_in_size():
    graph = _staged("mlp8", [0, 1])
    first = [op for op in graph.nodes() if op.stage == 0]
    for op in first[:2]:
        copies = graph.replicate(op, 2)
        graph.assign(copies[0], 0)
        graph.assign(copies[1], 2)
    with pytest.raises(CodegenError, match=r"device sets of different sizes"):
        build_program(graph, plan_ngpus=3, runtime_ngpus=3, end2end=True, compute_config=PIPE)
    graph = _staged("mlp8", [0, 1])
    for op in [op for op in graph.nodes() if op.stage == 0][:1]:
        copies = graph.replicate(op, 2)
        graph.assign(copies[0], 0)
        graph.assign(copies[1], 1)
    with pytest.raises(CodegenError, match=r"device 1 runs stages of two pipeline devices"):
        build_program(graph, plan_ngpus=2, runtime_ngpus=2, end2end=True, compute_config=PIPE)


def test_every_device_runs_a_stage():
    with pytest.raises(CodegenError, match=r"devices \[2\] of the 3-device scale unit run no "
                                           r"pipeline stage"):
        build_program(_staged("mlp8", [0, 1]), plan_ngpus=3, runtime_ngpus=3, end2end=True,
                      compute_config=PIPE)


def test_a_pipeline_takes_the_sample_only():
    from nnscaler.codegen.program import _check_pipeline_args

    with pytest.raises(CodegenError, match=r"takes the sample as the first argument"):
        _check_pipeline_args(IRGraph.from_graph(case("mlp8").graph),
                             [("batch", None), ("mask", None)])
