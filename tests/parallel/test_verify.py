"""``nnscaler.verify``: equal on every built-in policy, the lying op named by line."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

import nnscaler
from nnscaler import ComputeConfig
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from nnscaler.parallel import VerifyError

from .verify_models import Regressor, regressor_batch

GPT = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, seq_len=8)
REPO = Path(__file__).resolve().parents[2]


def line_of(text: str, obj: object) -> int:
    lines, start = inspect.getsourcelines(obj)
    return start + next(i for i, line in enumerate(lines) if text in line)


def config(policy: str, world: int = 2) -> ComputeConfig:
    plan = 1 if policy == "dp" else world
    pas = {"pipeline_nmicros": 2, "pipeline_nstages": 2} if policy in ("pp", "hybrid") else {}
    return ComputeConfig(plan_ngpus=plan, runtime_ngpus=world, use_end2end=True,
                         pas_config=pas)


@pytest.mark.parametrize("policy", ["dp", "data", "tp", "pp", "hybrid"])
def test_every_builtin_policy_is_equal_on_the_gpt(policy):
    torch.manual_seed(0)
    model = GPTWithLoss(GPT)
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    report = nnscaler.verify(model, {"batch": make_batch(GPT, batch_size=4, seed=0)}, policy,
                             config(policy))
    assert report.equal, str(report)
    assert report.first is None and not report.unrecorded
    # every op output and (but the loss's input-free ops) gradient was compared
    assert report.compared_outputs >= 2 * 50 and report.compared_gradients >= 2 * 50
    assert "equal within tolerance" in str(report)
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)  # the module is untouched
    assert all(p.grad is None for p in model.parameters())


def test_hybrid_on_four_processes_is_equal():
    torch.manual_seed(0)
    cfg = ComputeConfig(plan_ngpus=4, runtime_ngpus=4, use_end2end=True,
                        pas_config={"pipeline_nmicros": 2, "pipeline_nstages": 2})
    report = nnscaler.verify(GPTWithLoss(GPT), {"batch": make_batch(GPT, 4, seed=1)},
                             "hybrid", cfg)
    assert report.equal, str(report)


def test_a_lying_annotation_is_named_with_its_source_line():
    torch.manual_seed(0)
    report = nnscaler.verify(Regressor("lying_norm"), {"batch": regressor_batch()}, "data",
                             config("data"))
    assert not report.equal
    first = report.first
    assert first.kind == "output"
    assert first.op == "verify_models.lying_norm"
    assert first.source.endswith(f"verify_models.py:{line_of('lying_norm(h)', Regressor)}")
    assert "lying_norm(h)" in first.code
    assert first.parallel_layout == ("rank 0: [0:2, :]", "rank 1: [2:4, :]")
    assert first.reference_layout == "f32[4, 8] on one device"
    assert first.max_abs_diff > 1e-3
    text = str(report)
    assert "DIFFERENT" in text and "verify_models.lying_norm" in text and "lying_norm(h)" in text


def test_the_lying_op_is_equal_where_the_plan_does_not_split_its_rows():
    torch.manual_seed(0)
    report = nnscaler.verify(Regressor("lying_norm"), {"batch": regressor_batch()}, "dp",
                             config("dp"))
    assert report.equal, str(report)


def test_a_wrong_backward_is_found_in_backward_order():
    torch.manual_seed(0)
    report = nnscaler.verify(Regressor("odd_backward"), {"batch": regressor_batch()}, "data",
                             config("data"))
    assert not report.equal
    first = report.first
    assert first.kind == "gradient"
    # the gradient reaching the relu's output is what the odd backward sent
    assert first.op == "torch.nn.functional.relu"
    line = line_of("odd_backward(h)", Regressor)
    assert any(c.startswith("verify_models.odd_backward at ") and c.endswith(f":{line}")
               for c in first.consumers), first.consumers
    assert "sent back by the backward of: verify_models.odd_backward" in str(report)


def test_a_wrong_weight_gradient_is_found_after_the_reducers():
    torch.manual_seed(0)
    report = nnscaler.verify(Regressor("scale"), {"batch": regressor_batch()}, "data",
                             config("data"))
    assert not report.equal
    first = report.first
    assert first.kind == "parameter gradient" and first.tensor == "scale"
    assert first.op == "verify_models.scale"
    assert first.source.endswith(f"verify_models.py:{line_of('scale(h, self.scale)', Regressor)}")
    assert report.compared_outputs and report.compared_gradients  # those were all equal
    assert "the gradient of parameter scale, read by op verify_models.scale" in str(report)


def test_a_failing_rank_ends_the_run_with_its_traceback():
    start = time.perf_counter()
    with pytest.raises(VerifyError, match="rank 1 failed running the parallel plan") as e:
        nnscaler.verify(Regressor("fails_on_rank_1"), {"batch": regressor_batch()}, "data",
                        config("data"), timeout=120)
    assert "fails here on purpose" in str(e.value)
    assert time.perf_counter() - start < 60  # rank 0, waiting for rank 1, was stopped


def _verify_in_group(rank: int, world: int) -> str:
    torch.manual_seed(0)
    report = nnscaler.verify(Regressor("lying_norm"), {"batch": regressor_batch()}, "data",
                             config("data"))
    return f"{report.equal} {report.first.op} {report.first.source}"


def test_under_a_process_group_every_rank_gets_the_report():
    first, second = run_distributed(_verify_in_group, 2)
    assert first == second
    assert first.startswith("False verify_models.lying_norm ")


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        nnscaler.verify("model", {}, "tp", config("tp"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ComputeConfig"):
        nnscaler.verify(Regressor(), {"batch": regressor_batch()}, "tp", {"plan_ngpus": 2})


MODEL_FILE = """
import torch
from nnscaler.models.gpt import GPTConfig, GPTWithLoss, make_batch
from parallel import verify_models  # tests/parallel, as pytest imports it

CONFIG = GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, seq_len=8)


def gpt():
    torch.manual_seed(0)
    return GPTWithLoss(CONFIG)


def gpt_inputs():
    return {"batch": make_batch(CONFIG, batch_size=4, seed=0)}


def lying():
    torch.manual_seed(0)
    return verify_models.Regressor("lying_norm")


def lying_inputs():
    return {"batch": verify_models.regressor_batch()}
"""


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(MODEL_FILE))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), str(REPO)])}
    return subprocess.run([sys.executable, "-m", "nnscaler", "verify", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_command_names_the_lying_op_with_exit_status_1(tmp_path):
    done = _cli(tmp_path, "mymodels:lying", "mymodels:lying_inputs", "--policy", "data",
                "--pas-config", "{}")
    assert done.returncode == 1, done.stdout + done.stderr
    line = line_of("lying_norm(h)", Regressor)
    assert "first difference: the output 0" in done.stdout
    assert f"verify_models.py:{line}" in done.stdout


def _main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    """``python -m nnscaler verify ...`` in this process (faster than a subprocess)."""
    from nnscaler.__main__ import main

    (tmp_path / "mymodels.py").write_text(textwrap.dedent(MODEL_FILE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return main(["verify", *args])


def test_the_command_reports_equal_with_exit_status_0(tmp_path, monkeypatch, capsys):
    status = _main(tmp_path, monkeypatch, "mymodels:gpt", "mymodels:gpt_inputs",
                   "--policy", "pp", "--pas-config", '{"pipeline_nmicros": 2}')
    out, err = capsys.readouterr()
    assert status == 0, out + err
    assert "policy 'pp', plan_ngpus=2, runtime_ngpus=2: equal within tolerance" in out


@pytest.mark.parametrize("args, message", [
    (["mymodels.gpt", "mymodels:gpt_inputs", "--policy", "tp"], "'package.module:name'"),
    (["mymodels:nothing", "mymodels:gpt_inputs", "--policy", "tp"], "has no attribute"),
    (["nowhere:gpt", "mymodels:gpt_inputs", "--policy", "tp"], "cannot import 'nowhere'"),
    (["mymodels:gpt", "mymodels:gpt_inputs", "--policy", "tp", "--pas-config", "{x"],
     "--pas-config must be JSON"),
])
def test_the_command_explains_what_it_cannot_run(tmp_path, monkeypatch, capsys, args, message):
    assert _main(tmp_path, monkeypatch, *args) == 2
    assert message in capsys.readouterr().err


def test_verify_error_is_an_nnscaler_error():
    assert issubclass(VerifyError, nnscaler.NNScalerError)


def test_auto_fields_are_resolved_from_the_plan():
    """``zero_stage='auto'`` (and ``plan_ngpus='auto'``): verify runs the stage and the
    unit size the policy chose, as ``parallelize`` does."""
    from nnscaler.policies import dp

    def choosing(graph, cfg):
        graph = dp(graph, cfg.resolved(1, zero_stage=1))
        graph.choose_zero_stage(1)
        return graph

    torch.manual_seed(0)
    report = nnscaler.verify(GPTWithLoss(GPT), {"batch": make_batch(GPT, batch_size=4, seed=0)},
                             choosing, ComputeConfig("auto", 2, use_end2end=True,
                                                     zero_stage="auto"))
    assert report.equal and report.plan_ngpus == 1, str(report)
