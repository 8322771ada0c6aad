"""Custom ops at parallelize: the promise check of their annotations (a lying one is an
error, a passing one is remembered in the process and on disk, an opt-out exists), and
``@register_op`` used as a decorator working in generated code, imported or as source."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_distributed

from nnscaler import ComputeConfig, ReuseType, parallelize
from nnscaler.codegen import CodegenError
from nnscaler.parallel import op_checks
from nnscaler.parallel.op_checks import CustomOpCheckError

from . import custom_ops
from .custom_ops import CALLS, UsesOp, make_batch

pytestmark = [
    pytest.mark.filterwarnings("ignore::nnscaler.trace.OpaqueOpWarning"),
    # graph.pkl cannot pickle a function whose module attribute is its register_op wrapper
    pytest.mark.filterwarnings("ignore:the traced graph could not be saved"),
]

TWO = ComputeConfig(plan_ngpus=2, runtime_ngpus=2)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Checks passed by other tests (or runs) must not hide this test's checks."""
    monkeypatch.setenv("NNSCALER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(op_checks, "_passed", set())


def test_a_lying_annotation_is_an_error_naming_op_dim_and_difference(tmp_path):
    # trained under 'data' with loss 2.049 against 0.513 on one device before this check
    with pytest.raises(CustomOpCheckError) as info:
        parallelize(UsesOp("lying"), make_batch(0), "data", TWO, gen_savedir=tmp_path,
                    load_module=False)
    message = str(info.value)
    assert "'tests.lying_column_norm'" in message
    assert "annotation 'n d -> n d'" in message
    assert "input 0 dim 0 ('n')" in message
    assert "differs from the whole result by up to" in message
    assert "check_custom_ops=False" in message and "'^'" in message
    assert not any(tmp_path.rglob("gencode*.py"))


def test_the_check_can_be_turned_off(tmp_path):
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, check_custom_ops=False)
    parallelize(UsesOp("lying"), make_batch(0), "data", cfg, gen_savedir=tmp_path,
                load_module=False)
    assert any(tmp_path.rglob("gencode1.py"))


def test_an_unsplit_custom_op_is_not_checked(tmp_path):
    # 'dp' on one device splits nothing: the plan never relies on the annotation
    parallelize(UsesOp("lying"), make_batch(0), "dp",
                ComputeConfig(plan_ngpus=1, runtime_ngpus=1), gen_savedir=tmp_path,
                load_module=False)


def test_a_passing_check_runs_once_per_process_and_is_kept_on_disk(tmp_path):
    def compile_once() -> int:
        before = CALLS["row_scale"]
        parallelize(UsesOp("import"), make_batch(0), "data", TWO, gen_savedir=tmp_path,
                    reuse=ReuseType.OVERRIDE, load_module=False)
        return CALLS["row_scale"] - before

    first = compile_once()
    assert first > 1  # the trace ran the op once, the check more often
    assert compile_once() == 1  # checked already in this process: the trace only
    op_checks._passed.clear()  # a new process: the disk cache answers
    assert compile_once() == 1
    markers = list((tmp_path / "cache" / "checked_ops").iterdir())
    assert len(markers) == 1 and "tests.row_scale" in markers[0].read_text()


def _train(pm, model, steps=3):
    opt_p = torch.optim.SGD(pm.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        data = make_batch(step + 1)
        for m, opt in ((pm, opt_p), (model, opt_r)):
            opt.zero_grad()
            loss = m(**data)
            loss.backward()
            opt.step()
        torch.testing.assert_close(pm(**data), model(**data), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["import", "source"])
def test_decorator_form_in_generated_code(tmp_path, which):
    torch.manual_seed(0)
    model = UsesOp(which)
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    one = ComputeConfig(plan_ngpus=1, runtime_ngpus=1)
    pm = parallelize(model, make_batch(0), "dp", one, gen_savedir=tmp_path)
    source = next(tmp_path.rglob("gencode0.py")).read_text()
    if which == "source":
        assert "def row_scale_src(x" in source and "register_op" not in source
        assert "import torch.nn.functional as F" in source
    else:
        assert "custom_ops.row_scale(" in source
    _train(pm, reference)
    # reused files (reuse='match') load and run too, from the saved initial weights
    written = next(tmp_path.rglob("gencode0.py")).stat().st_mtime_ns
    again = parallelize(initial, make_batch(0), "dp", one, gen_savedir=tmp_path)
    assert next(tmp_path.rglob("gencode0.py")).stat().st_mtime_ns == written
    torch.testing.assert_close(again(**make_batch(5)), initial(**make_batch(5)))


def _data_worker(rank, world, gen_savedir):
    torch.manual_seed(0)
    results = {}
    for which in ("import", "source"):
        model = UsesOp(which)
        reference = copy.deepcopy(model)
        pm = parallelize(model, make_batch(0), "data", TWO, gen_savedir=gen_savedir,
                         instance_name=which)
        data = make_batch(7)
        loss_p, loss_r = pm(**data), reference(**data)
        loss_p.backward()
        loss_r.backward()
        results[which] = (float(loss_p), float(loss_r))
    return results


def test_decorator_form_under_data_on_two_processes(tmp_path):
    for result in run_distributed(_data_worker, 2, str(tmp_path)):
        for which, (parallel, single) in result.items():
            assert parallel == pytest.approx(single, rel=1e-5), which


def test_source_that_needs_its_module_is_refused_before_files_are_written(tmp_path):
    with pytest.raises(CodegenError, match=r"uses 'CALLS' from around it.*self-contained.*"
                       r"code_impl_pattern='import'"):
        parallelize(UsesOp("global"), make_batch(0), "dp",
                    ComputeConfig(plan_ngpus=1, runtime_ngpus=1), gen_savedir=tmp_path)
    assert not any(tmp_path.rglob("gencode*.py"))
    assert custom_ops.uses_a_global.__wrapped_op__ == "tests.uses_a_global"


def test_inputs_too_large_to_make_up_are_not_checked_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(op_checks, "MAX_CHECK_ELEMENTS", 10)
    with pytest.warns(UserWarning, match=r"'tests.lying_column_norm' .* was not checked at "
                      r"parallelize: its traced inputs have 64 elements.*verify_op"):
        parallelize(UsesOp("lying"), make_batch(0), "data", TWO, gen_savedir=tmp_path,
                    load_module=False)
