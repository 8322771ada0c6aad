"""Generated code for the parts of a split that talk to each other: a collective part op
(class_parallel_cross_entropy) gets ``group=self.part_group(<plan devices>)``, the ranks
of each scale unit's parts form a process group, the generated ranks reproduce the
module, and a plan whose instances of such an op are not exactly its parts is refused."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import run_parity
from dist_utils import run_distributed
from plan_helpers import fresh, replicate_rest
from torch import nn

from nnscaler import ComputeConfig, parallelize
from nnscaler.codegen import CodegenError, build_program, generate_rank
from nnscaler.codegen.wrap import unwrap
from nnscaler.graph import IRGraph
from nnscaler.models import MLP, MLPConfig
from nnscaler.models import mlp as mlp_module
from nnscaler.ops.builtin.loss import CLASS_PARALLEL_CE
from nnscaler.parallel import paths
from nnscaler.trace import trace

GROUP = "group=self.part_group((0, 1))"


def _loss_lines(src: str) -> list[str]:
    return [line.strip() for line in src.splitlines() if "class_parallel_cross_entropy(" in line]


def _process_groups(src: str) -> list[tuple[int, ...]]:
    (line,) = [ln for ln in src.splitlines() if ln.strip().startswith("process_groups = ")]
    return [tuple(int(r) for r in g.split(",") if r.strip())
            for g in re.findall(r"\(([\d, ]*)\)", line)]


def _class_parallel_mlp(n: int = 2) -> IRGraph:
    """Tensor parallel MLP: every linear on its output features, every gelu on the same
    dim, the loss on its classes (the parts read the split logits where they are)."""
    graph = fresh("mlp")
    for lin in graph.select(name="linear"):
        for device, part in enumerate(graph.partition(lin, idx=1, dim=0, num=n)):
            graph.assign(part, device)
    for act in graph.select(name="gelu"):
        for device, part in enumerate(graph.partition(act, idx=0, dim=-1, num=n)):
            graph.assign(part, device)
    (ce,) = graph.select(name="cross_entropy")
    for device, part in enumerate(graph.partition(ce, idx=0, dim=1, num=n)):
        graph.assign(part, device)
    replicate_rest(graph, n)
    return graph


def test_tp_policy_emits_the_part_group(tmp_path):
    torch.manual_seed(0)
    config = MLPConfig(d_in=8, d_hidden=16, n_classes=4, n_layers=3)
    parallelize(MLP(config), {"batch": mlp_module.make_batch(config, 4)}, "tp",
                ComputeConfig(plan_ngpus=2, runtime_ngpus=4), gen_savedir=tmp_path,
                load_module=False)
    out = paths.outdir_for(tmp_path, MLP, None)
    for rank in range(4):
        src = unwrap((out / f"gencode{rank}.py").read_text())
        (line,) = _loss_lines(src)
        # the plan devices of the parts, in part order, in every scale unit
        assert line.startswith("t") and "nnscaler.runtime.ops.class_parallel_cross_entropy(" in line and GROUP in line
        assert "num_classes=4" in line
        assert ("class_start=2" in line) == (rank % 2 == 1)
        groups = _process_groups(src)
        assert (0, 1) in groups and (2, 3) in groups


class Head(nn.Module):
    """A linear head over 6 classes and its mean cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self.lin(batch["x"]), batch["y"])


def _head_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(3, 4, generator=g), "y": torch.randint(0, 6, (3,), generator=g)}


def _head_plan() -> tuple[Head, IRGraph]:
    """The head and the loss split on the classes, part 0 on device 1 and part 1 on device
    0 (the logits stay where they are): no adapter moves anything."""
    torch.manual_seed(0)
    module = Head()
    graph = IRGraph.from_graph(trace(module, {"batch": _head_batch(0)}))
    (lin,) = graph.select(name="linear")
    (ce,) = graph.select(name="cross_entropy")
    for op, idx, dim in ((lin, 1, 0), (ce, 0, 1)):
        for device, part in zip((1, 0), graph.partition(op, idx=idx, dim=dim, num=2), strict=True):
            graph.assign(part, device)
    return module, graph


def test_the_parts_form_a_process_group_of_each_unit():
    """No adapter: the part group is the only reason for the groups (0, 1) and (2, 3)."""
    _, graph = _head_plan()
    program = build_program(graph, plan_ngpus=2, runtime_ngpus=4, end2end=True)
    assert sorted(program.process_groups) == [(0, 1), (0, 2), (1, 3), (2, 3)]
    assert sorted(program.reducer_groups) == [(0, 2), (1, 3)]
    (step,) = [s for s in program.steps if s.part_devices is not None]
    assert step.part_devices == {0: (1, 0), 1: (1, 0)}  # in part order, not device order
    for rank in range(4):
        src = unwrap(generate_rank(program, rank))
        assert "ADAPTER_" not in src
        (line,) = _loss_lines(src)
        assert "group=self.part_group((1, 0))" in line
        assert ("class_start=3" in line) == (rank % 2 == 0)


def test_parts_in_another_order_than_the_devices_reproduce_the_module(tmp_path):
    """Part 0 runs on rank 1 (and 3): the generated part groups follow the part order."""
    from codegen_helpers import _worker
    from parity_utils import check_parity

    from nnscaler.codegen import emit_files

    module, graph = _head_plan()
    out = tmp_path / "gen"
    emit_files(graph, out, plan_ngpus=2, runtime_ngpus=4, state=module, end2end=True)
    data = [_head_batch(1), _head_batch(2)]
    results = run_distributed(_worker, 4, str(out), data, 2, "train_step", 0)
    per_unit = [module(b) for b in data]
    torch.stack(per_unit).sum().backward()
    ref = {"losses": [[x.item() for x in per_unit]],
           "grads": {n: p.grad.clone() for n, p in module.named_parameters()}, "params": {}}
    check_parity(results, ref, 2, steps=False)


def test_class_parallel_loss_parity_on_two_units(tmp_path):
    """Two scale units of two ranks: the generated ranks' part groups (0, 1) and (2, 3)
    reproduce each unit's loss and every gradient, through three Adam steps."""
    graph = _class_parallel_mlp(2)
    assert [op.opdef.name for op in graph.select(name="cross_entropy")] == [CLASS_PARALLEL_CE] * 2
    run_parity(tmp_path, "mlp", graph, plan_ngpus=2, runtime_ngpus=4)
    src = unwrap((tmp_path / "gen" / "gencode3.py").read_text())
    (line,) = _loss_lines(src)
    assert GROUP in line


def _strided_loss_mlp(*, replicas_first: bool) -> IRGraph:
    """The loss on a unit of 4 in two groups of two talking parts: ``replicas_first``
    replicates the loss and splits each replica on its classes (groups (0, 1), (2, 3));
    otherwise the loss is split on its classes and each part replicated (part ``p``'s
    replica ``j`` on device ``2 p + j``: groups (0, 2), (1, 3))."""
    graph = fresh("mlp")
    (ce,) = graph.select(name="cross_entropy")
    if replicas_first:
        for j, copy in enumerate(graph.replicate(ce, 2)):
            for p, part in enumerate(graph.partition(copy, idx=0, dim=1, num=2)):
                graph.assign(part, 2 * j + p)
    else:
        for p, part in enumerate(graph.partition(ce, idx=0, dim=1, num=2)):
            for j, copy in enumerate(graph.replicate(part, 2)):
                graph.assign(copy, 2 * p + j)
    replicate_rest(graph, 4)
    return graph


@pytest.mark.parametrize("replicas_first", [True, False])
def test_each_instance_gets_the_group_of_its_own_parts(replicas_first):
    """Four instances of the loss in two groups: each rank's call names its own group."""
    graph = _strided_loss_mlp(replicas_first=replicas_first)
    program = build_program(graph, plan_ngpus=4, runtime_ngpus=4)
    want = [(0, 1), (0, 1), (2, 3), (2, 3)] if replicas_first else [(0, 2), (1, 3)] * 2
    assert want[1] != want[2]
    for rank in range(4):
        src = unwrap(generate_rank(program, rank))
        (line,) = _loss_lines(src)
        assert f"group=self.part_group({want[rank]!r})" in line
        assert set(want) <= set(_process_groups(src))


def test_strided_part_groups_reproduce_the_module(tmp_path):
    """Parts replicated alike, their replicas talking over devices (0, 2) and (1, 3):
    the generated ranks reproduce the loss and every gradient."""
    run_parity(tmp_path, "mlp", _strided_loss_mlp(replicas_first=False), plan_ngpus=4,
               runtime_ngpus=4)


def test_parts_on_one_device_are_refused():
    graph = fresh("mlp")
    (ce,) = graph.select(name="cross_entropy")
    for part in graph.partition(ce, idx=0, dim=1, num=2):
        graph.assign(part, 0)
    replicate_rest(graph, 1)
    with pytest.raises(CodegenError, match=r"(?s)two instances of op #\d+ torch.nn.functional."
                                           r"cross_entropy.*run on device 0.*part 0 of 2.*via "
                                           r".*class_parallel_cross_entropy.*assign the "
                                           r"instances to different"):
        build_program(graph, plan_ngpus=1, runtime_ngpus=1)
