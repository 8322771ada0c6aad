"""train_step and infer_step of pipelined modules: micro-batches, dummy batches,
scale_fn, outputs on every rank, and the errors of a wrong call."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_distributed
from pipeline_helpers import ATOL, RTOL, case, config, generate, micro_batches, plan

from nnscaler.codegen import load_generated_class
from nnscaler.policies import hybrid, pp
from nnscaler.runtime import ParallelModuleError
from nnscaler.runtime.pipeline import (
    Backward,
    Forward,
    PipelineError,
    RecvAct,
    SendAct,
    SendGrad,
    forward_only,
    parse_schedule,
    schedule_lines,
)
from nnscaler.schedule import get_schedule


def _dummy_and_scale(rank, world, outdir, data):
    module = load_generated_class(outdir, rank)(init_params=True)
    outs = module.train_step(data, is_dummy_batch=[False, True, False, False],
                             scale_fn=lambda loss: 2.0 * loss)
    grads = {a: p.grad.clone() for a, p in module.named_parameters()}
    module.sync_grad()
    inferred = module.infer_step(data[:3])
    return [o.item() for o in outs], grads, module.fullmap, [o.item() for o in inferred]


@pytest.mark.parametrize("policy,ngpus,schedule", [
    ("pp", 2, "1f1b"), ("pp", 2, "1f1b_interleaved"), ("hybrid", 4, "1f1b")])
def test_dummy_batches_and_scale_fn(tmp_path, policy, ngpus, schedule):
    """A dummy micro-batch adds no gradient, scale_fn scales the loss before backward,
    every rank gets every micro-batch's loss; infer_step takes any number of samples."""
    cfg = config(ngpus, pipeline_nstages=2, pipeline_nmicros=4, pipeline_scheduler=schedule)
    outdir = generate(tmp_path, "gpt", plan("gpt", {"pp": pp, "hybrid": hybrid}[policy], cfg), cfg)
    data = micro_batches("gpt", 1, 4)[0]
    results = run_distributed(_dummy_and_scale, ngpus, str(outdir), data)
    module = copy.deepcopy(case("gpt").module)
    losses = [module(b) for b in data]
    (2.0 * torch.stack([x for i, x in enumerate(losses) if i != 1]).sum()).backward()
    want = torch.tensor([x.item() for x in losses])
    ref = dict(module.named_parameters())
    for outs, _, _, inferred in results:
        torch.testing.assert_close(torch.tensor(outs), want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(torch.tensor(inferred), want[:3], rtol=RTOL, atol=ATOL)
    totals: dict[str, torch.Tensor] = {}
    for _, grads, fullmap, _ in results:
        for attr, g in grads.items():
            meta = fullmap[attr]
            total = totals.setdefault(meta.orig_name, torch.zeros(meta.shape))
            total[meta.slicers] += g
    for name, total in totals.items():
        torch.testing.assert_close(total, ref[name].grad, rtol=RTOL, atol=ATOL)


def _wrong_calls(rank, world, outdir, data):
    module = load_generated_class(outdir, rank)(init_params=True)
    errors = {}
    for key, call in {
        "count": lambda: module.train_step(data[:3]),
        "dummy": lambda: module.train_step(data, is_dummy_batch=[False]),
        "forward": lambda: module(data[0]),
    }.items():
        try:
            call()
        except ParallelModuleError as e:
            errors[key] = (type(e).__name__, str(e))
    module.train_step(data)  # still works afterwards
    return errors


def test_wrong_calls_say_what_to_do(tmp_path):
    cfg = config(2, pipeline_nmicros=4, pipeline_scheduler="gpipe")
    outdir = generate(tmp_path, "mlp8", plan("mlp8", pp, cfg), cfg)
    data = micro_batches("mlp8", 1, 4)[0]
    for errors in run_distributed(_wrong_calls, 2, str(outdir), data):
        name, text = errors["count"]
        assert name == "PipelineError"
        assert "exactly pipeline_nmicros=4 micro-batches per step, but got 3 samples" in text
        assert "pas_config['pipeline_nmicros']=3" in text
        assert "is_dummy_batch has 1 entries for 4 samples" in errors["dummy"][1]
        assert "is pipelined" in errors["forward"][1] and "train_step(samples)" in errors["forward"][1]


# -- the schedule in generated code -----------------------------------------------------
@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("1f1b_interleaved", 2)])
def test_schedule_text_round_trips(name, v):
    for actions in get_schedule(name)(2, 4, v):
        text = "\n".join(schedule_lines(actions))
        assert parse_schedule(text) == tuple(actions)


def test_schedule_lines_group_messages():
    actions = [Forward(micro=0, stage=0), SendAct(micro=0, stage=0), RecvAct(micro=1, stage=2),
               Backward(micro=0, stage=0)]
    assert schedule_lines(actions) == ["F0@s0", "SEND_ACT 0 s0->s1, RECV_ACT 1 s1->s2", "B0@s0"]
    assert str(SendGrad(micro=2, stage=1)) == "SEND_GRAD 2 s1->s0"


@pytest.mark.parametrize("bad", ["F0s1", "SEND_ACT 0 s1->s3", "RECV 0 s0->s1", "Fx@s0"])
def test_unreadable_schedule_is_an_error(bad):
    with pytest.raises(PipelineError, match="cannot read the schedule action"):
        parse_schedule(bad)


@pytest.mark.parametrize("p,v", [(2, 1), (2, 2), (4, 2), (3, 1)])
def test_forward_only_lists_pair_their_messages_in_order(p, v):
    """The inference lists: every device's messages with a neighbour come in the same
    order on both sides (so they cannot deadlock)."""
    from nnscaler.schedule import stages_of_device

    lists = [forward_only(stages_of_device(d, p, v), p, 3, v) for d in range(p)]
    for d in range(p):
        for e in range(p):
            sent = [(a.micro, a.src) for a in lists[d] if isinstance(a, SendAct)
                    and a.dst % p == e]
            got = [(a.micro, a.src) for a in lists[e] if isinstance(a, RecvAct)
                   and a.src % p == d]
            assert sent == got
    assert all(sum(isinstance(a, Forward) for a in lst) == 3 * v for lst in lists)
