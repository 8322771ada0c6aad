"""``ComputeConfig(compile=...)``: generated code under ``torch.compile``.

The parity run trains the tiny MLP with ``tp`` (every layer split, adapters between them)
on 2 gloo processes with inductor, and checks losses and every parameter piece after 3
Adam steps against one eager process and against the same generated code run eagerly,
at rtol 1e-5. On
these shapes inductor's CPU kernels agree with eager to well within it: its matmuls call
the same BLAS (extern ``mm``), and the fused pointwise kernels (bias, GELU, the loss)
differ from eager by a few ulps at most, so the compiled code is compared with the single
process itself, not with a compiled reference. The run also checks where Dynamo cut the
graph: more than one region per rank (communication broke it) and no collective inside
any compiled region.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_utils import run_distributed

from nnscaler.config import ComputeConfig, ComputeConfigError
from nnscaler.torch_compile import CompileConfig

from .common import ADAM, check_pieces, make_model, reference_train, samples


@pytest.mark.parametrize("value, match", [
    ({"fullgraph": True}, "cannot take 'fullgraph'"),
    ({"backnd": "inductor"}, r"unknown key\(s\) \['backnd'\]"),
    ({"backend": len}, "name of a torch.compile backend"),
    ({"dynamic": "yes"}, "dynamic"),
    ("inductor", "True, False or a dict"),
])
def test_compile_refuses_what_cannot_work(value, match):
    with pytest.raises(ComputeConfigError, match=match):
        ComputeConfig(1, 1, compile=value)


def test_compile_options():
    assert ComputeConfig(1, 1).compiler == CompileConfig()
    assert ComputeConfig(1, 1).compiler.as_options() is None
    cfg = ComputeConfig(1, 2, compile={"backend": "aot_eager", "options": {"a": 1}})
    assert cfg.compiler.as_options() == {"backend": "aot_eager", "dynamic": False,
                                         "options": {"a": 1}}
    assert ComputeConfig(1, 1, compile=True).compiler.as_options() == {
        "backend": "inductor", "dynamic": False}
    assert ComputeConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(cfg)


def _graph_ops(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def _fit(pm: torch.nn.Module, data: list) -> list[list[float]]:
    from nnscaler import build_optimizer

    opt = build_optimizer(pm, torch.optim.Adam, **ADAM)
    losses = []
    for step in data:
        losses.append([float(x) for x in pm.train_step(step[0])])
        opt.step()
        opt.zero_grad()
    return losses


def _train(rank: int, world: int, gen_savedir: str) -> dict:
    import torch._dynamo
    from torch._inductor.compile_fx import compile_fx

    from nnscaler import parallelize
    from nnscaler.runtime.compiling import CompileError

    regions: list[set[str]] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        regions.append(_graph_ops(gm))
        return compile_fx(gm, example_inputs)  # inductor

    torch._dynamo.reset()
    torch._dynamo.register_backend(name="nnscaler_test_counting")(counting)
    data = samples("mlp", 3, 1, 1)
    ref_losses, ref_state = reference_train(make_model("mlp"), data)
    modules = {}
    for name, compile_ in (("eager", False), ("compiled", {"backend": "nnscaler_test_counting"})):
        cfg = ComputeConfig(2, 2, use_end2end=True, compile=compile_)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            modules[name] = parallelize(make_model("mlp"), {"batch": data[0][0][0]}, "tp", cfg,
                                        gen_savedir=gen_savedir, instance_name=name)
    eager, compiled = (_fit(modules[n], data) for n in ("eager", "compiled"))
    for got in (eager, compiled):
        torch.testing.assert_close(torch.tensor(got), torch.tensor([s[0] for s in ref_losses]),
                                   rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-6)
    checked = check_pieces(modules["compiled"], ref_state)
    eager_state = {meta.orig_name: getattr(modules["eager"], attr).detach()
                   for attr, meta in modules["eager"].fullmap.items()}
    for attr, meta in modules["compiled"].fullmap.items():
        torch.testing.assert_close(getattr(modules["compiled"], attr).detach(),
                                   eager_state[meta.orig_name], rtol=1e-5, atol=1e-6)
    pm = modules["compiled"]
    type(pm).compile_config = {"backend": "no_such_backend"}
    with pytest.raises(CompileError, match=r"names a backend torch.compile does not know; "
                                           r"registered backends: \[.*'inductor'"):
        pm._compile()
    return {"checked": checked, "regions": regions}


def test_compiled_tp_matches_one_process(tmp_path):
    results = run_distributed(_train, 2, str(tmp_path))
    for res in results:
        assert res["checked"] > 0
        assert len(res["regions"]) > 1, "communication should split the program into regions"
        comm = [op for ops in res["regions"] for op in ops
                if "c10d" in op or "all_reduce" in op or "all_gather" in op]
        assert not comm, f"collectives inside a compiled region: {comm}"

