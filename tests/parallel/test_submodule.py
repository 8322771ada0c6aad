"""A parallelized submodule inside an ordinary model: the parent keeps it as a child and
the rest of the model runs data parallel across scale units."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from dist_utils import run_distributed
from submodule_models import Heavy, Parent

from .common import ADAM, check_pieces


def _data(steps: int, units: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    return [[(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
             for _ in range(units)] for _ in range(steps)]


def _reference(data):
    torch.manual_seed(0)
    model = Parent(Heavy())
    opt = torch.optim.Adam(model.parameters(), **ADAM)
    losses = []
    for step in data:
        opt.zero_grad()
        row = []
        for x, y in step:
            loss = model(x, y)
            loss.backward()
            row.append(loss.item())
        opt.step()
        losses.append(row)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world, plan_ngpus, use_zero, gen_savedir):
    from nnscaler import ComputeConfig, ParallelModule, build_optimizer, parallelize

    units = world // plan_ngpus
    data = _data(3, units)
    ref_losses, ref_state = _reference(data)
    cfg = ComputeConfig(plan_ngpus=plan_ngpus, runtime_ngpus=world, use_zero=use_zero)
    torch.manual_seed(0)
    heavy = Heavy()
    # like the real input, it needs a gradient (and is drawn off the global RNG)
    dummy = torch.randn(4, 8, generator=torch.Generator()).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pheavy = parallelize(heavy, {"x": dummy}, "tp", cfg, gen_savedir=gen_savedir,
                             instance_name=f"p{plan_ngpus}r{world}z{int(use_zero)}")
    model = Parent(pheavy)
    assert isinstance(model.heavy, ParallelModule)
    opt = build_optimizer(model, torch.optim.Adam, cfg, **ADAM)
    reducer = opt._non_parallel_module_reducer
    assert reducer is not None and reducer.ranks == cfg.replica_ranks(rank)
    unit = rank // plan_ngpus
    losses = []
    for step in data:
        loss = model(*step[unit])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([r[unit] for r in ref_losses]),
                               rtol=1e-5, atol=1e-6)
    for name in ("pre.weight", "pre.bias", "post.weight", "post.bias"):
        torch.testing.assert_close(model.get_parameter(name).detach(), ref_state[name],
                                   rtol=1e-5, atol=1e-6)
    return check_pieces(model.heavy, ref_state, prefix="heavy.")


def test_submodule_tp_inside_data_parallel_model(tmp_path):
    checked = run_distributed(_worker, 4, 2, False, str(tmp_path))
    assert all(c == 3 for c in checked)


def test_submodule_with_zero(tmp_path):
    checked = run_distributed(_worker, 2, 1, True, str(tmp_path))
    assert all(c == 3 for c in checked)


def _guard_worker(rank, world, gen_savedir):
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.runtime import ParallelModuleError

    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=2)
    torch.manual_seed(0)
    dummy = torch.randn(4, 8)  # does not require grad, but the real input will
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Parent(parallelize(Heavy(), {"x": dummy}, "tp", cfg, gen_savedir=gen_savedir))
        cls = parallelize(Heavy, {"x": dummy}, "tp", cfg, gen_savedir=gen_savedir)
    x = torch.randn(4, 8)
    messages = []
    for heavy in (model.heavy, cls()):
        with torch.no_grad():
            heavy(x.requires_grad_())  # no gradients: nothing to get wrong
        heavy(x.detach())  # an input without grad is fine
        try:
            heavy(x.detach().requires_grad_())
        except ParallelModuleError as e:
            messages.append(str(e))
    # the check is in the generated file itself, for whoever loads it
    code = list(Path(gen_savedir).rglob(f"gencode{rank}.py"))
    assert code and all("boundary.data_input(x, 'x')" in f.read_text() for f in code)
    return messages


def test_input_that_needs_grad_but_was_traced_without(tmp_path):
    for messages in run_distributed(_guard_worker, 2, str(tmp_path)):
        assert len(messages) == 2
        assert all("the forward argument 'x' requires grad, but its dummy value did not"
                   in m for m in messages)
