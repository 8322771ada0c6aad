"""parallelize in one process (no process group): compiling, loading with runtime_ngpus=1,
every reuse mode, class inputs, and each argument error with no partial files left."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import nnscaler
from nnscaler import ComputeConfig, ParallelModule, ReuseType, gendir, parallelize
from nnscaler.errors import UnknownNameError
from nnscaler.graph import PlanCheckError
from nnscaler.parallel import (
    ComputeConfigError,
    GenFilesError,
    ParallelizeError,
    ReuseMismatchError,
    paths,
    staging,
)
from nnscaler.trace import ForwardSignatureError

from .common import MLP_CONFIG, make_batch, make_model

pytestmark = pytest.mark.filterwarnings("ignore::nnscaler.trace.OpaqueOpWarning")

ONE = ComputeConfig(plan_ngpus=1, runtime_ngpus=1)


@pytest.fixture
def batch():
    return make_batch("mlp", seed=0)


def outdir(tmp_path, cls=None, instance=None):
    from nnscaler.models.mlp import MLP

    return paths.outdir_for(tmp_path, cls or MLP, instance)


def assert_clean(tmp_path, cls=None, instance=None):
    """No directory that MATCH would reuse, and no temporary leftovers."""
    out = outdir(tmp_path, cls, instance)
    assert gendir.read_config(out) is None
    assert not out.exists()
    assert staging.leftover_dirs(out) == []


class Counter:
    """Counts calls of a function it wraps (to see whether code was generated/traced)."""

    def __init__(self, monkeypatch, module, name):
        self.calls = 0
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)


def test_compile_without_process_group(tmp_path, batch):
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=4)
    result = parallelize(make_model("mlp"), {"batch": batch}, "tp", cfg, gen_savedir=tmp_path,
                         load_module=False)
    assert result is None
    out = outdir(tmp_path)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "fullmodel.pt", "gencode0.py", "gencode1.py", "gencode2.py",
                     "gencode3.py", "graph.pkl"]
    saved = json.loads((out / "config.json").read_text())
    assert saved["match"]["compute_config"] == cfg.to_dict()
    assert saved["match"]["policy"] == {"name": "tp"}
    assert saved["module_class"] == "nnscaler.models.mlp.MLP"
    # nnscaler.checkpoint reads the module's state list from here: keep its form
    module = saved["match"]["module"]
    assert module["parameters"][0] == ["layers.0.weight", [16, 8], "torch.float32", True]
    assert module["buffers"] == []
    assert saved["files"] == ["fullmodel.pt", "gencode0.py", "gencode1.py", "gencode2.py",
                              "gencode3.py", "graph.pkl"]
    assert "class GenModel(ParallelModule)" in (out / "gencode3.py").read_text()


def test_load_in_one_process(tmp_path, batch):
    model = make_model("mlp")
    pm = parallelize(model, {"batch": batch}, "dp", ONE, gen_savedir=tmp_path)
    assert isinstance(pm, ParallelModule) and isinstance(pm, nnscaler.ParallelModule)
    torch.testing.assert_close(pm(batch), model(batch))
    cls = parallelize(type(model), {"batch": batch}, "dp", ONE, gen_savedir=tmp_path,
                      module_fn=lambda: make_model("mlp"), instance_name="cls")
    assert isinstance(cls, type) and issubclass(cls, ParallelModule)
    torch.testing.assert_close(cls()(batch), model(batch))


def test_class_with_module_dtype(tmp_path):
    from nnscaler.models.mlp import MLP

    batch = make_batch("mlp", seed=0)
    batch64 = {"x": batch["x"].double(), "y": batch["y"]}
    cls = parallelize(MLP, {"batch": batch64}, "dp", ONE, gen_savedir=tmp_path,
                      module_fn=lambda: MLP(MLP_CONFIG), module_dtype=torch.float64)
    pm = cls()
    assert {p.dtype for p in pm.parameters()} == {torch.float64}
    with pytest.raises(ParallelizeError, match=r"pass module_fn=lambda: MLP\(...\)"):
        parallelize(MLP, {"batch": batch}, "dp", ONE, gen_savedir=tmp_path, instance_name="x")
    assert_clean(tmp_path, instance="x")


def test_init_module_params_false_then_load_weights(tmp_path, batch):
    model = make_model("mlp")
    pm = parallelize(model, {"batch": batch}, "dp", ONE, gen_savedir=tmp_path)
    empty = parallelize(model, {"batch": batch}, "dp", ONE, gen_savedir=tmp_path,
                        init_module_params=False)
    with torch.no_grad():
        for p in empty.parameters():
            p.fill_(7.0)  # whatever it held: not the weights
    assert not torch.allclose(empty(batch), pm(batch))
    empty.load_state_dict(pm.state_dict())
    torch.testing.assert_close(empty(batch), model(batch))


# -- reuse -------------------------------------------------------------------------------
def test_match_reuses_complete_files(tmp_path, batch, monkeypatch):
    import nnscaler.codegen

    parallelize(make_model("mlp"), {"batch": batch}, "tp",
                ComputeConfig(plan_ngpus=2, runtime_ngpus=2), gen_savedir=tmp_path,
                load_module=False)
    config_file = outdir(tmp_path) / "config.json"
    before = config_file.stat().st_mtime_ns
    emits = Counter(monkeypatch, nnscaler.codegen, "emit_files")
    for reuse in ("match", ReuseType.MOO):
        parallelize(make_model("mlp"), {"batch": make_batch("mlp", seed=5)}, "tp",
                    ComputeConfig(plan_ngpus=2, runtime_ngpus=2), gen_savedir=tmp_path,
                    load_module=False, reuse=reuse)
    assert emits.calls == 0 and config_file.stat().st_mtime_ns == before


def test_reuse_warns_when_the_module_holds_other_weights(tmp_path, batch):
    parallelize(make_model("mlp"), {"batch": batch}, "dp", ONE, gen_savedir=tmp_path,
                load_module=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        parallelize(make_model("mlp"), {"batch": batch}, "dp", ONE, gen_savedir=tmp_path,
                    load_module=False)  # the same weights: silent
    with pytest.warns(UserWarning, match="starts from the weights saved with them"):
        pm = parallelize(make_model("mlp", seed=1), {"batch": batch}, "dp", ONE,
                         gen_savedir=tmp_path)
    torch.testing.assert_close(pm(batch), make_model("mlp")(batch))  # the saved ones


def test_match_with_a_different_config_is_an_error(tmp_path, batch):
    parallelize(make_model("mlp"), {"batch": batch}, "tp",
                ComputeConfig(plan_ngpus=2, runtime_ngpus=2), gen_savedir=tmp_path,
                load_module=False)
    out = outdir(tmp_path)
    saved = (out / "config.json").read_text()
    cases = [
        (ComputeConfig(plan_ngpus=2, runtime_ngpus=4), "tp", batch,
         "compute_config.runtime_ngpus: saved 2, now 4"),
        (ComputeConfig(plan_ngpus=2, runtime_ngpus=2, user_config={"v": 2}), "tp", batch,
         'compute_config.user_config.v: not in the saved config, now 2'),
        (ComputeConfig(plan_ngpus=2, runtime_ngpus=2), "data", batch,
         'policy.name: saved "tp", now "data"'),
        (ComputeConfig(plan_ngpus=2, runtime_ngpus=2), "tp", make_batch("mlp", 0, batch_size=8),
         "inputs.batch.x.tensor: saved [4, 8], now [8, 8]"),
    ]
    for cfg, policy, b, message in cases:
        with pytest.raises(ReuseMismatchError, match=message.replace("[", r"\[")) as info:
            parallelize(make_model("mlp"), {"batch": b}, policy, cfg, gen_savedir=tmp_path,
                        load_module=False)
        assert "reuse='override'" in str(info.value)
        assert (out / "config.json").read_text() == saved  # left as it was
        assert staging.leftover_dirs(out) == []


def test_override_and_moo_regenerate(tmp_path, batch, monkeypatch):
    import nnscaler.codegen

    def run(cfg, reuse):
        parallelize(make_model("mlp"), {"batch": batch}, "dp", cfg, gen_savedir=tmp_path,
                    load_module=False, reuse=reuse)
        return json.loads((outdir(tmp_path) / "config.json").read_text())

    emits = Counter(monkeypatch, nnscaler.codegen, "emit_files")
    two, four = (ComputeConfig(plan_ngpus=1, runtime_ngpus=n) for n in (2, 4))
    run(two, "override")
    run(two, "override")
    assert emits.calls == 2
    saved = run(four, "moo")  # differs: regenerated
    assert emits.calls == 3 and saved["match"]["compute_config"]["runtime_ngpus"] == 4
    assert (outdir(tmp_path) / "gencode3.py").exists()
    run(four, "moo")  # matches: reused
    assert emits.calls == 3
    run(two, "override")  # fewer ranks: the old files are gone
    assert not (outdir(tmp_path) / "gencode3.py").exists()


def test_graph_reuses_the_traced_graph(tmp_path, batch, monkeypatch):
    import nnscaler.codegen
    import nnscaler.trace

    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=2)
    parallelize(make_model("mlp"), {"batch": batch}, "tp", cfg, gen_savedir=tmp_path,
                load_module=False)
    traces = Counter(monkeypatch, nnscaler.trace, "trace")
    emits = Counter(monkeypatch, nnscaler.codegen, "emit_files")
    parallelize(make_model("mlp"), {"batch": batch}, "data", cfg, gen_savedir=tmp_path,
                load_module=False, reuse="graph")
    assert (traces.calls, emits.calls) == (0, 1)  # same graph, new plan and code
    saved = json.loads((outdir(tmp_path) / "config.json").read_text())
    assert saved["match"]["policy"] == {"name": "data"}
    # other dummy shapes: the saved graph does not fit, so it is traced again
    parallelize(make_model("mlp"), {"batch": make_batch("mlp", 0, batch_size=8)}, "data", cfg,
                gen_savedir=tmp_path, load_module=False, reuse="graph")
    assert (traces.calls, emits.calls) == (1, 2)


def test_incomplete_directory_is_regenerated(tmp_path, batch, monkeypatch):
    import nnscaler.codegen

    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=2)
    parallelize(make_model("mlp"), {"batch": batch}, "dp", cfg, gen_savedir=tmp_path,
                load_module=False)
    (outdir(tmp_path) / "gencode1.py").unlink()  # e.g. a copy that was interrupted
    emits = Counter(monkeypatch, nnscaler.codegen, "emit_files")
    parallelize(make_model("mlp"), {"batch": batch}, "dp", cfg, gen_savedir=tmp_path,
                load_module=False)
    assert emits.calls == 1 and (outdir(tmp_path) / "gencode1.py").exists()


def test_failed_generation_leaves_nothing_match_would_reuse(tmp_path, batch, monkeypatch):
    import nnscaler.codegen

    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=2)
    parallelize(make_model("mlp"), {"batch": batch}, "dp", cfg, gen_savedir=tmp_path,
                load_module=False)
    original = nnscaler.codegen.emit_files

    def failing(graph, out, **kwargs):
        original(graph, out, **kwargs)  # files written, then a failure
        raise OSError("disk full")

    monkeypatch.setattr(nnscaler.codegen, "emit_files", failing)
    with pytest.raises(OSError, match="disk full"):
        parallelize(make_model("mlp"), {"batch": batch}, "dp", cfg, gen_savedir=tmp_path,
                    load_module=False, reuse="override")
    assert_clean(tmp_path)  # the old files went too (reuse was not MATCH)


# -- errors ------------------------------------------------------------------------------
def test_dummy_args_missing_or_extra(tmp_path, batch):
    with pytest.raises(ForwardSignatureError, match=r"requires the argument\(s\) 'batch'"):
        parallelize(make_model("mlp"), {}, "dp", ONE, gen_savedir=tmp_path)
    with pytest.raises(ForwardSignatureError, match="dummy_forward_args has 'mask'"):
        parallelize(make_model("mlp"), {"batch": batch, "mask": None}, "dp", ONE,
                    gen_savedir=tmp_path)
    from nnscaler.models.mlp import MLP

    with pytest.raises(ForwardSignatureError, match="'x', which MLP.forward does not take"):
        parallelize(MLP, {"x": batch}, "dp", ONE, gen_savedir=tmp_path,
                    module_fn=lambda: make_model("mlp"))
    assert not (tmp_path / "_parallel_modules").exists()


def test_runtime_ngpus_errors(tmp_path, batch):
    with pytest.raises(ComputeConfigError, match="multiple of plan_ngpus"):
        ComputeConfig(plan_ngpus=2, runtime_ngpus=3)
    with pytest.raises(ParallelizeError, match="needs torch.distributed with runtime_ngpus=2"):
        parallelize(make_model("mlp"), {"batch": batch}, "dp",
                    ComputeConfig(plan_ngpus=1, runtime_ngpus=2), gen_savedir=tmp_path)
    assert not (tmp_path / "_parallel_modules").exists()


def test_unplaced_op(tmp_path, batch):
    def forgets_the_last_op(graph, cfg):
        for op in graph.nodes()[:-1]:
            graph.assign(op, 0)
        return graph

    with pytest.raises(PlanCheckError, match=r"(?s)not.*cross_entropy.*mlp\.py:\d+"):
        parallelize(make_model("mlp"), {"batch": batch}, forgets_the_last_op, ONE,
                    gen_savedir=tmp_path)
    assert_clean(tmp_path)


def test_unknown_policy_lists_the_registered_ones(tmp_path, batch):
    with pytest.raises(UnknownNameError, match=r"no policy named 'tpp'.*Did you mean 'tp'.*"
                                               r"Registered policies: .*data.*dp.*tp"):
        parallelize(make_model("mlp"), {"batch": batch}, "tpp", ONE, gen_savedir=tmp_path)
    with pytest.raises(TypeError, match="pas_policy must be a registered policy name"):
        parallelize(make_model("mlp"), {"batch": batch}, 3, ONE, gen_savedir=tmp_path)
    assert not (tmp_path / "_parallel_modules").exists()


def test_policy_must_return_the_graph(tmp_path, batch):
    with pytest.raises(ParallelizeError, match="must return the IRGraph it was given"):
        parallelize(make_model("mlp"), {"batch": batch}, lambda g, c: "done", ONE,
                    gen_savedir=tmp_path)
    assert_clean(tmp_path)


def test_unwritable_gen_savedir(tmp_path, batch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for where in (blocker, blocker / "sub"):
        with pytest.raises(GenFilesError, match="gen_savedir .* (is not a directory|cannot be "
                                                 "created)"):
            parallelize(make_model("mlp"), {"batch": batch}, "dp", ONE, gen_savedir=where)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_argument_errors(tmp_path, batch):
    model = make_model("mlp")
    pm = parallelize(model, {"batch": batch}, "dp", ONE, gen_savedir=tmp_path)
    cases = [
        (dict(module_or_module_class=model, module_fn=lambda: model), ValueError,
         "module_fn only applies when a module class is given"),
        (dict(module_or_module_class=model, module_dtype=torch.float16), ValueError,
         r"module_dtype only applies.*module.to\(dtype\)"),
        (dict(module_or_module_class=pm), ParallelizeError, "already a ParallelModule"),
        (dict(module_or_module_class=type(pm)), ParallelizeError, "already a ParallelModule"),
        (dict(module_or_module_class=int), TypeError, "takes a torch.nn.Module"),
        (dict(compute_config={"plan_ngpus": 1}), TypeError, "must be a nnscaler.ComputeConfig"),
        (dict(reuse="sometimes"), ValueError, "reuse must be a ReuseType"),
        (dict(broadcast_strategy="all"), ParallelizeError,
         "sends files over torch.distributed, which is not initialized"),
        (dict(instance_name="a/b"), ValueError, "instance_name names a directory"),
        (dict(load_module="yes"), TypeError, "load_module must be True or False"),
    ]
    for overrides, error, message in cases:
        kwargs = dict(module_or_module_class=model, dummy_forward_args={"batch": batch},
                      pas_policy="dp", compute_config=ONE, gen_savedir=tmp_path / "errors")
        kwargs.update(overrides)
        with pytest.raises(error, match=message):
            parallelize(**kwargs)
    assert not (tmp_path / "errors").exists()


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch):
        return self.inner(batch) * 2


def test_nested_parallel_module_is_an_error(tmp_path, batch):
    pm = parallelize(make_model("mlp"), {"batch": batch}, "dp", ONE, gen_savedir=tmp_path)
    with pytest.raises(ParallelizeError, match="holds the ParallelModule GenModel at 'inner'"):
        parallelize(Wrapper(pm), {"batch": batch}, "dp", ONE, gen_savedir=tmp_path)
    with pytest.raises(ParallelizeError, match="holds the ParallelModule"):
        parallelize(Wrapper, {"batch": batch}, "dp", ONE, gen_savedir=tmp_path,
                    module_fn=lambda: Wrapper(pm))
    assert_clean(tmp_path, Wrapper)


def test_meta_trace_strategy(tmp_path, batch):
    model = make_model("gpt")
    gbatch = make_batch("gpt", seed=0)
    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=1, trace_strategy="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(model, {"batch": gbatch}, "dp", cfg, gen_savedir=tmp_path)
    torch.testing.assert_close(pm(gbatch), model(gbatch))


def test_zero_stage_auto_takes_the_stage_the_policy_chose(tmp_path, batch):
    """``zero_stage='auto'``: the policy records a stage on the graph
    (``IRGraph.choose_zero_stage``) and the files are generated for it; a policy that
    chooses none is refused, leaving no files."""
    from nnscaler.policies import dp

    def choosing(graph, cfg):
        graph = dp(graph, cfg.resolved(zero_stage=2))
        graph.choose_zero_stage(2)
        return graph

    cfg = ComputeConfig(1, 2, zero_stage="auto")
    parallelize(make_model("mlp"), {"batch": batch}, choosing, cfg, gen_savedir=tmp_path,
                load_module=False)
    code = (outdir(tmp_path) / "gencode0.py").read_text()
    assert "'zero_stage': 2" in code and "'use_zero': True" in code

    def silent(graph, cfg):
        return dp(graph, cfg.resolved(zero_stage=0))

    with pytest.raises(ParallelizeError, match=r"zero_stage='auto': the policy 'test_zero_stage"
                                               r".*silent' chose no ZeRO stage"):
        parallelize(make_model("mlp"), {"batch": batch}, silent, cfg, gen_savedir=tmp_path,
                    instance_name="silent", load_module=False)
    assert_clean(tmp_path, instance="silent")
